"""kvzip: keys scored by reconstructing the document (max over its spans), one budget across all
layers and KV heads, sinks kept, optionally with the fitted β and values — each switched by a
SelectionConfig setting. The mechanics (reconstruction capture, allocation, building the state) are
in kvzip.py; this file fits them together as a baseline."""
from __future__ import annotations

import dataclasses
import time

import numpy as np
import torch

from ..base_model import BaseLM
from ..layout import PromptLayout
from ..modules.budget import ragged_pair_bytes
from ..modules.builder import ModulePlan
from ..schemas.config import SelectionConfig
from .init import MAX_FIT_TOKENS, QueryTargets, training_queries
from .interface import Baseline, FitInputs, FittedBaseline
from .kvzip import (allocate, anchor_mask, build_selected, combined_scores, recon_capture, selection_plan,
                    template_mask, train_scores)


def fit_kvzip(base: BaseLM, layout: PromptLayout, document: str, doc_kv, targets,
              plan: ModulePlan, select: SelectionConfig, spans: list[tuple[str, str]],
              seed: int = 0, timings: dict[str, float] | None = None) -> FittedBaseline:
    """KVzip-style selection (and the closed-form fit) in the bytes of ``plan``, stored at
    ``plan.bits``: reconstruct the document's ``spans`` ((instruction, response),
    nectar/queries/recon.py) against its exact KV, keep the best keys (as many as the bytes buy at
    that precision), fit β and values (nectar/baselines/kvzip.py). ``targets``: the targets (a URL or
    an open ``TargetsData``) whose train queries join the ranking (``score_queries``) and the fit
    (``fit_queries``), or None. ``timings``: seconds of each part added to it (recon_s, allocate_s and
    build_selected's fit_mass_s / fit_values_s), for the first state's profile."""
    timings = {} if timings is None else timings
    start = time.perf_counter()
    cap = recon_capture(base, layout, doc_kv, spans, select.aggregate)
    timings["recon_s"] = timings.get("recon_s", 0.0) + time.perf_counter() - start
    template = template_mask(layout, document) if select.template_tokens else None
    pair_bytes = ragged_pair_bytes(plan.head_dim, select.fit, plan.bits, plan.quant_group)
    uses_train = targets is not None and ((select.fit and "train" in select.fit_queries)
                                          or "train" in select.score_queries)
    train = training_queries(targets, seed) if uses_train else None
    scores = cap.scores
    if select.score_queries == "recon+train" and train is not None:
        cut = 4 * plan.num_kv_heads * sum(plan.budgets) // pair_bytes
        scores = combined_scores(cap.scores, train_scores(train, doc_kv.keys, plan.scaling, select.aggregate), cut)
    start = time.perf_counter()
    kept = allocate(scores, plan, pair_bytes, select.budget, anchor_mask(layout.n, select.sink_tokens, template))
    timings["allocate_s"] = timings.get("allocate_s", 0.0) + time.perf_counter() - start
    qplan = selection_plan(plan, kept, select.fit)
    queries = None
    if select.fit:
        queries = QueryTargets(cap.q, cap.alpha, cap.A)
        if len(queries.q) > MAX_FIT_TOKENS:
            keep = torch.from_numpy(np.sort(np.random.default_rng(seed).choice(len(queries.q), MAX_FIT_TOKENS,
                                                                               replace=False)))
            queries = QueryTargets(queries.q[keep], queries.alpha[keep], queries.A[keep])
        if select.fit_queries == "recon+train" and train is not None:
            queries = QueryTargets(torch.cat([queries.q, train.q.float()]), torch.cat([queries.alpha, train.alpha.float()]),
                                   torch.cat([queries.A, train.A.float()]))
    module = build_selected(qplan, kept, doc_kv, queries, select.quant_aware, timings=timings)
    return FittedBaseline("kvzip", module, qplan, scores=scores)  # scores [L, Hkv, n]: what the allocation ranked


class KVzip(Baseline):
    """Its real pairs stored at ``FitInputs.bits`` (float32, or int8/int4 codes with β bf16): as many
    as the module plan's bytes buy at that precision."""

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
