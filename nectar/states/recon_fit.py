"""recon_fit — the product's state method: keys scored by reconstructing the document (max over its
spans; KVzip's context reconstruction), one budget across all layers and KV heads, sinks kept, then β
and values fitted in closed form — each switched by one of its settings (the fields below, which
mirror ``SelectionConfig``: a run's are ``train.module.select``). Formerly named ``kvzip``.

The mechanics (reconstruction capture, allocation, building the state) are in reconstruction.py;
this file fits them together. Reads the document KV and the document (the model reconstructs it),
and the targets' train queries when ``score_queries`` or ``fit_queries`` say so.
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from ..base_model import BaseLM
from ..layout import PromptLayout
from ..modules.budget import ragged_pair_bytes
from ..modules.builder import ModulePlan, NectarModule
from ..schemas.config import ModuleConfig, SelectionConfig
from .greedy_keys import GREEDY_SHARE, chooses_greedy, greedy_kept, kept_share
from .interface import FitInputs, FittedState, StateMethod
from .reconstruction import (ReconCapture, allocate, anchor_mask, build_selected, combined_scores, recon_capture,
                             selection_plan, template_mask, train_scores)
from .train_queries import MAX_FIT_TOKENS, QueryTargets, training_queries


@dataclass(frozen=True)
class Selection:
    """What recon_fit keeps before it fits: the kept keys of each (layer, KV head), the plan holding them,
    the fit queries (None without ``select.fit``) and the scores [L, Hkv, n] the allocation ranked."""

    plan: ModulePlan
    kept: list[list[torch.Tensor]]  # [L][Hkv] → indices into the document [c]
    queries: QueryTargets | None
    scores: torch.Tensor


def select_recon(base: BaseLM, layout: PromptLayout, document: str, doc_kv, targets, plan: ModulePlan,
                 select: SelectionConfig, spans: list[tuple[str, str]], seed: int = 0,
                 timings: dict[str, float] | None = None) -> Selection:
    """recon_fit's keys in the bytes of ``plan`` at ``plan.bits``, and its fit queries: reconstruct the
    document's ``spans`` ((instruction, response), nectar/queries/recon.py) against its exact KV, keep the
    best keys (as many as the bytes buy at that precision). ``targets``: the targets (a URL or an open
    ``TargetsData``) whose train queries join the ranking (``score_queries``) and the fit
    (``fit_queries``), or None. ``timings``: seconds of each part added to it (recon_s, allocate_s, …)."""
    timings = {} if timings is None else timings
    cap, train, scores = ranking(base, layout, doc_kv, targets, plan, select, spans, seed, timings)
    pair_bytes = ragged_pair_bytes(plan.head_dim, select.fit, plan.bits, plan.quant_group)
    start = time.perf_counter()
    kept_always = anchors(layout, document, select)  # [n] bool
    kept = allocate(scores, plan, pair_bytes, select.budget, kept_always)
    timings["allocate_s"] = timings.get("allocate_s", 0.0) + time.perf_counter() - start
    queries = None
    if select.fit:
        start = time.perf_counter()
        gapped = [recon_capture(base, layout, doc_kv, spans, select.aggregate, gap=g, window=select.score_window)
                  for g in select.fit_gaps]
        timings["recon_gaps_s"] = timings.get("recon_gaps_s", 0.0) + time.perf_counter() - start
        queries = fit_queries(cap, train, select, seed, gapped)
        if chooses_greedy(select.key_choice, kept, layout.n):
            start = time.perf_counter()
            kept = greedy_kept(kept, scores, queries, doc_kv, plan.scaling, kept_always)
            timings["key_choice_s"] = timings.get("key_choice_s", 0.0) + time.perf_counter() - start
    return Selection(selection_plan(plan, kept, select.fit), kept, queries, scores)


def fit_recon(base: BaseLM, layout: PromptLayout, document: str, doc_kv, targets,
              plan: ModulePlan, select: SelectionConfig, spans: list[tuple[str, str]],
              seed: int = 0, timings: dict[str, float] | None = None) -> FittedState:
    """recon_fit in the bytes of ``plan``, stored at ``plan.bits``: ``select_recon``'s keys, then β and
    values fitted or merged (``select.fit_by``; reconstruction.py ``build_selected``). ``timings``: seconds of each part added to it
    (recon_s, allocate_s and build_selected's fit_mass_s / fit_values_s), for the first state's profile."""
    timings = {} if timings is None else timings
    s = select_recon(base, layout, document, doc_kv, targets, plan, select, spans, seed, timings)
    fit_by = auto_fit_by(kept_share(s.kept, layout.n)) if select.fit_by == "auto" else select.fit_by
    module = build_selected(s.plan, s.kept, doc_kv, s.queries, select.quant_aware, timings=timings,
                            fit_keys=select.fit_keys, value_rounding=select.value_rounding, fit_prior=select.fit_prior,
                            merge=fit_by == "merge", choose=fit_by == "choose")
    return FittedState(ReconFit.name, module, s.plan, scores=s.scores)  # scores [L, Hkv, n]: what the allocation ranked


# fit_by "auto": each head's choice (least squares or merge) where the state keeps at most this share of the
# document's entries, the merge above. On four documents the choice gained +0.1 to +1.6 points over merging at
# 2 % of the float32 bytes (~14 % of the entries at int4) but +0.0 to +0.1 at 5 % (~35 %), where it made the
# state 1.3–2× slower to fit (docs/quality.md, "Least squares or merge, head by head"): between the two
CHOOSE_SHARE = 0.25


def auto_fit_by(share: float) -> str:
    """What fit_by "auto" does for a state keeping ``share`` of the document's entries: least squares where keys
    are scarce (at most GREEDY_SHARE: the joint solve carries the state), each head's choice up to CHOOSE_SHARE,
    the merge above."""
    if share <= GREEDY_SHARE:
        return "least_squares"
    return "choose" if share <= CHOOSE_SHARE else "merge"


def ranking(base: BaseLM, layout: PromptLayout, doc_kv, targets, plan: ModulePlan, select: SelectionConfig,
            spans: list[tuple[str, str]], seed: int = 0, timings: dict[str, float] | None = None
            ) -> tuple[ReconCapture, QueryTargets | None, torch.Tensor]:
    """What the allocation ranks keys by: the reconstruction capture, the targets' train queries (when
    the ranking or the fit reads them, else None) and the scores [L, Hkv, n] — the reconstruction
    queries' (``score_queries`` "recon"), or the max of theirs and the train queries', each normalised
    at the cut the plan's bytes make at ``plan.bits`` ("recon+train")."""
    timings = {} if timings is None else timings
    start = time.perf_counter()
    cap = recon_capture(base, layout, doc_kv, spans, select.aggregate, window=select.score_window)
    timings["recon_s"] = timings.get("recon_s", 0.0) + time.perf_counter() - start
    uses_train = targets is not None and ((select.fit and "train" in select.fit_queries)
                                          or "train" in select.score_queries)
    train = training_queries(targets, seed) if uses_train else None
    scores = cap.scores
    if select.score_queries == "recon+train" and train is not None:
        pair_bytes = ragged_pair_bytes(plan.head_dim, select.fit, plan.bits, plan.quant_group)
        cut = 4 * plan.num_kv_heads * sum(plan.budgets) // pair_bytes
        scores = combined_scores(cap.scores, train_scores(train, doc_kv.keys, plan.scaling, select.aggregate), cut)
    return cap, train, scores


