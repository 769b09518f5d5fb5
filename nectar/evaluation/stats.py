"""Means with Student-t confidence intervals, and the similarity score gap Δs (paper §4.3).

Δs = mean(base) − mean(module) over the judge's 1..5 scores (lower is better; negative means the
module beats the full-context model). Base and module answer the *same* instructions, so the
interval is the paired one: a Student-t interval on the per-sample differences, over the samples
where both judgments parsed. Samples where either reply failed to parse are counted, not imputed.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Iterable, Sequence

from scipy import stats as _st


@dataclass(frozen=True)
class MeanCI:
    """mean ± half_width (a ``confidence`` Student-t interval); half_width is nan below 2 samples."""

    mean: float
    half_width: float
    n: int
    confidence: float = 0.95

    @property
    def low(self) -> float:
        return self.mean - self.half_width

    @property
    def high(self) -> float:
        return self.mean + self.half_width

    def as_dict(self) -> dict[str, float | int]:
        return {**asdict(self), "low": self.low, "high": self.high}

    def fmt(self, digits: int = 2) -> str:
        if self.n == 0:
            return "n/a"
        if math.isnan(self.half_width):
            return f"{self.mean:.{digits}f} (n={self.n})"
        return f"{self.mean:.{digits}f} ± {self.half_width:.{digits}f}"


def mean_ci(values: Iterable[float], confidence: float = 0.95) -> MeanCI:
    """Mean and the two-sided Student-t interval half width t_{(1+c)/2, n-1} · s / √n."""
    xs = [float(v) for v in values]
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    n = len(xs)
    if n == 0:
        return MeanCI(float("nan"), float("nan"), 0, confidence)
    mean = sum(xs) / n
    if n < 2:
        return MeanCI(mean, float("nan"), n, confidence)
    var = sum((x - mean) ** 2 for x in xs) / (n - 1)  # unbiased sample variance
    t = _st.t.ppf((1 + confidence) / 2, df=n - 1)
    return MeanCI(mean, float(t * math.sqrt(var / n)), n, confidence)


@dataclass(frozen=True)
class ScoreGap:
    """Δs for one group of samples: the paired difference base − module, plus the two means."""

    delta: MeanCI  # mean(base − module) over samples where both parsed, with its interval
    base: MeanCI  # mean base score over those samples
    module: MeanCI  # mean module score over those samples
    agreement: MeanCI  # module-vs-base comparison score over the samples where it parsed
    n_samples: int  # samples in the group
    n_unparsed: int  # samples missing a module or base score (parse errors), excluded from Δs


def score_gap(base: Sequence[int | None], module: Sequence[int | None],
              agreement: Sequence[int | None] = (), confidence: float = 0.95) -> ScoreGap:
    """Δs over paired per-sample scores (None = the judge's reply did not parse)."""
    if len(base) != len(module):
        raise ValueError(f"base ({len(base)}) and module ({len(module)}) score lists must pair up")
    both = [(b, m) for b, m in zip(base, module) if b is not None and m is not None]
    return ScoreGap(
        delta=mean_ci([b - m for b, m in both], confidence),
        base=mean_ci([b for b, _ in both], confidence),
        module=mean_ci([m for _, m in both], confidence),
        agreement=mean_ci([a for a in agreement if a is not None], confidence),
        n_samples=len(base),
        n_unparsed=len(base) - len(both),
    )
