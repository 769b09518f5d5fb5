"""Attention Matching (Zweiger et al. 2026, "Fast KV compaction via attention matching"), closed form
on the (q, α, A) targets the pipeline already captures.

Given the kept keys S of one (layer, KV head) and the training queries:
  1. masses — each query's document mass is Σ_j exp(s·q·k_j) = exp(α(q)). Fit w ≥ 0 so that
     Σ_{j∈S} w_j exp(s·q·k_j) ≈ exp(α(q)) for every query: non-negative least squares on the
     relative masses M[r, j] = exp(s·q_r·k_j − α_r) against 1 (with a small ridge towards w = 1);
     β_j = log w_j is the log-mass bias.
  2. values — with those weights the compacted attention of q is R[r] = softmax_j(s·q_r·k_j + β_j);
     the values Z minimise Σ_r ‖R[r] Z − A(q_r)‖², with a small ridge towards the original values
     so keys that no query reaches keep sensible values.
Then a(q) = LSE(s·Wq + β) matches α and A(q) = softmax(s·Wq + β)ᵀ Z matches 𝒜 on the training queries.
"""
from __future__ import annotations

import numpy as np
import torch
from scipy.optimize import nnls

MIN_MASS = 1e-12  # w_j floor: β ≥ log(1e-12) ≈ −27.6, a key that no query needs contributes nothing
RIDGE = 1e-3  # ridges (masses towards β = 0, values towards the kept values), relative to the Gram diagonal


def fit_log_mass(mass: torch.Tensor) -> torch.Tensor:
    """mass [N, p] = exp(s·q·k_j − α) for the kept keys → β [p] with Σ_j e^{β_j} mass[r, j] ≈ 1.

    A small ridge towards w = 1 (β = 0) picks, among weightings that fit equally well (queries of a
    head are often nearly collinear), the one closest to the plain kept keys — so keeping every key
    gives back exactly the document's state."""
    M = mass.double()  # [N, p]
    p = M.shape[1]
    gram = M.T @ M  # [p, p]: the fit only needs MᵀM and Mᵀ1, so N (thousands of queries) drops out
    mu2 = RIDGE * max(float(gram.diagonal().mean()), 1e-12)
    G = gram + mu2 * torch.eye(p, dtype=M.dtype)
    rhs = M.sum(0) + mu2  # Mᵀ1 + μ²·1
    # ‖Mw − 1‖² + μ²‖w − 1‖² = wᵀGw − 2 rhsᵀw + const: a strictly convex QP over w ≥ 0 (the same
    # NNLS as ‖Lᵀw − L⁻¹rhs‖² with G = LLᵀ), solved exactly by block principal pivoting on G.
    w = nnls_gram(G, rhs)
    return torch.log(w.clamp_min(MIN_MASS)).cpu()  # [p] float64


def nnls_gram(G: torch.Tensor, rhs: torch.Tensor, max_iter: int = 100) -> torch.Tensor:
    """argmin_{w ≥ 0} ½wᵀGw − rhsᵀw for a positive definite G [p, p] (float64) → w [p].

    Block principal pivoting (Kim & Park 2011, "Fast nonnegative matrix factorization: an active-set-like
    method and comparisons"): solve on the free set F, then move EVERY variable that breaks the KKT
    conditions (w_F < 0, or a gradient y = Gw − rhs < 0 at a zero) across at once, with Murty's
    single-exchange backup when the count of broken ones stops falling. Started from the unconstrained
    solution's support, it usually ends in 1–5 Cholesky solves of ≤ p × p — where scipy's Lawson–Hanson
    ``nnls`` adds one variable per iteration (p iterations, each a least-squares solve: ~p⁴; 28 minutes
    of a 3.7k-token document's fit). The solution is the same unique optimum. Falls back to scipy's
    ``nnls`` in the rare case pivoting does not settle within ``max_iter`` exchanges."""
    p = G.shape[0]
    tol_y = 1e-10 * max(float(rhs.abs().max()), 1e-300)  # KKT slack relative to the problem's scale
    free = torch.ones(p, dtype=torch.bool)  # the first exchange leaves the unconstrained solution's support
    best, backup = p + 1, 3
    for _ in range(max_iter):
        w = _solve_free(G, rhs, free)
        y = G @ w - rhs  # [p] gradient; 0 on the free set
        tol_w = 1e-12 * max(float(w.abs().max()), 1.0)
        broken = (free & (w < -tol_w)) | (~free & (y < -tol_y))
        count = int(broken.sum())
        if count == 0:
            return w.clamp_min(0.0)
        if count < best:
            best, backup = count, 3
            free ^= broken
        elif backup > 0:
            backup -= 1
            free ^= broken
        else:  # single exchange of the largest broken index: finite termination
            last = int(broken.nonzero().max())
            free[last] = ~free[last]
    L = torch.linalg.cholesky(G)
    b = torch.linalg.solve_triangular(L, rhs.unsqueeze(1), upper=False).squeeze(1)
    w, _ = nnls(L.T.cpu().numpy(), b.cpu().numpy(), maxiter=50 * p)
    return torch.from_numpy(w)


def _solve_free(G: torch.Tensor, rhs: torch.Tensor, free: torch.Tensor) -> torch.Tensor:
    """w [p] with w_F = G_FF⁻¹ rhs_F on the free set F and 0 elsewhere."""
    w = torch.zeros_like(rhs)
    idx = free.nonzero().squeeze(1)
    if idx.numel():
        L, info = torch.linalg.cholesky_ex(G[idx][:, idx])
        sol = _chol_solve(L, rhs[idx]) if int(info) == 0 else \
            torch.linalg.lstsq(G[idx][:, idx], rhs[idx].unsqueeze(1)).solution.squeeze(1)
        w[idx] = sol
    return w


def _chol_solve(L: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """x with L Lᵀ x = b (two triangular solves; torch's cholesky_solve was slower here)."""
    z = torch.linalg.solve_triangular(L, b.unsqueeze(1), upper=False)
    return torch.linalg.solve_triangular(L.T, z, upper=True).squeeze(1)


def fit_values(mass: torch.Tensor, beta: torch.Tensor, targets: torch.Tensor,
               prior: torch.Tensor) -> torch.Tensor:
    """Least-squares values Z [p, d] for the compacted attention softmax(log mass + β) against the
    captured outputs ``targets`` [N, d]; ridge towards ``prior`` [p, d] (the kept keys' values)."""
    weighted = mass.double() * beta.exp().unsqueeze(0)  # [N, p]
    R = weighted / weighted.sum(1, keepdim=True).clamp_min(1e-300)  # [N, p] compacted attention
    gram = R.T @ R  # [p, p]
    lam = RIDGE * float(gram.diagonal().mean().clamp_min(1e-12))
    rhs = R.T @ targets.double() + lam * prior.double()  # [p, d]
    eye = torch.eye(gram.shape[0], dtype=gram.dtype)
    # gram + λI is symmetric positive definite: Cholesky (p³/3) instead of LU (2p³/3), same solution
    L, info = torch.linalg.cholesky_ex(gram + lam * eye)
    if int(info) != 0:
        return torch.linalg.solve(gram + lam * eye, rhs)
    return torch.cholesky_solve(rhs, L)  # [p, d]
