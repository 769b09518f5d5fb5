"""`nectar compare`'s paired gap to the best kvpress press at each budget (differences_vs_kvpress)."""
import numpy as np
import pytest

from nectar.comparison.differences import differences_vs_kvpress
from nectar.comparison.jobs import Job
from nectar.comparison.table import differences_markdown
from nectar.comparison.systems import resolve
from nectar.evaluation.quality import split_quality
from nectar.evaluation.selection import Selection
from nectar.evaluation.teacher import EvalPair, PairSums
from nectar.schemas.config import EvaluateConfig


def _sums(kl: np.ndarray) -> PairSums:
    n = np.full(len(kl), 20.0)
    return PairSums(correct=n / 2, nll=kl + 1, kl=kl, n=n)


def test_each_system_is_compared_with_the_best_press_at_its_own_budget_on_every_split():
    rng = np.random.default_rng(0)
    P = 30
    pairs = [EvalPair(f"p{i}", "qa", ("probes",) if i < 20 else ("test",), (1, 2, 3), 1) for i in range(P)]
    sel = Selection(pairs, {}, {"probes": [f"p{i}" for i in range(20)], "test": [f"p{i}" for i in range(20, P)]})
    none, full, ours, kvzip, snap = resolve(["none", "full", "recon_fit_qa@int4", "kvpress:kvzip:int4",
                                             "kvpress:snapkv"])
    jobs = [Job(none, None), Job(full, None)] + [Job(s, r) for r in (0.01, 0.05) for s in (ours, kvzip, snap)]
    kl_none = rng.gamma(2.0, 1.0, size=P) * 20
    share = {"recon_fit_qa@int4": 0.10, "kvpress:kvzip:int4": 0.12, "kvpress:snapkv": 0.5}
    sums = {"none": _sums(kl_none), "full": _sums(np.zeros(P))}
    for j in jobs[2:]:
        sums[j.key] = _sums(kl_none * (share[j.system.name] + (0.2 if j.rho == 0.01 else 0.0)))
    cfg = EvaluateConfig()
    idx = sel.split_index()
    quality = {split: split_quality({k: s.take(i) for k, s in sums.items()}, None, split, cfg.bootstrap_resamples,
                                    cfg.seed) for split, i in idx.items()}
    diffs = differences_vs_kvpress(jobs, sums, sel, quality, cfg)
    # one line per (split, budget): ours against kvzip (the better press), never a press against a press
    assert sorted((d["split"], d["system"], d["reference"]) for d in diffs) == [
        (s, f"recon_fit_qa@int4@{r}", f"kvpress:kvzip:int4@{r}") for s in ("probes", "test") for r in ("0.01", "0.05")]
    for d in diffs:
        q = quality[d["split"]]
        gap = q[d["system"]].recovered_kl.value - q[d["reference"]].recovered_kl.value
        assert d["delta_recovered_kl"] == pytest.approx(gap) == pytest.approx(0.02)
        assert d["n_pairs"] == len(idx[d["split"]])
    md = differences_markdown(diffs)
    assert "| probes | recon_fit_qa@int4@0.05 | kvpress:kvzip:int4@0.05 | 20 | 2.0 [" in md
    assert differences_markdown([]) == ""


def test_without_kvpress_rows_there_is_no_difference():
    none, full, ours = resolve(["none", "full", "recon_fit_qa@int4"])
    pairs = [EvalPair(f"p{i}", "qa", ("probes",), (1, 2, 3), 1) for i in range(5)]
    sel = Selection(pairs, {}, {"probes": [p.pair_id for p in pairs]})
    sums = {k: _sums(np.ones(5)) for k in ("none", "full", "recon_fit_qa@int4@0.05")}
    quality = {"probes": split_quality(sums, None, "probes")}
    assert differences_vs_kvpress([Job(none, None), Job(full, None), Job(ours, 0.05)], sums, sel, quality,
                                  EvaluateConfig()) == []


def test_a_refined_state_is_compared_with_the_closed_form_state_it_starts_from():
    """System.refines: recon_train_qa@int4 against recon_fit_qa@int4 at the same budget (and only there)."""
    from nectar.comparison.differences import differences_vs_start

    rng = np.random.default_rng(1)
    P = 12
    pairs = [EvalPair(f"p{i}", "qa", ("probes",), (1, 2, 3), 1) for i in range(P)]
    sel = Selection(pairs, {}, {"probes": [p.pair_id for p in pairs]})
    none, full, fit, trained, distilled = resolve(["none", "full", "recon_fit_qa@int4", "recon_train_qa@int4",
                                                   "recon_distill_qa@int4"])
    jobs = [Job(none, None), Job(full, None), Job(fit, 0.01), Job(trained, 0.01), Job(trained, 0.05),
            Job(distilled, 0.01)]
    kl_none = rng.gamma(2.0, 1.0, size=P) * 20
    share = {"recon_fit_qa@int4@0.01": 0.10, "recon_train_qa@int4@0.01": 0.07, "recon_train_qa@int4@0.05": 0.01,
             "recon_distill_qa@int4@0.01": 0.13}
    sums = {"none": _sums(kl_none), "full": _sums(np.zeros(P)), **{k: _sums(kl_none * v) for k, v in share.items()}}
    cfg = EvaluateConfig()
    quality = {"probes": split_quality(sums, None, "probes", cfg.bootstrap_resamples, cfg.seed)}
    diffs = differences_vs_start(jobs, sums, sel, quality, cfg)
    assert [(d["system"], d["reference"]) for d in diffs] == [  # the 0.05 state has no fit at 0.05 here
        ("recon_train_qa@int4@0.01", "recon_fit_qa@int4@0.01"), ("recon_distill_qa@int4@0.01", "recon_fit_qa@int4@0.01")]
    assert [round(d["delta_recovered_kl"], 6) for d in diffs] == [0.03, -0.03]
    for d in diffs:  # every pair keeps the same share: the paired interval is the point
        assert d["low"] == pytest.approx(d["delta_recovered_kl"]) == pytest.approx(d["high"]) and d["n_pairs"] == P
    assert differences_vs_kvpress(jobs, sums, sel, quality, cfg) == []  # no press: only these
