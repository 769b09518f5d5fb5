"""attention_matching_kv: the β-free refit — keys selected as for evict, least-squares values with no
bias, and the SAME p in every layer (the plan's total over 2d per head and layer): plain KV of
m = p pseudo-tokens, which vLLM serves (nectar.serving.vllm_state)."""
from __future__ import annotations

from ..modules.budget import pairs_in_bytes
from ..modules.builder import ModulePlan
from .frozen_init import FrozenInit, plan_bits, quadrature_plan


class AttentionMatchingKV(FrozenInit):
    name = "attention_matching_kv"
    init = "attention_matching_kv"

    def plan(self, plan: ModulePlan, bits: int | None = None) -> ModulePlan:
        bits = plan_bits(plan, bits)
        d, n = plan.head_dim, plan.n_context
        p = max(1, min(n, pairs_in_bytes(4 * sum(plan.budgets) // plan.num_layers, d, False, bits, plan.quant_group)))
        return quadrature_plan(plan, (p,) * plan.num_layers, False, bits)
