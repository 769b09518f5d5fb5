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
    # ‖Mw − 1‖² + μ²‖w − 1‖² = wᵀGw − 2 rhsᵀw + const = ‖Lᵀw − L⁻¹rhs‖² + const, with G = LLᵀ:
    # the same NNLS on a p × p system.
    L = torch.linalg.cholesky(G)
    b = torch.linalg.solve_triangular(L, rhs.unsqueeze(1), upper=False).squeeze(1)
    w, _ = nnls(L.T.cpu().numpy(), b.cpu().numpy(), maxiter=50 * p)
    return torch.from_numpy(np.log(np.maximum(w, MIN_MASS)))  # [p] float64


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
    return torch.linalg.solve(gram + lam * eye, rhs)  # [p, d]
