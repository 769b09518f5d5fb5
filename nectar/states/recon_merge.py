"""recon_merge — recon_fit's keys, with every evicted key merged into a kept one instead of dropped (issue 38's
lever "merging evicted tokens into kept ones"; the idea of CaM / D2O / KVMerger-style merging, here with the
log-mass bias β a quadrature state already stores).

  1. select  recon_fit's selection (``select_recon``: the same ranking, allocation and bytes — β is stored,
             as recon_fit's fit stores it) and its fit queries (the reconstruction's response tokens)
  2. assign  each evicted key of a (layer, KV head) to the kept key it is most similar to (cosine of the
             keys: merged keys attend alike, so one key with a larger mass stands in for both)
  3. merge   per kept key i, M_i = Σ_q m_q(k_i) + Σ_{j→i} Σ_q m_q(k_j) — the attention mass it and its
             merged keys hold over the fit queries (m_q(k) = exp(s·q·k − α_q), α_q the query's log-sum-exp
             over the whole document). β_i = log(M_i / Σ_q m_q(k̂_i)), with k̂_i the key as stored, so the
             state holds the document's total mass on the fit queries; the value is the mass-weighted mean
             of the merged values, so the mass-weighted sum of values is kept as well.

No least squares: where recon_fit solves β and values jointly for the fit queries' outputs, merging keeps
two totals. Measured against the fit in docs/quality.md ("Merging evicted keys instead of fitting").
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..modules.builder import ModulePlan
from ..modules.provider import grouped_targets
from ..modules.stored import quantize_module_
from .interface import FitInputs, FittedState
from .recon_fit import ReconFit, select_recon
from .merging import merge_head
from .reconstruction import build_selected

@torch.no_grad()
def merge_state(plan: ModulePlan, kept: list[list[torch.Tensor]], doc_kv, queries):
    """The module of the kept keys (stored on ``plan.bits``' grid) with every evicted key merged in."""
    module = build_selected(plan, kept, doc_kv)  # the kept keys as stored, β = 0, their own values
    hkv = plan.num_kv_heads
    for layer, (net, heads) in enumerate(zip(module.layers, kept)):
        q, alpha, _ = grouped_targets(queries, layer, hkv)  # [T·g, Hkv, d], [T·g, Hkv]
        keys = doc_kv.keys[layer].detach().float().cpu()  # [Hkv, n, d]
        values = doc_kv.values[layer].detach().float().cpu()
        for h, idx in enumerate(heads):
            c = idx.numel()
            if c == 0:
                continue
            beta, Z = merge_head(q[:, h], alpha[:, h], keys[h], values[h], idx, net.W[h, :c].float(), plan.scaling)
            net.beta[h, :c] = beta
            net.Z[h, :c] = Z
    return quantize_module_(module).eval()  # values onto their grid, β to bf16


@dataclass(frozen=True)
class ReconMerge(ReconFit):
    """recon_fit's fields; ``fit_pairs`` must stay true (β is stored and the fit queries are captured), but
    β and the values come from merging, not from the least-squares fit."""

    name = "recon_merge"

    def fit(self, plan: ModulePlan, inputs: FitInputs) -> FittedState:
        if not self.fit_pairs:
            raise ValueError("recon_merge stores β and reads the fit queries: set fit=true")
        self._check(inputs)
        s = select_recon(inputs.base, inputs.layout, inputs.document, inputs.doc_kv, inputs.targets,
                         self.plan(plan, inputs.bits), self.select, list(inputs.spans), seed=inputs.seed)
        return FittedState(self.name, merge_state(s.plan, s.kept, inputs.doc_kv, s.queries), s.plan, scores=s.scores)
