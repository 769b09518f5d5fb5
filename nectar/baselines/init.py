"""Closed-form initialisers of a quadrature module from the document KV and the training queries'
captured targets: the first p keys, the p most-attended keys (eviction), or those keys with
Attention Matching's fitted log-mass bias and values. The baselines are these initialisers frozen;
the ``matching`` regime trains on from one."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..modules.builder import ModulePlan, NectarModule
from ..modules.provider import group_queries
from ..quantization import fake_quantize
from ..targets.reader import TargetsData
from ..targets.store import targets_zarr_url
from .matching_fit import fit_log_mass, fit_values
from .selection import KeyScore, attention_probs, key_scores, top_keys

MAX_FIT_TOKENS = 2048  # training query tokens for selection and fitting (seeded sample above; 1k-4k: same fit)


@dataclass
class QueryTargets:
    """Training query tokens' captured targets: q [T, L, Hq, d], alpha [T, L, Hq], A [T, L, Hq, d]."""

    q: torch.Tensor
    alpha: torch.Tensor
    A: torch.Tensor


def training_queries(targets, seed: int = 0, max_tokens: int | None = None) -> QueryTargets:
    """The train split's (q, α, A) rows from the targets (a URL or an open ``TargetsData``; a seeded
    sample of at most ``max_tokens``)."""
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
    p most-attended rows (``evict``), or those rows with Attention Matching's β and values
    (``attention_matching_kv``: with β = 0, values only).

    At ``plan.bits`` < 32 the Attention Matching fit is aware of the rounding: β is fitted to the
    masses of the quantized keys, and the values to the attention of the quantized keys and β."""
    if plan.arch != "quadrature":
        raise ValueError(f"init {init!r} is for quadrature modules, not {plan.arch!r}")
    if init not in ("first", "evict", "attention_matching", "attention_matching_kv"):
        raise ValueError(f"unknown quadrature init {init!r}")
    if init == "attention_matching" and not plan.quad_bias:
        raise ValueError("attention_matching init fits a log-mass bias: set train.module.bias=true")
    if init != "first" and data is None:
        raise ValueError(f"init {init!r} needs the training queries' targets")
    hkv = plan.num_kv_heads

    def quant(x: torch.Tensor) -> torch.Tensor:  # rows as stored (quantized along the last dim)
        return fake_quantize(x, plan.bits, plan.quant_group)

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
            Wh = quant(keys[h, idx])  # [p, d]: the keys as they will be stored
            mass = attention_probs(q[:, h], alpha[:, h], Wh, plan.scaling) if plan.bits < 32 else probs[:, idx]
            if init == "attention_matching_kv":  # β = 0 (plain KV, what vLLM serves): only the values are refit
                W.append(Wh), Z.append(quant(fit_values(mass, torch.zeros(p), A[:, h], values[h, idx]).float()))
                continue
            beta = fit_log_mass(mass)  # [p]; float64 from NNLS, kept so at 32 bits the fit is unchanged
            if plan.bits < 32:
                beta = quant(beta.float())
            W.append(Wh), Z.append(quant(fit_values(mass, beta, A[:, h], values[h, idx]).float()))
            B.append(beta.float())
        net.set_pairs(torch.stack(W), torch.stack(Z), torch.stack(B) if plan.quad_bias else None)
