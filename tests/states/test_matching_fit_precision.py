"""The closed-form fits form their Gram matrices in float32 (matching_fit.gram): the β and value fits
must give what the same fits in float64 give, to well inside the int4 grid they are stored on —
including β far from 0 (a float32 e^β would overflow past β ≈ 88) and masses that underflow."""
from __future__ import annotations

import torch

from nectar.states.matching_fit import RIDGE, fit_log_mass, fit_values, gram


def _masses(n_queries: int, kept: int, seed: int, temperature: float = 0.5) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(n_queries, 16, generator=g), torch.randn(2 * kept, 16, generator=g)
    logits = q @ k.T * temperature
    return torch.exp(logits[:, :kept] - torch.logsumexp(logits, 1, keepdim=True))  # [N, kept] float32


def _values_float64(mass, beta, targets, prior):  # the fit as it was, all in float64
    weighted = mass.double() * beta.double().exp().unsqueeze(0)
    R = weighted / weighted.sum(1, keepdim=True).clamp_min(1e-300)
    G = R.T @ R
    lam = RIDGE * float(G.diagonal().mean())
    return torch.linalg.solve(G + lam * torch.eye(G.shape[0], dtype=G.dtype), R.T @ targets.double() + lam * prior.double())


def test_the_float32_gram_is_the_float64_one_to_float32_rounding():
    X = _masses(3000, 200, 0)
    exact = X.double().T @ X.double()
    assert gram(X).dtype == torch.float64
    assert ((gram(X) - exact).abs() / exact.abs().max()).max() < 1e-6


def test_value_fit_matches_float64_with_large_and_tiny_biases():
    mass = _masses(2000, 150, 1)
    mass[:, :5] = 0.0  # keys no query reaches (underflowed masses)
    beta = fit_log_mass(mass)
    beta[7] = 95.0  # e^95 overflows float32: the fit must not form e^β on its own
    beta[8] = -27.0
    g = torch.Generator().manual_seed(2)
    targets, prior = torch.randn(2000, 8, generator=g), torch.randn(150, 8, generator=g)
    Z, ref = fit_values(mass, beta, targets, prior), _values_float64(mass, beta, targets, prior)
    assert torch.isfinite(Z).all()
    assert (Z - ref).abs().max() < 1e-3 * ref.abs().max()


def test_mass_fit_matches_the_float64_gram_fit():
    from nectar.states.matching_fit import nnls_gram

    mass = _masses(2500, 180, 3)
    M = mass.double()
    G = M.T @ M
    mu2 = RIDGE * float(G.diagonal().mean())
    ref = torch.log(nnls_gram(G + mu2 * torch.eye(180, dtype=G.dtype), M.sum(0) + mu2).clamp_min(1e-12))
    beta = fit_log_mass(mass)
    live = ref > -20  # keys with real weight (those at the floor may move between tiny weights)
    assert (beta[live] - ref[live]).abs().max() < 1e-3
