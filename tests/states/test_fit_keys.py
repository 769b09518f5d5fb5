"""A cap on the keys one head's closed-form fit solves jointly (SelectionConfig.fit_keys, issue 39):
the keys with the most mass on the fit queries are solved, the rest keep β = 0 and their own values,
and the fits target what those fixed keys leave. The capped fit is the full fit restricted to w = 1
on the fixed keys, so its objective lies between the full fit's and the unfitted keys'."""
from __future__ import annotations

import pytest
import torch

from nectar.states.matching_fit import RIDGE, fit_log_mass, fit_values, fitted_keys


def _masses(n_queries: int, kept: int, total: int, seed: int) -> torch.Tensor:
    """[N, kept] exp(s·q·k_j − α) of ``kept`` of ``total`` keys (α over all of them)."""
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(n_queries, 16, generator=g), torch.randn(total, 16, generator=g)
    logits = q @ k.T * 0.5
    return torch.exp(logits[:, :kept] - torch.logsumexp(logits, 1, keepdim=True))


def _mass_objective(mass: torch.Tensor, beta: torch.Tensor) -> float:
    """‖Mw − 1‖² + μ²‖w − 1‖² of fit_log_mass, at w = e^β (μ² from the whole Gram's diagonal)."""
    M, w = mass.double(), beta.double().exp()
    mu2 = RIDGE * float((M * M).sum(0).mean())
    return float(((M @ w - 1) ** 2).sum() + mu2 * ((w - 1) ** 2).sum())


def test_no_cap_or_a_cap_at_least_the_keys_fits_every_key():
    mass = _masses(400, 60, 120, 0)
    assert fitted_keys(mass, None) is None and fitted_keys(mass, 60) is None
    free = fitted_keys(mass, 20)
    assert free.tolist() == sorted(free.tolist()) and free.numel() == 20
    assert set(free.tolist()) == set(torch.topk(mass.sum(0), 20).indices.tolist())  # the most-reached keys


def test_capped_mass_fit_keeps_the_fixed_keys_and_lies_between_unfitted_and_full():
    mass = _masses(500, 80, 240, 1)
    free = fitted_keys(mass, 25)
    capped, full = fit_log_mass(mass, free), fit_log_mass(mass)
    fixed = torch.ones(80, dtype=torch.bool)
    fixed[free] = False
    assert (capped[fixed] == 0).all() and (capped[free] != 0).any()
    unfitted = _mass_objective(mass, torch.zeros(80))
    # the ridge's μ² is taken from the solved keys' Gram, so compare with a little slack
    assert _mass_objective(mass, full) <= _mass_objective(mass, capped) * 1.01
    assert _mass_objective(mass, capped) < 0.5 * unfitted


def test_capped_value_fit_keeps_the_fixed_values_and_fits_the_rest():
    mass = _masses(600, 70, 200, 2)
    g = torch.Generator().manual_seed(3)
    targets, prior = torch.randn(600, 8, generator=g), torch.randn(70, 8, generator=g)
    free = fitted_keys(mass, 30)
    beta = fit_log_mass(mass, free)
    Z = fit_values(mass, beta, targets, prior, free)
    fixed = torch.ones(70, dtype=torch.bool)
    fixed[free] = False
    assert torch.equal(Z[fixed].float(), prior[fixed])

    def error(values: torch.Tensor) -> float:  # ‖RZ − targets‖² of the compacted attention
        R = torch.softmax(torch.log(mass.double().clamp_min(1e-300)) + beta.double(), 1)
        return float(((R @ values.double() - targets.double()) ** 2).sum())

    full = fit_values(mass, beta, targets, prior)
    assert error(full) <= error(Z) * 1.01 and error(Z) < error(prior)


def test_every_key_kept_with_a_cap_gives_back_the_document():
    """All n keys kept: the fixed ones leave exactly the fitted ones' mass, so the fitted w stay ≈ 1
    (β ≈ 0) and the state is the document's whatever the cap."""
    mass = _masses(800, 50, 50, 4)
    beta = fit_log_mass(mass, fitted_keys(mass, 10))
    assert beta.abs().max() < 1e-2


