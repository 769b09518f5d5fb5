"""``nectar compare`` end to end on the tiny model: a run with targets (verified dataset written by
hand: tests/hand_written_run.py), every system trained or fitted, scored with
paired intervals, written, and a second compare that trains nothing."""
import json
import os
import subprocess
import sys

import pytest

from nectar import comparison, orchestration
from nectar.comparison.jobs import baseline_plan
from nectar.comparison.systems import SYSTEMS, System, methods_available
from nectar.schemas import ComparisonRow
from nectar.schemas.presets import PRESET_REGIMES
from nectar.tables import read_table

from hand_written_run import run_with_targets

TRAINED = ["regression", "mixed", "distill", "cartridges"]
BASELINES = ["truncate", "evict", "attention_matching"]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    # A few distillation steps per KL regime (pairs through the whole model) keep each training seconds;
    # the tiny preset's own 800-pair budget is minutes per regime on two cores.
    mp = pytest.MonkeyPatch()
    mp.setitem(PRESET_REGIMES, "tiny", {r: {"train": {"samples": 48, "batch_size": 8}}
                                        for r in ("mixed", "distill", "cartridges")})
    ctx = run_with_targets(tmp_path_factory.mktemp("cmp"), "tiny",
                           ["evaluate.bootstrap_resamples=300", "evaluate.agreement_new_tokens=6"], challenge={8, 9})
    yield ctx
    mp.undo()


@pytest.fixture
def extra_system():
    """A system added the way the registry says: one entry (a quadrature module under regression)."""
    s = comparison.register(System("quad_regression", "trained", "quadrature under regression",
                                   regime="regression", overlay={"train": {"module": {"arch": "quadrature"}}}))
    yield s
    del SYSTEMS[s.name]


@pytest.mark.slow
def test_compare_writes_every_system_and_split_and_reuses_training(tiny_run, extra_system):
    ctx = tiny_run
    systems = ["none", "full", *TRAINED, "quad_regression"] + (BASELINES if methods_available() else [])
    trained = []
    res = comparison.compare(ctx, systems, rhos=[0.1],
                             run_one=lambda c, stage, force: trained.append(orchestration.run_train(c).status))
    rows = read_table(ctx.run.url("compare", "comparison.parquet"), ComparisonRow)
    assert rows == res.rows
    rhos = [ctx.config.train.module.rho, 0.1]
    splits = ("test", "challenge", "probes")  # probes: the held-out document probes the targets cached
    keys = {(r.system, r.rho, r.split) for r in rows}
    want = {(s, None, sp) for s in ("none", "full") for sp in splits}
    want |= {(s, rho, sp) for s in systems[2:] for rho in rhos for sp in splits}
    # the run's own trained state is compared unnamed (issue 39), at the run's budget
    want |= {("run:refined", ctx.config.train.module.rho, sp) for sp in splits}
    assert keys == want and len(rows) == len(want)
    by = {(r.system, r.rho, r.split): r for r in rows}
    for split in splits:
        none, full = by[("none", None, split)], by[("full", None, split)]
        assert none.recovered_kl == 0.0 and full.recovered_kl == 1.0 and full.kl_to_full == 0.0
        assert (full.recovered_kl_ci_low, full.recovered_kl_ci_high) == (1.0, 1.0)
        assert full.agreement_exact == 1.0 and full.state_bytes > 0 and none.state_bytes == 0
    assert by[("none", None, "test")].n_pairs == 4 and by[("none", None, "challenge")].n_pairs == 2
    assert by[("none", None, "probes")].n_pairs >= 2
    for r in rows:
        for metric, prefix in (("kl_to_full", "kl"), ("recovered_kl", "recovered_kl"), ("token_acc", "token_acc"),
                               ("cross_entropy", "cross_entropy"), ("agreement_rouge_l", "agreement_rouge_l")):
            v, lo, hi = getattr(r, metric), getattr(r, f"{prefix}_ci_low"), getattr(r, f"{prefix}_ci_high")
            assert lo - 1e-9 <= v <= hi + 1e-9, (r.system, r.rho, r.split, metric)
        assert r.n_tokens == by[("none", None, r.split)].n_tokens  # every system scored on the same tokens
    # equal bytes per budget: trained modules and baselines at a ρ store about the same
    for rho in rhos:
        sizes = [by[(s, rho, "test")].state_bytes for s in systems[2:]]
        assert max(sizes) < 1.5 * min(sizes) and max(sizes) < by[("full", None, "test")].state_bytes
        assert all(by[(s, rho, "test")].train_seconds > 0 for s in systems[2:])
    assert by[("quad_regression", 0.1, "test")].arch == "quadrature" and by[("mixed", 0.1, "test")].regime == "mixed"
    # the run's own regime (regression) at its own ρ is the run's module: trained in the run itself
    assert by[("regression", rhos[0], "test")].source == ctx.run.root
    assert "done" in trained
    md = (ctx.run.local_path("compare", "comparison.md"))
    text = open(md).read()
    assert "## test: 4 pairs" in text and "| full | reference | – |" in text and "frontier.png" in text
    assert open(ctx.run.local_path("compare", "frontier.png"), "rb").read()[:4] == b"\x89PNG"
    # a second compare trains nothing: every train stage is a cache hit
    again = []
    comparison.train_missing(comparison.plan_jobs(ctx, ["none", "full", "mixed"], [0.1]),
                             lambda c, stage, force: again.append(orchestration.run_train(c).status))
    assert again == ["cached", "cached"]


