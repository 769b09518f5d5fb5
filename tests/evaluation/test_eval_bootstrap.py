"""Paired bootstrap over pairs: against closed-form intervals, degenerate cases, pairing, seeding."""
import math

import numpy as np
import pytest
from scipy import stats

from nectar.evaluation.bootstrap import PairedBootstrap

Z = stats.norm.ppf(0.975)


def test_iid_tokens_match_the_normal_theory_interval():
    # 400 pairs of 20 iid Bernoulli(0.3) tokens: accuracy = mean of the pair means, whose bootstrap
    # distribution is normal with variance (plug-in variance of the pair means) / P.
    rng = np.random.default_rng(1)
    P, m = 400, 20
    correct = rng.binomial(m, 0.3, size=P).astype(float)
    tokens = np.full(P, m, dtype=float)
    est = PairedBootstrap(P, resamples=4000, seed=3).ratio(correct, tokens)
    means = correct / m
    se = means.std(ddof=0) / math.sqrt(P)
    assert est.value == pytest.approx(means.mean())
    half = Z * se
    assert est.low == pytest.approx(est.value - half, abs=0.06 * half)
    assert est.high == pytest.approx(est.value + half, abs=0.06 * half)
    # and the population's own interval (p(1-p)/m per pair) up to the sampling noise of the variance
    pop_half = Z * math.sqrt(0.3 * 0.7 / m / P)
    assert est.high - est.low == pytest.approx(2 * pop_half, rel=0.15)


def test_ratio_of_sums_with_unequal_pairs_matches_the_delta_method():
    # Pairs of different lengths: Σx/Σn has delta-method standard error sqrt(Σ(x_i − r n_i)²) / Σ n_i.
    rng = np.random.default_rng(2)
    P = 300
    n = rng.integers(5, 80, size=P).astype(float)
    x = rng.gamma(2.0, 0.2, size=P) * n  # per-pair sums of a positive token metric (like KL)
    est = PairedBootstrap(P, resamples=4000, seed=0).ratio(x, n)
    r = x.sum() / n.sum()
    se = math.sqrt(((x - r * n) ** 2).sum()) / n.sum()
    assert est.value == pytest.approx(r)
    assert (est.high - est.low) == pytest.approx(2 * Z * se, rel=0.08)
    assert est.contains(est.value)


def test_zero_variance_gives_a_zero_width_interval():
    boot = PairedBootstrap(12, resamples=500, seed=0)
    est = boot.ratio(np.full(12, 3.0), np.full(12, 4.0))  # every pair 3 of 4 tokens right
    assert (est.value, est.low, est.high) == (0.75, 0.75, 0.75)
    mean = boot.mean(np.full(12, 0.25))
    assert mean.low == mean.high == mean.value == pytest.approx(0.25)


def test_pairing_a_system_equal_to_full_and_a_proportional_system():
    rng = np.random.default_rng(5)
    P = 50
    kl_none = rng.gamma(1.0, 1.0, size=P) * 30  # varies a lot from pair to pair
    boot = PairedBootstrap(P, resamples=1000, seed=0)
    full = boot.recovered(np.zeros(P), kl_none)
    assert (full.value, full.low, full.high) == (1.0, 1.0, 1.0)
    kl = boot.ratio(np.zeros(P), np.full(P, 30.0))
    assert (kl.value, kl.low, kl.high) == (0.0, 0.0, 0.0)
    none = boot.recovered(kl_none, kl_none)
    assert (none.value, none.low, none.high) == (0.0, 0.0, 0.0)
    # A system whose KL is 40 % of the no-document KL on every pair recovers exactly 60 %: numerator
    # and denominator share each resample. Resampling them independently would give a wide interval.
    half = boot.recovered(0.4 * kl_none, kl_none)
    assert half.value == pytest.approx(0.6)
    assert half.high - half.low < 1e-12
    other = PairedBootstrap(P, resamples=1000, seed=1)
    unpaired = 1 - (boot.weights @ (0.4 * kl_none)) / (other.weights @ kl_none)
    assert np.percentile(unpaired, 97.5) - np.percentile(unpaired, 2.5) > 0.1


def test_seeded_reproducibility():
    x, n = np.arange(20, dtype=float), np.arange(1, 21, dtype=float)
    a = PairedBootstrap(20, seed=7, key="test").ratio(x, n)
    assert a == PairedBootstrap(20, seed=7, key="test").ratio(x, n)
    assert a != PairedBootstrap(20, seed=8, key="test").ratio(x, n)
    assert a != PairedBootstrap(20, seed=7, key="probes").ratio(x, n)


def test_undefined_cases_are_nan_not_made_up():
    one = PairedBootstrap(1).ratio(np.array([2.0]), np.array([4.0]))
    assert one.value == 0.5 and math.isnan(one.low) and math.isnan(one.high)  # no interval from one pair
    empty = PairedBootstrap(0).ratio(np.zeros(0), np.zeros(0))
    assert math.isnan(empty.value) and empty.n_pairs == 0
    zero_den = PairedBootstrap(3).ratio(np.ones(3), np.zeros(3))
    assert math.isnan(zero_den.value) and math.isnan(zero_den.low)
    with pytest.raises(ValueError, match="drawn for 3 pairs"):
        PairedBootstrap(3).ratio(np.ones(4), np.ones(4))
    with pytest.raises(ValueError, match="confidence"):
        PairedBootstrap(3, confidence=95)
    assert PairedBootstrap(4).ratio(np.arange(4.0), np.ones(4)).fmt(2) .startswith("1.50 [")


def test_recovered_difference_is_the_gap_of_the_two_recovered_and_tighter_than_either_interval():
    # Two systems whose per-pair KLs move together (a shared pair difficulty): the paired gap's interval
    # is much narrower than either system's own, and its point is exactly the difference of the points.
    rng = np.random.default_rng(5)
    P = 60
    none = rng.gamma(2.0, 1.0, size=P) * 30
    hard = rng.uniform(0.02, 0.4, size=P)
    a, b = none * hard, none * (hard + 0.02)  # a always slightly better than b
    boot = PairedBootstrap(P, resamples=2000, seed=0, key="probes")
    ra, rb, d = boot.recovered(a, none), boot.recovered(b, none), boot.recovered_difference(a, b, none)
    assert d.value == pytest.approx(ra.value - rb.value)
    assert d.low > 0  # separated, while the two intervals overlap
    assert ra.low < rb.high
    assert d.high - d.low < 0.5 * min(ra.high - ra.low, rb.high - rb.low)
    # the same sums in the other order: the negated interval
    r = boot.recovered_difference(b, a, none)
    assert (r.value, r.low, r.high) == pytest.approx((-d.value, -d.high, -d.low))
