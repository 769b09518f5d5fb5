"""attention_matching: the evicted keys with a fitted log-mass bias β (NNLS) and least-squares values
(Zweiger et al. 2026, "Fast KV compaction via attention matching"; the closed form is in
matching_fit.py); p_ℓ = P_ℓ / (2d + 1) so the biases fit in the budget. Reads the document KV and
the training queries.

At ``plan.bits`` < 32 the fit is aware of the rounding: β is fitted to the masses of the quantized
keys, and the values to the attention of the quantized keys and β."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..modules.builder import ModulePlan, NectarModule
from .frozen_init import (FrozenInit, HeadSelection, pairs_per_layer, plan_bits, quadrature_plan, select_per_head,
                          stored_rows)
from .interface import FitInputs
from .matching_fit import fit_log_mass, fit_values
from .selection import KeyScore, attention_probs


@dataclass(frozen=True)
class AttentionMatching(FrozenInit):
    score: KeyScore = "mean"  # how a key's attention mass is aggregated over the queries

    name = "attention_matching"
    READS = frozenset({"doc_kv", "train_queries"})

    def plan(self, plan: ModulePlan, bits: int | None = None) -> ModulePlan:
        bits = plan_bits(plan, bits)
        return quadrature_plan(plan, pairs_per_layer(plan, True, bits), True, bits)

    def init_pairs(self, module: NectarModule, plan: ModulePlan, inputs: FitInputs) -> None:
        if not plan.quad_bias:
            raise ValueError("attention_matching init fits a log-mass bias: set train.module.bias=true")
        select_per_head(module, plan, inputs.doc_kv, self.queries(inputs), self.score, fit_head)


def kept_mass(sel: HeadSelection, plan: ModulePlan) -> tuple[torch.Tensor, torch.Tensor]:
    """The kept keys as stored [p, d] and the queries' relative masses on them [T·g, p]."""
    Wh = stored_rows(plan)(sel.keys[sel.idx])
    mass = attention_probs(sel.q, sel.alpha, Wh, plan.scaling) if plan.bits < 32 else sel.probs[:, sel.idx]
    return Wh, mass


def fit_head(sel: HeadSelection, plan: ModulePlan) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    quant = stored_rows(plan)
    Wh, mass = kept_mass(sel, plan)
    beta = fit_log_mass(mass)  # [p]; float64 from NNLS, kept so at 32 bits the fit is unchanged
    if plan.bits < 32:
        beta = quant(beta.float())
    return Wh, quant(fit_values(mass, beta, sel.A, sel.values[sel.idx]).float()), beta.float()
