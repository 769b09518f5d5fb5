"""Student-t intervals and the score gap, checked against scipy."""
import math

import numpy as np
import pytest
from scipy import stats

from nectar.evaluation.stats import mean_ci, score_gap


@pytest.mark.parametrize("values", [[3, 4, 5, 2, 4], [1.0, 1.5], [2, 2, 2, 5, 1, 3, 4, 4, 5, 1]])
def test_mean_ci_matches_scipy_t_interval(values):
    ci = mean_ci(values)
    low, high = stats.t.interval(0.95, len(values) - 1, loc=np.mean(values), scale=stats.sem(values))
    assert (ci.low, ci.high) == (pytest.approx(low), pytest.approx(high))


def test_mean_ci_other_confidence_and_degenerate_sizes():
    ci = mean_ci([1, 2, 3, 4], confidence=0.9)
    low, high = stats.t.interval(0.9, 3, loc=2.5, scale=stats.sem([1, 2, 3, 4]))
    assert ci.low == pytest.approx(low) and ci.high == pytest.approx(high)
    assert math.isnan(mean_ci([3]).half_width) and mean_ci([3]).mean == 3
    assert mean_ci([]).n == 0 and mean_ci([]).fmt() == "n/a"
    with pytest.raises(ValueError, match="confidence"):
        mean_ci([1, 2], confidence=1.5)


def test_score_gap_is_paired_and_skips_unparsed_samples():
    base = [5, 4, None, 3, 4, 2]
    module = [4, 4, 3, 1, None, 2]
    gap = score_gap(base, module, agreement=[5, None, 4, 2, 3, 5])
    pairs = [(5, 4), (4, 4), (3, 1), (2, 2)]
    diffs = [b - m for b, m in pairs]
    res = stats.ttest_rel([b for b, _ in pairs], [m for _, m in pairs])
    low, high = res.confidence_interval(0.95)
    assert gap.delta.mean == pytest.approx(np.mean(diffs))
    assert (gap.delta.low, gap.delta.high) == (pytest.approx(low), pytest.approx(high))
    assert gap.base.mean == pytest.approx(3.5) and gap.module.mean == pytest.approx(2.75)
    assert (gap.n_samples, gap.n_unparsed, gap.agreement.n) == (6, 2, 5)


def test_score_gap_requires_paired_lists():
    with pytest.raises(ValueError, match="pair up"):
        score_gap([1, 2], [1])