@pytest.mark.slow
def test_cli_compare_through_prefect_with_progress_and_status(tiny_run, tmp_path):
    env = dict(os.environ, PREFECT_HOME=str(tmp_path / "prefect"), PYTHONPATH=os.pathsep.join(sys.path))
    env.pop("PREFECT_API_URL", None)
    cli = [sys.executable, "-m", "nectar.pipeline.cli"]
    run_dir = tiny_run.run.root
    bad = subprocess.run([*cli, "compare", run_dir, "--rho", "0,5"], capture_output=True, text=True, env=env)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "--rho 0:" in bad.stderr
    # the run's own regime at its own ρ (its train stage) and a closed-form baseline
    res = subprocess.run([*cli, "compare", run_dir, "--systems", "none,full,regression,truncate"],
                         capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "compare:teacher_forced" in res.stderr and "compare:agreement" in res.stderr  # progress bars
    assert "| regression | trained |" in res.stdout and "| truncate | method |" in res.stdout
    assert res.stdout.strip().endswith("compare/comparison.md")
    status = subprocess.run([*cli, "status", run_dir], capture_output=True, text=True, env=env)
    assert "comparison: " in status.stdout and "5 systems" in status.stdout  # + the run's own state, unnamed


def test_bad_inputs_are_one_line_errors(tiny_run, tmp_path):
    with pytest.raises(comparison.CompareInputError, match="strictly between 0 and 1"):
        comparison.parse_rhos("0.05,1.5")
    with pytest.raises(comparison.CompareInputError, match="not a number"):
        comparison.parse_rhos("0.05,abc")
    assert comparison.parse_rhos("0.02, 0.05,0.10") == [0.02, 0.05, 0.1]
    with pytest.raises(comparison.CompareInputError, match="unknown system 'nope'; the systems are none, full"):
        comparison.plan_jobs(tiny_run, ["none", "nope"])
    with pytest.raises(comparison.CompareInputError, match="not a run directory"):
        comparison.open_for_compare(str(tmp_path))
    fresh = orchestration.prepare_run(tiny_run.info.source_uri, tiny_run.config, str(tmp_path / "fresh"))
    with pytest.raises(comparison.CompareInputError, match="no completed targets stage.*nectar run"):
        comparison.open_for_compare(fresh.run.root)
    with pytest.raises(comparison.CompareInputError, match="--rho 1e-06"):
        comparison.plan_jobs(tiny_run, ["regression"], [1e-6])
    jobs = comparison.plan_jobs(tiny_run, ["none", "full"], [0.1, 0.2])
    # references once, at no ρ; the run's own state (run:refined) joins unnamed, at the run's budget
    assert [(j.key, j.rho) for j in jobs if not j.key.startswith("run:")] == [("none", None), ("full", None)]


@pytest.mark.slow
def test_compare_scores_kvpress_presses_on_the_same_pairs(tiny_run, kvpress_env):
    res = comparison.compare(tiny_run, ["none", "full", "truncate", "kvpress:kvzip", "kvpress:streaming_llm"],
                             rhos=[0.3])
    by = {(r.system, r.rho, r.split): r for r in res.rows}
    rho = tiny_run.config.train.module.rho
    for split in ("test", "challenge", "probes"):
        none, full = by[("none", None, split)], by[("full", None, split)]
        for press in ("kvpress:kvzip", "kvpress:streaming_llm"):
            for b in (rho, 0.3):
                r = by[(press, b, split)]
                assert r.kind == "kvpress" and r.n_tokens == none.n_tokens and r.n_pairs == none.n_pairs
                assert r.kl_ci_low <= r.kl_to_full <= r.kl_ci_high and r.kl_to_full > 0
                assert r.recovered_kl_ci_low <= r.recovered_kl <= r.recovered_kl_ci_high
                # the bytes of ρ of the document KV (kvpress keeps whole (layer, head, token) entries)
                assert abs(r.state_bytes / full.state_bytes - b) < 0.02
                assert r.state_seconds == r.train_seconds > 0 and "entries at fp32" in r.source
        assert full.state_seconds > 0 and none.state_seconds == 0
    md = open(tiny_run.run.local_path("compare", "comparison.md")).read()
    assert "| kvpress:kvzip | kvpress | 0.3 |" in md and "state s" in md
    info = json.load(open(tiny_run.run.local_path("compare", "info.json")))
    assert 0 <= info["kvpress"]["guard_max_token_kl"] <= 1e-3 and "kvpress:kvzip" in info["systems"]
    # truncate against the better press at each budget, paired on the same pairs: the gap of the two rows
    diffs = {(d["split"], d["system"]): d for d in info["differences"]}
    assert {k[1] for k in diffs} - {f"run:refined@{rho:g}"} == {f"truncate@{rho:g}", "truncate@0.3"}
    for (split, key), d in diffs.items():
        b = float(key.split("@")[1])
        ref = max((by[(p, b, split)] for p in ("kvpress:kvzip", "kvpress:streaming_llm")), key=lambda r: r.recovered_kl)
        assert d["reference"] == f"{ref.system}@{b:g}" and d["low"] <= d["delta_recovered_kl"] <= d["high"]
        system = key.split("@")[0]  # truncate, or the run's own state
        assert d["delta_recovered_kl"] == pytest.approx(by[(system, b, split)].recovered_kl - ref.recovered_kl)
    assert "## Paired differences" in md


def test_compare_goes_on_without_kvpress_rows_when_its_env_fails_fake_failure(tiny_run, monkeypatch, capsys):
    from nectar.kvpress import KvpressEnvError, bridge

    def broken(**_):
        raise KvpressEnvError("kvpress venv: pip install torch==2.13.0 failed (no network); fix: …")

    monkeypatch.setattr(bridge, "ensure_env", broken)
    res = comparison.compare(tiny_run, ["none", "full", "kvpress:knorm"])
    # no kvpress rows; the run's own states join unnamed when the shared run has them (test order decides)
    assert {r.system for r in res.rows} - {"run:first", "run:refined"} == {"none", "full"}
    assert "kvpress rows left out: kvpress venv: pip install torch==2.13.0 failed" in capsys.readouterr().out
    info = json.load(open(tiny_run.run.local_path("compare", "info.json")))
    assert "no network" in info["kvpress"]["error"]


@pytest.mark.slow
def test_compare_at_equal_bytes_with_quantized_baselines(tiny_run):
    """``--bytes``: budgets as fractions of the KV's bytes at its dtype; each system stores as many
    entries as its precision buys and reports the bytes as stored, within the budget."""
    ctx = tiny_run
    fractions = [0.1, 0.2]
    rhos = comparison.parse_bytes("0.1,0.2", ctx.config.model.dtype)
    assert ctx.config.model.dtype == "float32" and rhos == fractions  # float32 KV: ρ is the byte share
    systems = ["none", "full", "evict", "evict@int8", "evict@int4", "attention_matching@int4", "truncate@int4"]
    res = comparison.compare(ctx, systems, rhos=rhos, run_one=lambda c, stage, force: None)
    by = {(r.system, r.rho, r.split): r for r in res.rows}
    kv = by[("full", None, "test")].state_bytes
    for rho in rhos:
        for s in systems[2:]:
            r = by[(s, rho, "test")]
            assert 0.5 * rho * kv < r.state_bytes <= rho * kv, (s, rho, r.state_bytes)
            assert r.recovered_kl_ci_low <= r.recovered_kl <= r.recovered_kl_ci_high
    assert "**kv_dtype** float32" in res.markdown and "| evict@int4 | method |" in res.markdown
    assert " %) |" in res.markdown  # the bytes column: × smaller and share of the KV


def test_bytes_budgets_are_fractions_of_the_kv_at_its_dtype():
    assert comparison.parse_bytes("0.01,0.05", "float32") == [0.01, 0.05]
    assert comparison.parse_bytes("0.05", "bfloat16") == [0.025]  # a bf16 KV is half the float32 bytes
    with pytest.raises(comparison.CompareInputError, match="--bytes 2: a budget is the state's share"):
        comparison.parse_bytes("2", "float32")


@pytest.mark.slow
@pytest.mark.timeout(1800)  # two reconstruction passes and fits on top of the fixture's run
def test_compare_recon_rows_carry_the_budget_and_a_layer_head_heat_map(tiny_run):
    ctx = tiny_run
    res = comparison.compare(ctx, ["none", "full", "evict", "recon_select", "recon_fit"])
    by = {(r.system, r.split): r for r in res.rows}
    plan = baseline_plan(ctx, ctx.config.train.module.rho)
    one_pair_per_head = plan.num_layers * plan.num_kv_heads * (2 * plan.head_dim + 1) * 4
    for split in ("test", "probes"):
        for s in ("recon_select", "recon_fit"):
            r = by[(s, split)]
            assert r.kind == "method" and r.kl_ci_low - 1e-9 <= r.kl_to_full <= r.kl_ci_high + 1e-9
            # the same budget as per-head eviction (masked slots count nothing), up to its per-head rounding
            assert abs(r.state_bytes - by[("evict", split)].state_bytes) <= one_pair_per_head
            assert r.train_seconds > 0  # time to the state: reconstruction + selection (+ fit)
    assert "allocation.png" in res.files
    assert open(ctx.run.local_path("compare", "allocation.png"), "rb").read()[:4] == b"\x89PNG"
    assert "Kept pairs per layer" in open(ctx.run.local_path("compare", "comparison.md")).read()
