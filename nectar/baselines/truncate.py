"""truncate: the exact KV of the first ⌊ρ·n⌋ context tokens in every layer — the document cut to fit
the budget, keeping its START (the chat template's header — the attention sink — and the first part
of the text). The same tokens in every layer (a cut document is the same in each), so the count is
the mean per-head bytes 4·ρ·2nd of the float32 KV, not the per-layer budgets."""
from __future__ import annotations

from ..modules.builder import ModulePlan
from .frozen_init import FrozenInit, plan_bits, same_pairs_in_every_layer


class Truncate(FrozenInit):
    name = "truncate"
    init = "first"

    def plan(self, plan: ModulePlan, bits: int | None = None) -> ModulePlan:
        head_bytes = 4 * plan.rho * plan.n_context * 2 * plan.head_dim * (1 + 1e-9)
        return same_pairs_in_every_layer(plan, head_bytes, plan_bits(plan, bits))
