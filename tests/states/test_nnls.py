"""The β fit's NNLS: block principal pivoting on the Gram (nnls_gram) against scipy's Lawson–Hanson on
the same problems — the same unique optimum, including constrained ones with many zero weights."""
from __future__ import annotations

import pytest
import torch
from scipy.optimize import nnls

from nectar.states.matching_fit import RIDGE, nnls_gram


def _problem(n_queries: int, n_keys: int, kept: int, temperature: float, seed: int):
    """The fit_log_mass problem of attention masses: G = MᵀM + μ²I, rhs = Mᵀ1 + μ²."""
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(n_queries, 16, generator=g), torch.randn(n_keys, 16, generator=g)
    logits = q @ k.T * temperature
    M = torch.exp(logits[:, :kept] - torch.logsumexp(logits, 1, keepdim=True)).double()
    gram = M.T @ M
    mu2 = RIDGE * float(gram.diagonal().mean())
    return gram + mu2 * torch.eye(kept, dtype=gram.dtype), M.sum(0) + mu2


def _scipy(G, rhs):
    L = torch.linalg.cholesky(G)
    b = torch.linalg.solve_triangular(L, rhs.unsqueeze(1), upper=False).squeeze(1)
    return torch.from_numpy(nnls(L.T.numpy(), b.numpy(), maxiter=50 * G.shape[0])[0])


@pytest.mark.parametrize("n_queries,n_keys,kept,temperature,seed", [
    (200, 100, 30, 0.25, 0), (400, 300, 120, 0.5, 1), (300, 200, 150, 1.0, 2), (100, 400, 250, 0.8, 3)])
def test_block_pivoting_finds_scipys_optimum(n_queries, n_keys, kept, temperature, seed):
    G, rhs = _problem(n_queries, n_keys, kept, temperature, seed)
    w, ref = nnls_gram(G, rhs), _scipy(G, rhs)
    objective = lambda x: float(0.5 * x @ G @ x - rhs @ x)  # noqa: E731
    assert (w >= 0).all()
    assert objective(w) <= objective(ref) + 1e-9 * abs(objective(ref))
    assert torch.allclose(w, ref, atol=1e-8, rtol=1e-6)
    assert int((w == 0).sum()) == int((ref == 0).sum())  # the same active set


def test_a_problem_with_most_weights_at_zero():
    """rhs pointing away from most keys: most weights sit on the constraint."""
    G, rhs = _problem(300, 200, 120, 0.5, 4)
    rhs = rhs - 0.9 * rhs.max()  # most of the linear term negative: most w_j = 0 at the optimum
    w, ref = nnls_gram(G, rhs), _scipy(G, rhs)
    assert int((ref == 0).sum()) > 60
    assert torch.allclose(w, ref, atol=1e-8, rtol=1e-6)


def test_the_schur_update_solves_the_same_free_set_problems_as_a_fresh_factor():
    """FreeSetSolver reuses G's one factor (x_D = 0 by Lagrange multipliers); every free set gives
    what a fresh Cholesky of G_FF gives, from a few zeros (where it is used) to most."""
    from nectar.states.matching_fit import FreeSetSolver, _solve_free

    G, rhs = _problem(400, 300, 200, 0.5, 5)
    solver = FreeSetSolver(G, rhs)
    g = torch.Generator().manual_seed(0)
    for zeros in (1, 5, 40, 150):
        free = torch.ones(200, dtype=torch.bool)
        free[torch.randperm(200, generator=g)[:zeros]] = False
        w, ref = solver._schur((~free).nonzero().squeeze(1)), _solve_free(G, rhs, free)
        assert (w[~free] == 0).all()
        assert torch.allclose(w, ref, atol=1e-9, rtol=1e-7), zeros


def test_block_pivoting_takes_the_schur_path_and_matches_scipy():
    """A problem with few zeros at the optimum (the large heads of a long document): pivoting's later
    solves go through the reused factor and still land on scipy's optimum."""
    from nectar.states import matching_fit

    G, rhs = _problem(600, 400, 300, 0.25, 6)
    used = []
    real = matching_fit.FreeSetSolver._schur

    def counted(self, zeros):  # spy only: the real update, counted
        used.append(int(zeros.numel()))
        return real(self, zeros)

    matching_fit.FreeSetSolver._schur = counted
    try:
        w = nnls_gram(G, rhs)
    finally:
        matching_fit.FreeSetSolver._schur = real
    ref = _scipy(G, rhs)
    assert used, "no solve went through the reused factor"
    assert torch.allclose(w, ref, atol=1e-8, rtol=1e-6)
