"""Paired bootstrap intervals over pairs (docs/design.md §11).

Tokens within a pair share one instruction and one answer, so they are correlated: an interval that
resampled tokens would be too narrow. These intervals resample whole PAIRS. Every metric here is a
ratio of per-pair sums — token accuracy = Σ correct / Σ tokens, KL = Σ kl / Σ tokens, recovered KL
= 1 − Σ kl_system / Σ kl_none, a per-pair score's mean = Σ score / Σ 1 — so one resampling serves
them all: a weight matrix W [B, P] (how often resample b draws pair p) turns per-pair sums x [P] into
resampled sums W @ x [B]. Using the SAME W for every system of a split, and for numerator and
denominator, is what makes the comparison paired: systems are compared on the same resampled pairs.

Intervals are percentile intervals of the B resampled statistics (two-sided, ``confidence``).
"""
from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import numpy as np

DEFAULT_RESAMPLES = 2000


@dataclass(frozen=True)
class Estimate:
    """A point estimate with its bootstrap interval over ``n_pairs`` pairs (nan where undefined:
    no pairs, a zero denominator, or fewer than two pairs for an interval)."""

    value: float
    low: float
    high: float
    n_pairs: int

    def contains(self, x: float, tol: float = 1e-9) -> bool:
        return self.low - tol <= x <= self.high + tol

    def fmt(self, digits: int = 3, scale: float = 1.0) -> str:
        if math.isnan(self.value):
            return "–"
        v = f"{self.value * scale:.{digits}f}"
        if math.isnan(self.low):
            return v
        return f"{v} [{self.low * scale:.{digits}f}, {self.high * scale:.{digits}f}]"


NAN_ESTIMATE = Estimate(float("nan"), float("nan"), float("nan"), 0)


class PairedBootstrap:
    """One resampling of ``n_pairs`` pairs, shared by every metric and system it is applied to.

    ``key`` (e.g. the split name) enters the seed so two splits don't reuse the same draws.
    """

    def __init__(self, n_pairs: int, resamples: int = DEFAULT_RESAMPLES, seed: int = 0,
                 confidence: float = 0.95, key: str = ""):
        if not 0 < confidence < 1:
            raise ValueError(f"confidence must be in (0, 1), got {confidence}")
        if resamples < 1:
            raise ValueError(f"resamples must be >= 1, got {resamples}")
        self.n_pairs = n_pairs
        self.confidence = confidence
        rng = np.random.default_rng([seed, zlib.crc32(key.encode())])
        if n_pairs > 0:
            # Multinomial counts = drawing n_pairs pairs with replacement, without the index matrix.
            self.weights = rng.multinomial(n_pairs, np.full(n_pairs, 1.0 / n_pairs),
                                           size=resamples).astype(np.float64)  # [B, P]
        else:
            self.weights = np.zeros((resamples, 0))

    def _check(self, x: np.ndarray) -> np.ndarray:
        x = np.asarray(x, dtype=np.float64)
        if x.shape != (self.n_pairs,):
            raise ValueError(f"per-pair values have shape {x.shape}, the bootstrap was drawn for "
                             f"{self.n_pairs} pairs")
        return x

    def _interval(self, samples: np.ndarray) -> tuple[float, float]:
        samples = samples[np.isfinite(samples)]
        if self.n_pairs < 2 or samples.size == 0:
            return float("nan"), float("nan")
        tail = 100 * (1 - self.confidence) / 2
        low, high = np.percentile(samples, [tail, 100 - tail])
        return float(low), float(high)

    def ratio(self, num, den) -> Estimate:
        """Σ num / Σ den with its interval (num, den: per-pair sums [P])."""
        num, den = self._check(num), self._check(den)
        if self.n_pairs == 0:
            return NAN_ESTIMATE
        total = den.sum()
        value = float(num.sum() / total) if total != 0 else float("nan")
        with np.errstate(divide="ignore", invalid="ignore"):
            samples = (self.weights @ num) / (self.weights @ den)  # [B]
        return Estimate(value, *self._interval(samples), self.n_pairs)

    def mean(self, values) -> Estimate:
        """Mean of a per-pair score (each pair weighs the same)."""
        return self.ratio(values, np.ones(self.n_pairs))

    def recovered(self, kl_system, kl_none) -> Estimate:
        """1 − Σ kl_system / Σ kl_none: the share of the no-document KL the system removes
        (0 for no document, 1 for the full document). Numerator and denominator share each resample."""
        r = self.ratio(kl_system, kl_none)
        return Estimate(1 - r.value, 1 - r.high, 1 - r.low, r.n_pairs)

    def recovered_difference(self, kl_a, kl_b, kl_none) -> Estimate:
        """recovered(a) − recovered(b) = (Σ kl_b − Σ kl_a) / Σ kl_none, each resample's difference on
        the same drawn pairs: the paired interval of the gap, tighter than the two intervals apart."""
        kl_a, kl_b = self._check(kl_a), self._check(kl_b)
        return self.ratio(kl_b - kl_a, kl_none)
