"""Loss terms and metrics (paper eq. regression-loss, eq. total-loss; App. C relative transport error).

Every function returns *sums* over its tokens/positions; the caller divides by the global count
so that gradient accumulation and data-parallel ranks reproduce the single-batch mean exactly.

Regression (per token, as eq. regression-loss): Σ_{ℓ, h'} ‖(A_θ(q) − 𝒜(q)) / σ_A‖² and
Σ_{ℓ, h'} ((a_θ(q) − α(q)) / σ_α)², with σ the per-(layer, KV head) std of the training targets:
normalised units, so layers and heads of very different scales weigh alike (identity when
target normalisation is off).

KL over the teacher's top-K plus a tail bucket: nectar/kl.py (shared with states/recon_refine.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..modules.builder import NectarModule
from ..modules.provider import group_queries

_EPS = 1e-12


@dataclass
class RegressionSums:
    alpha: torch.Tensor  # Σ_tokens Σ_{ℓ,h'} normalised squared score error (differentiable)
    A: torch.Tensor  # Σ_tokens Σ_{ℓ,h'} normalised squared target error (differentiable)
    rte_alpha: torch.Tensor  # Σ_{tokens,ℓ,h'} log((a−α)² / α²)   (detached)
    rte_A: torch.Tensor  # Σ_{tokens,ℓ,h'} log(‖A_θ−𝒜‖² / ‖q−𝒜‖²)  (detached)
    n_terms: int  # tokens · L · Hq: the count the RTE sums are averaged over


def regression_sums(module: NectarModule, q: torch.Tensor, alpha: torch.Tensor,
                    A: torch.Tensor) -> RegressionSums:
    """q [N, L, Hq, d], alpha [N, L, Hq], A [N, L, Hq, d] (raw units, from the targets store)."""
    N, L, hq, d = q.shape
    hkv = module.num_kv_heads
    tot_a = tot_A = q.new_zeros(())
    rte_a = rte_A = q.new_zeros(())
    for layer in range(L):
        qg = group_queries(q[:, layer], hkv)  # [N·g, Hkv, d]
        A_true = group_queries(A[:, layer], hkv)  # [N·g, Hkv, d]
        a_true = group_queries(alpha[:, layer].unsqueeze(-1), hkv).squeeze(-1)  # [N·g, Hkv]
        A_pred, a_pred = module.predict(layer, qg)
        err_A = A_pred - A_true  # [N·g, Hkv, d]
        err_a = a_pred - a_true  # [N·g, Hkv]
        tot_A = tot_A + (err_A / module.A_std[layer].unsqueeze(-1)).pow(2).sum()
        tot_a = tot_a + (err_a / module.alpha_std[layer]).pow(2).sum()
        with torch.no_grad():
            sq = err_A.pow(2).sum(-1)  # [N·g, Hkv]
            base = (qg - A_true).pow(2).sum(-1)
            rte_A = rte_A + torch.log((sq + _EPS) / (base + _EPS)).sum()
            rte_a = rte_a + torch.log((err_a.pow(2) + _EPS) / (a_true.pow(2) + _EPS)).sum()
    return RegressionSums(tot_a, tot_A, rte_a, rte_A, N * L * hq)


def correct_sum(logits: torch.Tensor, next_ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """How many masked positions' argmax equals the next token (teacher forcing accuracy)."""
    return ((logits.argmax(-1) == next_ids) & mask).sum()