def test_capped_value_fit_equals_the_softmax_formulation_in_float64():
    """_fit_some_values writes the compacted attention as mass·w / Σ mass·w (no log, no [N, p]
    softmax): the same Z as the softmax of log mass + β, the fixed keys' share taken out, in float64 —
    with a β that spans the stored range (e^±27) and keys no query reaches (mass 0)."""
    from float_tolerance import FORWARD, assert_close_reordered
    from nectar.states.matching_fit import _solve_values

    mass = _masses(700, 90, 260, 5)
    mass[:, 7] = 0.0  # a key no fit query reaches
    g = torch.Generator().manual_seed(6)
    targets, prior = torch.randn(700, 8, generator=g), torch.randn(90, 8, generator=g)
    free = fitted_keys(mass, 35)
    beta = fit_log_mass(mass, free)
    beta[free[:3]] = torch.tensor([27.0, -27.0, 12.0], dtype=beta.dtype)
    fixed = torch.ones(90, dtype=torch.bool)
    fixed[free] = False
    R = torch.softmax(torch.log(mass.double().clamp_min(1e-300)) + beta.double(), 1)  # [N, p]
    rest = targets.double() - R[:, fixed] @ prior[fixed].double()
    want = _solve_values(R[:, free].float(), rest.float(), prior[free]).double()
    got = fit_values(mass, beta, targets, prior, free)
    assert_close_reordered(got[free], want, FORWARD, name="capped value fit")  # a solve: a deep reordering
    assert torch.equal(got[fixed].float(), prior[fixed])


def _head(n_queries: int, kept: int, seed: int) -> tuple[torch.Tensor, ...]:
    """q [N, 16], α [N] (over twice the kept keys), kept keys [kept, 16], their values [kept, 8]."""
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(n_queries, 16, generator=g), torch.randn(2 * kept, 16, generator=g)
    alpha = torch.logsumexp(q @ k.T * 0.5, 1)
    return q, alpha, k[:kept].contiguous(), torch.randn(kept, 8, generator=g)


def test_capped_masses_in_row_blocks_equal_the_masses_formed_whole(monkeypatch):
    """capped_masses forms the masses a few rows at a time (twice: ranking, then columns and sums): the
    same fitted keys, columns and fixed sums as CappedMasses.of the whole [N, p] masses."""
    from float_tolerance import assert_close_reordered
    from nectar.states import matching_fit
    from nectar.states.selection import attention_probs

    q, alpha, keys, prior = _head(300, 90, 7)
    monkeypatch.setattr(matching_fit, "MASS_BLOCK", 7 * 90)  # 7 rows a block: 43 blocks, a ragged last one
    assert matching_fit.capped_masses(q, alpha, keys, prior, 0.5, 90) is None  # under the cap: not capped
    got = matching_fit.capped_masses(q, alpha, keys, prior, 0.5, 30)
    mass = attention_probs(q, alpha, keys, 0.5)
    want = matching_fit.CappedMasses.of(mass, fitted_keys(mass, 30), prior)
    assert torch.equal(got.free, want.free)
    for name in ("cols", "fixed_mass", "fixed_out"):
        assert_close_reordered(getattr(got, name), getattr(want, name), name=name)
    fixed = torch.ones(90, dtype=torch.bool)
    fixed[got.free] = False
    assert_close_reordered(got.fixed_mass, mass[:, fixed].sum(1), name="fixed mass")  # the sums are the fixed keys'
    assert not torch.allclose(got.fixed_mass, mass.sum(1))  # and not every key's: the check can fail


def test_capped_fit_from_blocks_equals_the_fit_from_whole_masses(monkeypatch):
    """β and values fitted from the row-blocked masses (what the first state runs) equal fit_log_mass
    and fit_values on the whole masses with the same cap."""
    from float_tolerance import assert_close_reordered
    from nectar.states import matching_fit
    from nectar.states.selection import attention_probs

    q, alpha, keys, prior = _head(400, 80, 8)
    targets = torch.randn(400, 8, generator=torch.Generator().manual_seed(9))
    monkeypatch.setattr(matching_fit, "MASS_BLOCK", 16 * 80)
    capped = matching_fit.capped_masses(q, alpha, keys, prior, 0.5, 25)
    beta = matching_fit.capped_log_mass(capped, 80)
    mass = attention_probs(q, alpha, keys, 0.5)
    free = fitted_keys(mass, 25)
    assert_close_reordered(beta, fit_log_mass(mass, free), 1e-4, name="capped beta")  # a solve: deeper reordering
    assert_close_reordered(matching_fit.capped_values(capped, beta, targets, prior),
                           fit_values(mass, beta, targets, prior, free), 1e-4, name="capped values")


def test_capped_value_fit_refuses_a_beta_on_the_fixed_keys():
    mass = _masses(200, 40, 80, 10)
    free = fitted_keys(mass, 10)
    beta = fit_log_mass(mass, free)
    beta[[i for i in range(40) if i not in set(free.tolist())][0]] = 0.5
    with pytest.raises(ValueError, match="β = 0 on the keys it does not fit"):
        fit_values(mass, beta, torch.randn(200, 8), torch.randn(40, 8), free)