def anchors(layout: PromptLayout, document: str, select: SelectionConfig) -> torch.Tensor:
    """[n] bool: the keys every selection keeps (sinks, and the template's tokens when asked for)."""
    template = template_mask(layout, document) if select.template_tokens else None
    return anchor_mask(layout.n, select.sink_tokens, template)


def fit_queries(cap: ReconCapture, train: QueryTargets | None, select: SelectionConfig, seed: int = 0,
                gapped: list[ReconCapture] = ()) -> QueryTargets:
    """The queries β and values are fitted on: the reconstruction's response tokens (at most
    MAX_FIT_TOKENS, a seeded sample), the same spans asked from each of ``select.fit_gaps`` further
    (``gapped``: their captures; at most MAX_FIT_TOKENS each, the same seeded sample, so every gap
    weighs as much as the document alone), then the train queries with ``fit_queries`` "recon+train"."""
    parts = [_sampled(c, seed) for c in (cap, *gapped)]
    queries = parts[0] if len(parts) == 1 else QueryTargets(*(torch.cat(x) for x in zip(*((p.q, p.alpha, p.A)
                                                                                          for p in parts))))
    if select.fit_queries == "recon+train" and train is not None:
        queries = QueryTargets(torch.cat([queries.q, train.q.float()]), torch.cat([queries.alpha, train.alpha.float()]),
                               torch.cat([queries.A, train.A.float()]))
    return queries


