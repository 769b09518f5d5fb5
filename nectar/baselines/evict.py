"""evict: per (layer, KV head), the exact KV of the p_ℓ document tokens that receive the most
attention mass from the training queries (offline H2O/SnapKV-style eviction; selection.py scores
the keys), p_ℓ from the layer's budget P_ℓ."""
from __future__ import annotations

from ..modules.builder import ModulePlan
from .frozen_init import FrozenInit, pairs_per_layer, plan_bits, quadrature_plan


class Evict(FrozenInit):
    name = "evict"
    init = "evict"

    def plan(self, plan: ModulePlan, bits: int | None = None) -> ModulePlan:
        bits = plan_bits(plan, bits)
        return quadrature_plan(plan, pairs_per_layer(plan, False, bits), False, bits)
