"""Teacher-forced metrics and App. C errors against values computed by hand on tiny inputs."""
import math

import pytest
import torch

from nectar.evaluation.metrics import (
    HeadErrors, accuracy_gap, layer_head_errors, recovered_fraction, response_targets, token_sums,
    total_rte,
)


def _logits(rows):
    return torch.log(torch.tensor(rows, dtype=torch.float32))


def test_response_targets_shift_and_mask_only_response_tokens():
    ids = torch.tensor([[7, 8, 9, 10], [4, 5, 6, 0]])  # second row padded after 3 tokens
    targets, mask = response_targets(ids, torch.tensor([2, 1]), torch.tensor([4, 3]))
    assert targets.tolist() == [[8, 9, 10, 0], [5, 6, 0, 0]]
    # row 0: logits 1, 2 predict response tokens 2, 3; row 1: logits 0, 1 predict tokens 1, 2.
    assert mask.tolist() == [[False, True, True, False], [True, True, False, False]]


def test_response_targets_rejects_a_response_without_a_prompt():
    with pytest.raises(ValueError, match="response_start must be >= 1"):
        response_targets(torch.tensor([[1, 2]]), torch.tensor([0]), torch.tensor([2]))


def test_token_sums_match_hand_computed_accuracy_ce_and_kl():
    ids = torch.tensor([[0, 1, 2, 3]])
    targets, mask = response_targets(ids, torch.tensor([2]), torch.tensor([4]))
    p_model = [[0.25] * 4, [0.1, 0.2, 0.6, 0.1], [0.4, 0.3, 0.2, 0.1], [0.25] * 4]
    p_full = [[0.25] * 4, [0.25, 0.25, 0.25, 0.25], [0.1, 0.2, 0.3, 0.4], [0.25] * 4]
    s = token_sums(_logits([p_model]), _logits([p_full]), targets, mask)
    assert s.n == 2
    assert s.token_acc == 0.5  # row 1 argmax 2 == target 2; row 2 argmax 0 != target 3
    assert s.cross_entropy == pytest.approx((-math.log(0.6) - math.log(0.1)) / 2, rel=1e-6)
    kl1 = sum(0.25 * math.log(0.25 / p) for p in (0.1, 0.2, 0.6, 0.1))
    kl2 = sum(f * math.log(f / p) for f, p in zip((0.1, 0.2, 0.3, 0.4), (0.4, 0.3, 0.2, 0.1)))
    assert s.kl_to_full == pytest.approx((kl1 + kl2) / 2, rel=1e-5)


def test_token_sums_add_over_batches_weights_by_tokens():
    a = token_sums(_logits([[[0.9, 0.1], [0.9, 0.1]]]), _logits([[[0.9, 0.1], [0.9, 0.1]]]),
                   torch.tensor([[0, 0]]), torch.tensor([[True, True]]))
    b = token_sums(_logits([[[0.9, 0.1]]]), _logits([[[0.9, 0.1]]]), torch.tensor([[1]]),
                   torch.tensor([[True]]))
    total = a.add(b)
    assert (total.n, total.token_acc) == (3, pytest.approx(2 / 3))
    assert total.kl_to_full == pytest.approx(0.0, abs=1e-7)  # identical models


def test_gap_and_recovered_fraction():
    assert accuracy_gap(0.8, 0.7) == pytest.approx(0.1)
    assert recovered_fraction(0.7, 0.8, 0.4) == pytest.approx(0.75)
    assert recovered_fraction(0.5, 0.4, 0.4) is None  # the document brings no benefit
    assert recovered_fraction(0.95, 0.92, 0.93) is None  # the document hurts: no share to recover


def test_layer_head_errors_match_hand_computed_rte():
    q = torch.tensor([[[1.0, 0.0]]])  # [T=1, H=1, d=2]
    A = torch.tensor([[[0.0, 0.0]]])
    pred_A = torch.tensor([[[0.1, 0.0]]])
    alpha, pred_alpha = torch.tensor([[2.0]]), torch.tensor([[1.5]])
    sums = layer_head_errors(q, alpha, A, pred_alpha, pred_A)
    assert sums["sq_err_A"].item() == pytest.approx(0.01)
    assert sums["log_ratio_A"].item() == pytest.approx(math.log(0.01 / 1.0))
    assert sums["sq_err_alpha"].item() == pytest.approx(0.25)
    assert sums["log_ratio_alpha"].item() == pytest.approx(math.log(0.25 / 4.0))


def test_head_errors_average_over_tokens_and_sum_rte_over_heads():
    errs = HeadErrors.zeros(num_layers=2, num_heads=1)
    T = 4
    q = torch.ones(T, 1, 2)
    A = torch.zeros(T, 1, 2)  # ||q - A||^2 = 2
    for layer, scale in ((0, 0.1), (1, 0.2)):
        sums = layer_head_errors(q, torch.ones(T, 1), A, torch.ones(T, 1) * (1 + scale),
                                 A + scale)  # ||pred - A||^2 = 2 scale^2
        errs.add_layer(layer, sums)
    errs.n += T
    means = errs.means()
    assert means["mse_A"][:, 0].tolist() == pytest.approx([0.02, 0.08])
    assert means["rte_A"][:, 0].tolist() == pytest.approx([math.log(0.01), math.log(0.04)])
    assert total_rte(means["rte_A"]) == pytest.approx(math.log(0.01) + math.log(0.04))
