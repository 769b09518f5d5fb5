"""The tolerance helpers the float comparisons use (tests/float_tolerance.py) can fail: each bound
rejects a real difference and accepts rounding."""
import pytest
import torch

from float_tolerance import (FORWARD, assert_close_reordered, assert_trained_close, close_reordered,
                             same_greedy_until_near_tie)


def test_reordered_bound_scales_with_magnitude_and_rejects_real_errors():
    x = torch.randn(64, 32) * 50
    assert close_reordered(x + 1e-4, x)  # 1e-4 is rounding at magnitude ~150
    assert not close_reordered(x + 1e-1, x)
    small = torch.randn(8) * 1e-3
    assert not close_reordered(small + 1e-4, small)  # floored at unit scale: 1e-5 absolute
    with pytest.raises(AssertionError, match="largest magnitude"):
        assert_close_reordered(x * 1.01, x, name="scaled")
    masked = torch.tensor([0.5, float("-inf"), 2.0])
    assert close_reordered(masked, masked)


def test_trained_bound_accepts_one_flipped_element_and_rejects_a_divergence():
    torch.manual_seed(0)
    want = {"w": torch.randn(2, 16, 33)}
    flipped = {"w": want["w"].clone()}
    flipped["w"][0, 0, 0] += 2e-3  # one near-zero-gradient element moved by Adam's step size
    assert_trained_close(flipped, want, steps=6, lr=3e-3)
    diverged = {"w": want["w"] + 3e-3 * torch.randn_like(want["w"])}  # every element off by ~lr
    with pytest.raises(AssertionError, match="at most 1 %"):
        assert_trained_close(diverged, want, steps=6, lr=3e-3)
    with pytest.raises(AssertionError, match="2·lr·steps"):
        assert_trained_close({"w": want["w"] + 1.0}, want, steps=6, lr=3e-3)


def test_greedy_divergence_is_accepted_only_at_a_near_tie():
    def logits(gap):
        def next_logits(prefix):
            row = torch.zeros(10)
            row[1], row[2] = 5.0, 5.0 - gap  # tokens 1 and 2 are the top two
            return row
        return next_logits
    assert same_greedy_until_near_tie(logits(1.0), [1, 1, 1], [1, 1, 1])
    assert same_greedy_until_near_tie(logits(0.1 * FORWARD), [1, 1, 1], [1, 2, 2])  # a tie: may flip
    assert not same_greedy_until_near_tie(logits(1.0), [1, 1, 1], [1, 2, 2])  # a clear margin: a bug
    assert not same_greedy_until_near_tie(logits(1.0), [1, 1, 1], [1, 1])  # stopped early without a tie
