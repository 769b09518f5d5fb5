"""attention_matching_kv: the β-free refit — keys selected as for evict, least-squares values with no
bias, and the SAME p in every layer (the plan's total over 2d per head and layer): plain KV of
m = p pseudo-tokens, which vLLM serves (nectar.serving.vllm_state)."""
from __future__ import annotations

from ..modules.builder import ModulePlan
from .frozen_init import FrozenInit, plan_bits, same_pairs_in_every_layer


class AttentionMatchingKV(FrozenInit):
    name = "attention_matching_kv"
    init = "attention_matching_kv"

    def plan(self, plan: ModulePlan, bits: int | None = None) -> ModulePlan:
        head_bytes = 4 * sum(plan.budgets) // plan.num_layers
        return same_pairs_in_every_layer(plan, head_bytes, plan_bits(plan, bits))
