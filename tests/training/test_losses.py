"""Loss terms: the top-K + tail KL against a brute-force computation, regression sums against the
exact module (zero error), and the relative transport error's definition."""
import math

import pytest
import torch

from nectar.kl import kl_topk_tail_sum
from nectar.training.losses import correct_sum, regression_sums


def _coarse_kl(teacher_logits, student_logits, k):
    """Brute force: coarsen both full distributions to teacher-top-K ids + one 'rest' outcome."""
    p, q = teacher_logits.softmax(-1), student_logits.softmax(-1)
    ids = p.topk(k).indices
    pk, qk = p[ids], q[ids]
    P = torch.cat([pk, (1 - pk.sum()).reshape(1)])
    Q = torch.cat([qk, (1 - qk.sum()).reshape(1)])
    return float((P * (P / Q).log()).sum()), ids


def test_topk_tail_kl_matches_brute_force_and_bounds_the_full_kl():
    torch.manual_seed(0)
    V, K = 50, 5
    t, s = torch.randn(3, V) * 2, torch.randn(3, V) * 2
    logp = t.log_softmax(-1)
    top = logp.topk(K, dim=-1)
    got = kl_topk_tail_sum(s[None], top.indices[None], top.values[None], torch.ones(1, 3, dtype=torch.bool))
    want = sum(_coarse_kl(t[i], s[i], K)[0] for i in range(3))
    full = float((logp.exp() * (logp - s.log_softmax(-1))).sum())
    assert float(got) == pytest.approx(want, rel=1e-4)
    assert 0 < float(got) <= full


def test_topk_tail_kl_is_zero_for_the_teacher_and_respects_the_mask():
    t = torch.randn(2, 4, 30)
    top = t.log_softmax(-1).topk(6, dim=-1)
    mask = torch.tensor([[True, False, True, True], [False, False, True, False]])
    assert float(kl_topk_tail_sum(t, top.indices, top.values, mask)) == pytest.approx(0, abs=1e-5)
    s = t.clone()
    s[0, 1] = torch.randn(30) * 5  # a masked-out position may differ arbitrarily
    assert float(kl_topk_tail_sum(s, top.indices, top.values, mask)) == pytest.approx(0, abs=1e-5)
    s[1, 2] = torch.randn(30) * 5
    assert float(kl_topk_tail_sum(s, top.indices, top.values, mask)) > 1e-3


def test_correct_sum_counts_masked_argmax_hits():
    logits = torch.tensor([[[0.0, 1.0], [2.0, 0.0], [0.0, 3.0]]])  # argmax 1, 0, 1
    assert int(correct_sum(logits, torch.tensor([[1, 1, 1]]), torch.tensor([[True, True, False]]))) == 1


class _Fixed(torch.nn.Module):
    """A 'module' predicting fixed values, to check the loss arithmetic by hand."""

    def __init__(self, A, a, A_std, a_std):
        super().__init__()
        self.num_kv_heads = 1
        self.A, self.a = A, a
        self.A_std, self.alpha_std = A_std, a_std

    def predict(self, layer, q):
        n = q.shape[0]
        return self.A.expand(n, 1, -1), self.a.expand(n, 1)


def test_regression_sums_are_normalised_squared_errors_and_rte_is_the_log_ratio():
    q = torch.tensor([[[[3.0, 0.0]]], [[[0.0, 4.0]]]])  # [N=2, L=1, Hq=1, d=2]
    A_true = torch.zeros(2, 1, 1, 2)
    alpha = torch.full((2, 1, 1), 2.0)
    module = _Fixed(torch.tensor([1.0, 0.0]), torch.tensor(3.0), torch.tensor([[2.0]]), torch.tensor([[0.5]]))
    r = regression_sums(module, q, alpha, A_true)
    assert float(r.A) == pytest.approx(2 * (1 / 2) ** 2)  # ‖(1,0)/2‖² per token
    assert float(r.alpha) == pytest.approx(2 * (1 / 0.5) ** 2)
    # RTE: log(‖A_θ−𝒜‖² / ‖q−𝒜‖²) = log(1/9) + log(1/16); score: log((3−2)²/2²) twice
    assert float(r.rte_A) == pytest.approx(math.log(1 / 9) + math.log(1 / 16), rel=1e-5)
    assert float(r.rte_alpha) == pytest.approx(2 * math.log(1 / 4), rel=1e-5)
    assert r.n_terms == 2
