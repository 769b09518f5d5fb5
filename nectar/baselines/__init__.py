"""Equal-bytes baselines: what else could live in the bytes of a module of budget ρ (DESIGN.md §11).

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
from ..modules.builder import ModulePlan, NectarModule, build_module
from ..modules.provider import ModuleDocState, group_queries
from .attention_matching import fit_log_mass, fit_values
from .selection import KeyScore, attention_probs, key_scores, top_keys

BaselineName = Literal["truncate", "evict", "attention_matching", "attention_matching_kv"]
BASELINES: tuple[str, ...] = ("truncate", "evict", "attention_matching", "attention_matching_kv")
MAX_FIT_TOKENS = 2048  # training query tokens for selection and fitting (seeded sample above; 1k-4k: same fit)


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
        return module_nbytes(self.module)


def module_nbytes(module: NectarModule) -> int:
    """Bytes of everything a module stores (parameters and buffers), as ``make_spec`` counts them."""
    return sum(t.numel() * t.element_size() for t in module.state_dict().values())


def baseline_plan(name: str, plan: ModulePlan) -> ModulePlan:
    """The quadrature plan of baseline ``name`` in the budget of ``plan`` (any arch, same ρ)."""
    if name not in BASELINES:
        raise ValueError(f"unknown baseline {name!r}; choose one of {', '.join(BASELINES)}")
    d, n = plan.head_dim, plan.n_context
    if name == "truncate":
        p = max(1, min(n, round(plan.rho * n)))  # same tokens in every layer
        pairs = (p,) * plan.num_layers
    elif name == "attention_matching_kv":  # plain KV: one count for every layer, the plan's total bytes
        p = max(1, min(n, sum(plan.budgets) // (2 * d * plan.num_layers)))
        pairs = (p,) * plan.num_layers
    else:
        per_pair = 2 * d + (1 if name == "attention_matching" else 0)
        pairs = tuple(max(1, min(n, b // per_pair)) for b in plan.budgets)
    return dataclasses.replace(plan, arch="quadrature", quad_pairs=pairs, mlp_widths=(),
                               quad_bias=name == "attention_matching")


def fit_baseline(name: str, doc_kv, targets_url: str, plan: ModulePlan, seed: int = 0,
                 score: KeyScore = "mean", max_tokens: int | None = None) -> FittedBaseline:
    """Fit baseline ``name`` on the document KV and the targets' training queries (seconds)."""
    qplan = baseline_plan(name, plan)
    module = build_module(qplan)
    init = {"truncate": "first", "evict": "evict", "attention_matching": "attention_matching",
            "attention_matching_kv": "attention_matching_kv"}[name]
    data = None if init == "first" else training_queries(targets_url, seed, max_tokens or MAX_FIT_TOKENS)
    init_quadrature(module, qplan, init, doc_kv, data, score)
    return FittedBaseline(name, module.eval(), qplan)


@dataclass
class QueryTargets:
    """Training query tokens' captured targets: q [T, L, Hq, d], alpha [T, L, Hq], A [T, L, Hq, d]."""

    q: torch.Tensor
    alpha: torch.Tensor
    A: torch.Tensor


def training_queries(targets, seed: int = 0, max_tokens: int | None = None) -> QueryTargets:
    """The train split's (q, α, A) rows from the targets (a URL or an open ``TargetsData``; a seeded
    sample of at most ``max_tokens``)."""
    from ..stages.train import targets_zarr_url
    from ..training.data import TargetsData

    data = targets if isinstance(targets, TargetsData) else TargetsData(targets_zarr_url(targets))
    tokens = data.tokens("train")
    if len(tokens) == 0:
        raise ValueError(f"{data.url}: the targets have no training queries to select or fit keys with")
    max_tokens = max_tokens or MAX_FIT_TOKENS
    if len(tokens) > max_tokens:
        tokens = np.sort(np.random.default_rng(seed).choice(tokens, max_tokens, replace=False))
    rows = data.rows(tokens)
    finite = (rows.q.flatten(1).isfinite().all(1) & rows.A.flatten(1).isfinite().all(1)
              & rows.alpha.flatten(1).isfinite().all(1))  # [T]
    return QueryTargets(rows.q[finite], rows.alpha[finite], rows.A[finite])


@torch.no_grad()
def init_quadrature(module: NectarModule, plan: ModulePlan, init: str, doc_kv, data: QueryTargets | None,
                    score: KeyScore = "mean") -> None:
    """Set every quadrature layer's (W, Z, β) from the document KV: the first p rows (``first``), the
    p most-attended rows (``evict``), or those rows with Attention Matching's β and values."""
    if plan.arch != "quadrature":
        raise ValueError(f"init {init!r} is for quadrature modules, not {plan.arch!r}")
    if init not in ("first", "evict", "attention_matching", "attention_matching_kv"):
        raise ValueError(f"unknown quadrature init {init!r}")
    if init == "attention_matching" and not plan.quad_bias:
        raise ValueError("attention_matching init fits a log-mass bias: set train.module.bias=true")
    if init != "first" and data is None:
        raise ValueError(f"init {init!r} needs the training queries' targets")
    hkv = plan.num_kv_heads
    for layer, net in enumerate(module.layers):
        keys = doc_kv.keys[layer].detach().float().cpu()  # [Hkv, n, d]
        values = doc_kv.values[layer].detach().float().cpu()
        p = plan.quad_pairs[layer]
        if init == "first":
            net.set_pairs(keys[:, :p], values[:, :p], torch.zeros(hkv, p) if plan.quad_bias else None)
            continue
        q = group_queries(data.q[:, layer].float(), hkv)  # [T·g, Hkv, d]
        alpha = group_queries(data.alpha[:, layer].float().unsqueeze(-1), hkv).squeeze(-1)  # [T·g, Hkv]
        A = group_queries(data.A[:, layer].float(), hkv)  # [T·g, Hkv, d]
        W, Z, B = [], [], []
        for h in range(hkv):
            probs = attention_probs(q[:, h], alpha[:, h], keys[h], plan.scaling)  # [T·g, n]
            idx = top_keys(key_scores(probs, score), p)  # [p]
            if init == "evict":
                W.append(keys[h, idx]), Z.append(values[h, idx]), B.append(torch.zeros(p))
                continue
            mass = probs[:, idx]  # [T·g, p]
            if init == "attention_matching_kv":  # β = 0: only the values are refit
                W.append(keys[h, idx]), Z.append(fit_values(mass, torch.zeros(p), A[:, h], values[h, idx]).float())
                continue
            beta = fit_log_mass(mass)
            W.append(keys[h, idx]), Z.append(fit_values(mass, beta, A[:, h], values[h, idx]).float())
            B.append(beta.float())
        net.set_pairs(torch.stack(W), torch.stack(Z), torch.stack(B) if plan.quad_bias else None)
