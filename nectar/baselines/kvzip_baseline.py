"""kvzip: keys scored by reconstructing the document (max over its spans), one budget across all
layers and KV heads, sinks kept, optionally with the fitted β and values — each switched by a
SelectionConfig setting. The mechanics (reconstruction capture, allocation, building the state) are
in kvzip.py; this file fits them together as a baseline."""
from __future__ import annotations

import dataclasses

import numpy as np
import torch

from ..base_model import BaseLM
from ..layout import PromptLayout
from ..modules.builder import ModulePlan
from ..schemas.config import SelectionConfig
from .init import MAX_FIT_TOKENS, QueryTargets, training_queries
from .interface import Baseline, FitInputs, FittedBaseline
from .kvzip import allocate, anchor_mask, build_selected, recon_capture, selection_plan, template_mask


def fit_kvzip(base: BaseLM, layout: PromptLayout, document: str, doc_kv, targets,
              plan: ModulePlan, select: SelectionConfig, spans: list[tuple[str, str]],
              seed: int = 0) -> FittedBaseline:
    """KVzip-style selection (and the closed-form fit) in the budget of ``plan``: reconstruct the
    document's ``spans`` ((instruction, response), nectar/stages/recon.py) against its exact KV,
    keep the best keys, fit β and values (nectar/baselines/kvzip.py). ``targets``: the targets (a
    URL or an open ``TargetsData``) whose train queries join the fit (``fit_queries``), or None."""
    cap = recon_capture(base, layout, doc_kv, spans, select.aggregate)
    template = template_mask(layout, document) if select.template_tokens else None
    per_pair = 2 * plan.head_dim + (1 if select.fit else 0)
    kept = allocate(cap.scores, plan, per_pair, select.budget, anchor_mask(layout.n, select.sink_tokens, template))
    qplan = selection_plan(plan, kept, select.fit)
    queries = None
    if select.fit:
        queries = QueryTargets(cap.q, cap.alpha, cap.A)
        if len(queries.q) > MAX_FIT_TOKENS:
            keep = torch.from_numpy(np.sort(np.random.default_rng(seed).choice(len(queries.q), MAX_FIT_TOKENS,
                                                                               replace=False)))
            queries = QueryTargets(queries.q[keep], queries.alpha[keep], queries.A[keep])
        if select.fit_queries == "recon+train" and targets is not None:
            train = training_queries(targets, seed)
            queries = QueryTargets(torch.cat([queries.q, train.q.float()]), torch.cat([queries.alpha, train.alpha.float()]),
                                   torch.cat([queries.A, train.A.float()]))
    module = build_selected(qplan, kept, doc_kv, queries)
    return FittedBaseline("kvzip", module, qplan, scores=cap.scores)  # scores [L, Hkv, n]: what the allocation ranked


class KVzip(Baseline):
    name = "kvzip"
    reads_document = True

    def plan(self, plan: ModulePlan, bits: int | None = None) -> ModulePlan:
        """The budget the selection allocates: the module plan's total bytes, its pairs stored at
        ``bits``; how many keys each (layer, head) keeps is the selection's (``selection_plan`` in fit)."""
        return plan if bits is None else dataclasses.replace(plan, bits=bits)

    def fit(self, plan: ModulePlan, inputs: FitInputs) -> FittedBaseline:
        if inputs.base is None or inputs.layout is None or inputs.document is None or inputs.select is None:
            raise ValueError("kvzip selects keys by reconstructing the document: pass base, layout, document, "
                             "spans and select in FitInputs")
        return fit_kvzip(inputs.base, inputs.layout, inputs.document, inputs.doc_kv, inputs.targets,
                         self.plan(plan, inputs.bits), inputs.select, list(inputs.spans), seed=inputs.seed)
