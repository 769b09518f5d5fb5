"""truncate: the exact KV of the first ⌊ρ·n⌋ context tokens in every layer — the document cut to fit
the budget, keeping its START (the chat template's header — the attention sink — and the first part
of the text). The same tokens in every layer (a cut document is the same in each), so the count is
the mean per-head bytes 4·ρ·2nd of the float32 KV, not the per-layer budgets."""
from __future__ import annotations

from ..modules.budget import pairs_in_bytes
from ..modules.builder import ModulePlan
from .frozen_init import FrozenInit, plan_bits, quadrature_plan


class Truncate(FrozenInit):
    name = "truncate"
    init = "first"

    def plan(self, plan: ModulePlan, bits: int | None = None) -> ModulePlan:
        bits = plan_bits(plan, bits)
        d, n = plan.head_dim, plan.n_context
        p = max(1, min(n, pairs_in_bytes(4 * plan.rho * n * 2 * d * (1 + 1e-9), d, False, bits, plan.quant_group)))
        return quadrature_plan(plan, (p,) * plan.num_layers, False, bits)
