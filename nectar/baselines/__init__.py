"""Equal-bytes baselines: what else could live in the bytes of a module of budget ρ (docs/design.md §11).

Each is an exact-attention state over p stored (key, value) pairs per (layer, KV head) — optionally
with a log-mass bias β per pair — which is exactly a quadrature module (``nectar.modules.quadrature``):
a(q) = LSE(s·Wq + β), A(q) = softmax(s·Wq + β)ᵀZ. So every baseline is a ``NectarModule`` and runs
wherever a trained module runs (evaluate, ``nectar ask``, generation, the server), and its bytes are
counted the same way (every saved tensor).

  truncate            the exact KV of the first ⌊ρ·n⌋ context tokens in every layer: the document cut
                      to fit the budget, keeping its START (the chat template's header — the attention
                      sink — and the first part of the text)
  evict               per (layer, KV head), the exact KV of the p_ℓ document tokens that receive the
                      most attention mass from the training queries (offline H2O/SnapKV-style eviction)
  attention_matching  those same keys with a fitted log-mass bias β (NNLS) and least-squares values
                      (Zweiger et al. 2026); p_ℓ = P_ℓ / (2d + 1) so the biases fit in the budget
  kvzip               keys scored by reconstructing the document (max over its spans), one budget
                      across all layers and KV heads, sinks kept, optionally with the fitted β and
                      values (``fit_kvzip``, nectar/baselines/kvzip.py; SelectionConfig switches each)
  attention_matching_kv  the β-free refit: keys selected as for evict, least-squares values with no
                      bias, and the SAME p in every layer (the plan's total over 2d per head and layer):
                      plain KV of m = p pseudo-tokens, which vLLM serves (nectar.serving.vllm_state)

p_ℓ follows the module plan's per-layer budgets P_ℓ (layer multipliers included), so a baseline and
a module of the same ρ store the same number of parameters (up to one pair of rounding per head);
``truncate`` keeps the same number of tokens in every layer (a cut document is the same in each).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from ..attention.state import AttnState
from ..base_model import BaseLM
from ..layout import PromptLayout
from ..modules.budget import pairs_in_bytes, ragged_pair_bytes
from ..modules.builder import ModulePlan, NectarModule, build_module
from ..modules.provider import ModuleDocState
from ..modules.stored import quantize_module_, stored_nbytes
from ..schemas.config import SelectionConfig
from .init import MAX_FIT_TOKENS, QueryTargets, init_quadrature, training_queries  # noqa: F401
from .kvzip import (allocate, anchor_mask, build_selected, combined_scores, recon_capture, selection_plan,
                    template_mask, train_scores)
from .selection import KeyScore

BaselineName = Literal["truncate", "evict", "attention_matching", "attention_matching_kv", "kvzip"]
BASELINES: tuple[str, ...] = ("truncate", "evict", "attention_matching", "attention_matching_kv")  # fit_baseline's (kvzip: fit_kvzip)


@dataclass
class FittedBaseline:
    """A fitted baseline: callable as a document-state provider, with the bytes it stores."""

    name: str
    module: NectarModule
    plan: ModulePlan

    def __post_init__(self) -> None:
        self._provider = ModuleDocState(self.module)

    def __call__(self, layer: int, q: torch.Tensor, scaling: float) -> AttnState:
        return self._provider(layer, q, scaling)

    @property
    def nbytes(self) -> int:
        """Bytes as stored (codes, fp16 scales and zeros at bits < 32; β and buffers included; with
        heads of different widths only their real pairs)."""
        return stored_nbytes(self.module, self.plan)


def fit_kvzip(base: BaseLM, layout: PromptLayout, document: str, doc_kv, targets,
              plan: ModulePlan, select: SelectionConfig, spans: list[tuple[str, str]],
              seed: int = 0) -> FittedBaseline:
    """KVzip-style selection (and the closed-form fit) in the bytes of ``plan``, stored at
    ``plan.bits``: reconstruct the document's ``spans`` ((instruction, response),
    nectar/stages/recon.py) against its exact KV, keep the best keys (as many as the bytes buy at
    that precision), fit β and values (nectar/baselines/kvzip.py). ``targets``: the targets (a URL or
    an open ``TargetsData``) whose train queries join the ranking (``score_queries``) and the fit
    (``fit_queries``), or None."""
    cap = recon_capture(base, layout, doc_kv, spans, select.aggregate)
    template = template_mask(layout, document) if select.template_tokens else None
    pair_bytes = ragged_pair_bytes(plan.head_dim, select.fit, plan.bits, plan.quant_group)
    uses_train = targets is not None and ((select.fit and "train" in select.fit_queries)
                                          or "train" in select.score_queries)
    train = training_queries(targets, seed) if uses_train else None
    scores = cap.scores
    if select.score_queries == "recon+train" and train is not None:
        cut = 4 * plan.num_kv_heads * sum(plan.budgets) // pair_bytes
        scores = combined_scores(cap.scores, train_scores(train, doc_kv.keys, plan.scaling, select.aggregate), cut)
    kept = allocate(scores, plan, pair_bytes, select.budget, anchor_mask(layout.n, select.sink_tokens, template))
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
    module = build_selected(qplan, kept, doc_kv, queries, select.quant_aware)
    fitted = FittedBaseline("kvzip", module, qplan)
    fitted.scores = scores  # [L, Hkv, n]: what the allocation ranked (for the report's heat map)
    return fitted


def baseline_plan(name: str, plan: ModulePlan, bits: int | None = None) -> ModulePlan:
    """The quadrature plan of baseline ``name`` in the bytes of ``plan`` (any arch, same ρ), its pairs
    stored at ``bits`` (default the plan's): 4·P bytes per head buy ~7× more pairs at int4 than fp32."""
    if name not in BASELINES:
        raise ValueError(f"unknown baseline {name!r}; choose one of {', '.join(BASELINES)}")
    bits = plan.bits if bits is None else bits
    d, n, g = plan.head_dim, plan.n_context, plan.quant_group
    bias = name == "attention_matching"
    if name == "truncate":  # same tokens in every layer: the mean per-head bytes, 4·ρ·2nd (float32 KV)
        p = max(1, min(n, pairs_in_bytes(4 * plan.rho * n * 2 * d * (1 + 1e-9), d, False, bits, g)))
        pairs = (p,) * plan.num_layers
    elif name == "attention_matching_kv":  # plain KV: one count for every layer, the plan's total bytes
        p = max(1, min(n, pairs_in_bytes(4 * sum(plan.budgets) // plan.num_layers, d, False, bits, g)))
        pairs = (p,) * plan.num_layers
    else:
        pairs = tuple(max(1, min(n, pairs_in_bytes(4 * b, d, bias, bits, g))) for b in plan.budgets)
    return dataclasses.replace(plan, arch="quadrature", quad_pairs=pairs, mlp_widths=(), quad_bias=bias, bits=bits)


def fit_baseline(name: str, doc_kv, targets_url: str, plan: ModulePlan, seed: int = 0,
                 score: KeyScore = "mean", max_tokens: int | None = None, bits: int | None = None) -> FittedBaseline:
    """Fit baseline ``name`` on the document KV and the targets' training queries (seconds), stored
    at ``bits`` (default the plan's)."""
    qplan = baseline_plan(name, plan, bits)
    module = build_module(qplan)
    init = {"truncate": "first", "evict": "evict", "attention_matching": "attention_matching",
            "attention_matching_kv": "attention_matching_kv"}[name]
    data = None if init == "first" else training_queries(targets_url, seed, max_tokens or MAX_FIT_TOKENS)
    init_quadrature(module, qplan, init, doc_kv, data, score)
    return FittedBaseline(name, quantize_module_(module).eval(), qplan)
