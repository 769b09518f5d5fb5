"""Derived hyperparameters and the warmup–cosine schedule (paper App. A.4)."""
import math
import pickle

import pytest
import torch

from nectar.training.schedule import LRFactor, derive_schedule


def test_derived_quantities_follow_the_paper_rules():
    s = derive_schedule(samples=1_000_000, batch_size=16, ref_batch_size=4, peak_lr=1e-4, n_items=80_000)
    assert s.total_steps == 62_500
    assert s.peak_lr == pytest.approx(1e-4 * math.sqrt(16 / 4))
    assert s.warmup_steps == int(min(62_500 / 40, 10 * 80_000 / 16))  # 2.5 % of the budget
    small = derive_schedule(samples=1_000_000, batch_size=16, ref_batch_size=4, peak_lr=1e-4, n_items=100)
    assert small.warmup_steps == int(10 * 100 / 16)  # ten epochs of a tiny dataset


def test_warmup_rises_from_zero_to_peak_then_cosine_decays_towards_zero():
    s = derive_schedule(samples=4000, batch_size=10, ref_batch_size=10, peak_lr=1.0, n_items=10_000)
    lrs = [s.lr(i) for i in range(s.total_steps)]
    w = s.warmup_steps
    assert w == 10 and lrs[0] == pytest.approx(1 / w)
    assert lrs[w - 1] == pytest.approx(1.0) and lrs[w] == pytest.approx(1.0)
    assert all(a < b for a, b in zip(lrs[: w - 1], lrs[1:w]))
    assert all(a >= b for a, b in zip(lrs[w:], lrs[w + 1:]))
    assert lrs[-1] < 1e-3
    mid = w + (s.total_steps - w) // 2
    assert lrs[mid] == pytest.approx(0.5, abs=0.01)


def test_scheduler_state_roundtrips_through_a_checkpoint():
    s = derive_schedule(samples=100, batch_size=1, ref_batch_size=1, peak_lr=0.1, n_items=5)
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.AdamW([p], lr=s.peak_lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, LRFactor(s))
    for _ in range(7):
        opt.step()
        sched.step()
    state = pickle.loads(pickle.dumps({"opt": opt.state_dict(), "sched": sched.state_dict()}))
    opt2 = torch.optim.AdamW([p], lr=s.peak_lr)
    sched2 = torch.optim.lr_scheduler.LambdaLR(opt2, LRFactor(s))
    opt2.load_state_dict(state["opt"])
    sched2.load_state_dict(state["sched"])
    assert opt2.param_groups[0]["lr"] == pytest.approx(opt.param_groups[0]["lr"]) == pytest.approx(s.lr(7))
    sched.step()
    sched2.step()
    assert opt2.param_groups[0]["lr"] == pytest.approx(s.lr(8))


def test_bad_budget_is_rejected_with_the_field_names():
    with pytest.raises(ValueError, match="batch_size"):
        derive_schedule(samples=10, batch_size=0, ref_batch_size=4, peak_lr=1e-4, n_items=5)
