"""attention_matching: the evicted keys with a fitted log-mass bias β (NNLS) and least-squares values
(Zweiger et al. 2026, "Fast KV compaction via attention matching"; the closed form is in
matching_fit.py); p_ℓ = P_ℓ / (2d + 1) so the biases fit in the budget. At bits < 32 the fit is
aware of the rounding (init.py)."""
from __future__ import annotations

from ..modules.builder import ModulePlan
from .frozen_init import FrozenInit, pairs_per_layer, plan_bits, quadrature_plan
from .matching_fit import fit_log_mass, fit_values  # noqa: F401  (the closed form, where kvzip.py reads it)


class AttentionMatching(FrozenInit):
    name = "attention_matching"
    init = "attention_matching"

    def plan(self, plan: ModulePlan, bits: int | None = None) -> ModulePlan:
        bits = plan_bits(plan, bits)
        return quadrature_plan(plan, pairs_per_layer(plan, True, bits), True, bits)