def _sampled(cap: ReconCapture, seed: int) -> QueryTargets:
    """The capture's (q, α, A) [T, L, Hq, (d)], at most MAX_FIT_TOKENS rows (a seeded sample)."""
    queries = QueryTargets(cap.q, cap.alpha, cap.A)
    if len(queries.q) > MAX_FIT_TOKENS:
        keep = torch.from_numpy(np.sort(np.random.default_rng(seed).choice(len(queries.q), MAX_FIT_TOKENS,
                                                                           replace=False)))
        queries = QueryTargets(queries.q[keep], queries.alpha[keep], queries.A[keep])
    return queries


def recon_reads(method) -> frozenset[str]:
    """What a reconstruction-scored method reads: its READS, less the targets' train queries when
    neither its ranking nor its fit uses them (recon_fit, recon_mixed)."""
    uses_train = method.score_queries == "recon+train" or (method.fit_pairs and method.fit_queries == "recon+train")
    return method.READS if uses_train else method.READS - {"train_queries"}


@dataclass(frozen=True)
class ReconFit(StateMethod):
    """Its real pairs stored at ``FitInputs.bits`` (float32, or int8/int4 codes with β bf16): as many
    as the module plan's bytes buy at that precision. Defaults: ``SelectionConfig()``'s."""

    # "global": one ranking across all layers and KV heads (KVzip); "layer": the plan's per-layer
    # budget shared by that layer's heads; "head": the plan's budget in every (layer, KV head)
    budget: Literal["global", "layer", "head"] = "global"
    aggregate: Literal["max", "mean"] = "max"  # a key's score over the reconstruction queries
    sink_tokens: int = 4  # the first tokens, always kept as exact KV (attention sinks)
    template_tokens: bool = False  # also keep every chat-template token of the context exact
    fit_pairs: bool = True  # closed-form β (NNLS) and values (least squares) on the kept keys (select.fit)
    fit_queries: Literal["recon", "recon+train"] = "recon+train"  # queries of the closed-form fit
    score_queries: Literal["recon", "recon+train"] = "recon"  # queries whose attention ranks the keys
    quant_aware: bool = True  # below 32 bits: fit β and values to the keys (and β) as stored
    # the fit's reconstruction queries also asked from these many tokens further away (a composition's
    # distances: nectar/attention/compose.py ``part_gaps``); the key ranking stays the document's own
    fit_gaps: tuple[int, ...] = ()
    # at most this many keys of one (layer, KV head) fitted jointly — those with the most mass on the fit
    # queries; the rest keep β = 0 and their values (matching_fit.fitted_keys). None: all of them
    fit_keys: int | None = None
    # a key scored only by the reconstruction batches within this many tokens of it (KVzip's chunk-local
    # scoring: linear in n); None: every batch scores every key
    score_window: int | None = None
    # below 32 bits: the fitted values rounded each to its nearest grid point, or by the value fit's own
    # objective ("gptq", value_rounding.py)
    value_rounding: Literal["nearest", "gptq"] = "nearest"
    # a head's kept keys: its top-scored ones, or chosen together for the fit ("greedy", greedy_keys.py)
    # ("auto": greedy where the state keeps at most GREEDY_SHARE of the document's entries, else top)
    key_choice: Literal["top", "greedy", "auto"] = "top"
    # what the fit's ridge pulls β and the values toward: β = 0 and the kept keys' own values ("kept"), or
    # the evicted keys merged into the kept ones ("merged", merging.py)
    fit_prior: Literal["kept", "merged"] = "kept"
    # β and values by least squares, by merging the evicted keys into the kept ones (merging.py), per (layer,
    # KV head) whichever of the two does better on fit queries held out of both ("choose", reconstruction.py
    # _HeadFit.choose), or by the share of the document's entries kept ("auto", ``auto_fit_by``: least squares up
    # to GREEDY_SHARE, chosen up to CHOOSE_SHARE, merged above)
    fit_by: Literal["least_squares", "merge", "auto", "choose"] = "least_squares"

    name = "recon_fit"
    READS = frozenset({"doc_kv", "document", "train_queries"})

    @property
    def reads(self) -> frozenset[str]:
        return recon_reads(self)

    @property
    def select(self) -> SelectionConfig:
        """Its settings as the config spells them (``train.module.select``)."""
        fields = dataclasses.asdict(self)
        return SelectionConfig(fit=fields.pop("fit_pairs"), **fields)

    @classmethod
    def from_select(cls, select: SelectionConfig) -> "ReconFit":
        fields = select.model_dump()
        return cls(fit_pairs=fields.pop("fit"), **fields)

    def configured(self, module: ModuleConfig) -> "ReconFit":
        return self.from_select(module.select)

    def with_options(self, **options) -> "ReconFit":
        """Settings changed by their config names (a compare system's ``SelectionConfig`` switches)."""
        return self.from_select(self.select.model_copy(update=options)) if options else self

    def plan(self, plan: ModulePlan, bits: int | None = None) -> ModulePlan:
        """The budget the selection allocates: the module plan's total bytes, its pairs stored at
        ``bits``; how many keys each (layer, head) keeps is the selection's (``selection_plan`` in fit)."""
        return plan if bits is None else dataclasses.replace(plan, bits=bits)

    def _check(self, inputs: FitInputs) -> None:
        if inputs.base is None or inputs.layout is None or inputs.document is None:
            raise ValueError("recon_fit selects keys by reconstructing the document: pass base, layout, document "
                             "and spans in FitInputs")

    def fit(self, plan: ModulePlan, inputs: FitInputs) -> FittedState:
        self._check(inputs)
        return fit_recon(inputs.base, inputs.layout, inputs.document, inputs.doc_kv, inputs.targets,
                         self.plan(plan, inputs.bits), self.select, list(inputs.spans), seed=inputs.seed)

    def init(self, plan: ModulePlan, module: NectarModule, inputs: FitInputs) -> tuple[ModulePlan, NectarModule]:
        """The selection (+ fit) of the plan's total bytes; the plan becomes the selection's (heads of
        different widths), which the module's spec records so it loads as trained."""
        if not (plan.quad_bias and self.fit_pairs):
            raise ValueError("init recon_fit trains the fitted log-mass biases: set train.module.bias=true and "
                             "train.module.select.fit=true")
        if inputs.document is None:
            raise ValueError("init recon_fit selects keys by reconstructing the document: pass the document "
                             "text and its reconstruction spans")
        self._check(inputs)
        fitted = fit_recon(inputs.base, inputs.layout, inputs.document, inputs.doc_kv, inputs.targets, plan,
                           self.select, list(inputs.spans), inputs.seed)
        return fitted.plan, fitted.module.train()
