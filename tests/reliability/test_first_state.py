"""Issue 39: a usable state from the document alone before self-study (the first stage), replaced by
the refined state only when that is better on the held-out pairs (the promote stage), atomically.
Real tiny runs through the orchestration core, real modules, real ``nectar ask``."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from matrix_helpers import DOCUMENT, run_pipeline, tiny_config
from nectar import orchestration
from nectar.orchestration import live
from nectar.orchestration.executor import RunDir
from nectar.serving.ask import ask
from nectar.serving.loader import load_served_module


class _HeldAtSynthesize(Exception):
    """Raised by the test's runner instead of starting the LLM stage."""


def test_the_first_state_answers_before_synthesize_starts(tmp_path):
    run_dir = str(tmp_path / "run")
    seen = {}

    def hold_llm_stage(ctx, stage, force):
        if stage == "synthesize":  # the self-study stage has not started: ask the run now
            served = load_served_module(run_dir)
            seen["stage"] = live.read_live(RunDir(run_dir)).stage
            seen["bytes"] = served.spec.module_bytes
            seen["answer"] = ask(run_dir, "What is a name bound to?", max_new_tokens=4, temperature=0.0)
            raise _HeldAtSynthesize()
        return orchestration.run_here(ctx, stage, force)

    with pytest.raises(_HeldAtSynthesize):
        orchestration.run_document(DOCUMENT, tiny_config(), run_dir, run_one=hold_llm_stage)
    run = RunDir(run_dir)
    assert seen["stage"] == "first" and len(seen["answer"].token_ids) > 0 and seen["bytes"] > 0
    first = run.read_manifest("first")
    assert first.counts["live"] == "first" and first.counts["kept_keys"] > 0
    assert run.read_manifest("synthesize") is None  # nothing of self-study ran
    # re-running the document-only stages is a cache hit that leaves the live state as it was
    pointer = Path(run_dir, *live.LIVE).read_text()
    again = run_pipeline(run_dir, stages=("chunk", "first"))
    assert again.error is None and again.statuses == {"chunk": "cached", "first": "cached"}
    assert Path(run_dir, *live.LIVE).read_text() == pointer


def test_where_keys_are_scarce_the_fit_is_live_before_the_steps_and_the_refined_state_after(tmp_path):
    """At ~1 % of the entries kept, the first stage publishes its fit (the first answer does not wait for the
    minutes of end-to-end steps), then the refined state — two content folders, the pointer on the second,
    which is the stage's module; a re-run is a cache hit that keeps it."""
    run_dir = str(tmp_path / "run")
    # the kept keys unfitted (β = 0, their own values): on the tiny model the fit is exact to ~1e-10 of span KL,
    # so whether two steps lower it would be rounding noise (which differs by CPU); unfitted, the steps have work
    sets = ("train.module.arch=quadrature", "train.module.rho=0.01", "first.refine.steps=2", "first.refine.batch_tokens=512",
            "first.select.fit=false", "first.select.key_choice=top", "first.select.fit_by=least_squares")
    out = run_pipeline(run_dir, *sets, stages=("chunk", "first"))
    assert out.error is None and out.statuses == {"chunk": "done", "first": "done"}
    ready = [i for i, line in enumerate(out.notices) if line.startswith("first usable state ready")]
    refined = [i for i, line in enumerate(out.notices) if line.startswith("first state refined end to end")]
    assert len(ready) == 1 and len(refined) == 1 and ready[0] < refined[0]
    run = RunDir(run_dir)
    counts = run.read_manifest("first").counts
    assert counts["refined"] is True and counts["refine_s"] > 0 and counts["live"] == "first"
    assert 0 < counts["usable_s"] < run.read_manifest("first").duration_s  # live before the steps ended
    summary = live.state_summary(run)
    assert any(line.startswith("first usable state:") and "refined end to end on the reconstruction at" in line
               for line in summary), summary
    folders = sorted(p.name for p in Path(run_dir, "state").iterdir() if p.is_dir())
    assert len(folders) == 2  # the fit, then the refined state (each named by its weights)
    state = live.read_live(run)
    assert "refined end to end" in state.reason
    assert Path(state.url, "module.safetensors").read_bytes() == Path(run_dir, "first", "module.safetensors").read_bytes()
    pointer = Path(run_dir, *live.LIVE).read_text()
    again = run_pipeline(run_dir, *sets, stages=("chunk", "first"))
    assert again.statuses == {"chunk": "cached", "first": "cached"} and Path(run_dir, *live.LIVE).read_text() == pointer


def test_a_complete_run_says_which_state_is_live_and_why(complete_run):
    run = RunDir(complete_run)
    promote = run.read_manifest("promote")
    state = live.read_live(run)
    assert state.stage == promote.counts["live"] and state.reason == promote.counts["reason"]
    assert promote.counts["held_out_pairs"] > 0
    lo, hi = promote.counts["delta_low"], promote.counts["delta_high"]
    assert (state.stage == "train") == (lo > 0)  # the refined state is live only when its interval is above 0
    assert load_served_module(complete_run).module is not None
    # the live copy is the stage's module byte for byte, in a folder named by its digest
    copy = Path(state.url, "module.safetensors").read_bytes()
    assert copy == Path(complete_run, state.stage, "module.safetensors").read_bytes()


def _states(run_dir: str):
    """The run's base model, document KV, first state and a copy of it degraded by failure injection
    (values zeroed and keys negated: a state that keeps nothing of the text)."""
    import copy

    from nectar.modules.io import load_module
    from nectar.orchestration.context import load_base

    ctx = orchestration.open_run(run_dir)
    base = load_base(ctx.config)
    first, _ = load_module(str(Path(run_dir, "first")), base, ctx.info.sha256)
    bad = copy.deepcopy(first)
    with torch.no_grad():
        for layer in bad.layers:
            layer.Z.zero_()
            layer.W.mul_(-1.0)
    return ctx, base, orchestration.load_run_doc_kv(ctx), first, bad


def test_the_refined_state_goes_live_only_when_better(complete_run):
    from nectar.stages.promote import decide

    ctx, base, doc_kv, first, bad = _states(complete_run)
    targets = str(Path(complete_run, "targets"))
    cfg, level = ctx.config.evaluate, ctx.config.first.confidence
    better = decide(base, doc_kv, bad, first, targets, cfg, level)  # the refined one keeps the text
    assert better.live == "train" and better.counts["delta_low"] > 0 and "better" in better.reason
    worse = decide(base, doc_kv, first, bad, targets, cfg, level)
    assert worse.live == "first" and worse.counts["delta_high"] < 0 and "worse" in worse.reason
    tie = decide(base, doc_kv, first, first, targets, cfg, level)
    assert tie.live == "first" and tie.counts["delta"] == 0 and "stays live" in tie.reason


def test_a_swap_that_dies_midway_leaves_the_old_state_live(run_copy, monkeypatch):
    run = RunDir(run_copy)
    before = Path(run_copy, *live.LIVE).read_text()
    other = "first" if json.loads(before)["stage"] == "train" else "train"
    for folder in Path(run_copy, "state").iterdir():  # the other state never published: no copy of it yet
        if folder.is_dir() and folder.name != Path(json.loads(before)["dir"]).name:
            shutil.rmtree(folder)
    real_write = live.atomic_write

    def dies_on_the_spec(url, data):  # failure injection: the disk fills after the weights are copied
        if url.endswith("module.json") and "/state/" in url:
            raise OSError("injected: disk full while copying the state")
        return real_write(url, data)

    monkeypatch.setattr(live, "atomic_write", dies_on_the_spec)
    with pytest.raises(OSError, match="injected"):
        live.publish(run, other, "test swap")
    assert Path(run_copy, *live.LIVE).read_text() == before  # the pointer still names the complete old state
    assert load_served_module(run_copy).module is not None
    monkeypatch.setattr(live, "atomic_write", real_write)
    # the next publish completes the half-copied folder and only then moves the pointer
    state = live.publish(run, other, "test swap")
    assert live.read_live(run).stage == other and live.read_live(run).url == state.url
    assert Path(state.url, "module.safetensors").read_bytes() == Path(run_copy, other, "module.safetensors").read_bytes()
    assert load_served_module(run_copy).module is not None


def test_promote_reruns_are_cache_hits_that_keep_the_pointer(run_copy):
    from nectar.orchestration.runners import run_promote

    pointer = Path(run_copy, *live.LIVE).read_text()
    assert run_promote(orchestration.open_run(run_copy)).status == "cached"
    assert Path(run_copy, *live.LIVE).read_text() == pointer


def test_a_running_server_follows_the_swap(run_copy, monkeypatch):
    from nectar.serving import registry as reg
    from nectar.serving.loader import open_served_run

    monkeypatch.setattr(reg, "LIVE_CHECK_S", 0.0)  # re-read the pointer on every request
    served = reg.open_registry([open_served_run(run_copy)], None, 1 << 30)
    name = served.names[0]
    before = served.documents[name].module_url
    served.provider(name)
    other = "first" if live.read_live(RunDir(run_copy)).stage == "train" else "train"
    state = live.publish(RunDir(run_copy), other, "test swap")
    served.provider(name)
    assert served.documents[name].module_url == state.url != before and served.loads == 2


def test_compare_scores_the_runs_own_states_unnamed_and_writes_where_asked(run_copy, tmp_path):
    from nectar.comparison import compare, open_for_compare

    out = tmp_path / "elsewhere"
    result = compare(open_for_compare(run_copy), ["none", "full"], out=str(out))
    by_system = {r.system: r for r in result.rows if r.split == "probes"}
    assert {"run:first", "run:refined"} <= set(by_system)
    first, refined = by_system["run:first"], by_system["run:refined"]
    assert first.kind == refined.kind == "run" and first.rho == refined.rho
    assert first.state_bytes == json.loads(Path(run_copy, "first", "module.json").read_text())["module_bytes"]
    assert 0 < first.state_seconds < refined.state_seconds  # the refined one waits for self-study
    assert (out / "comparison.md").exists() and (out / "comparison.parquet").exists()
    assert not Path(run_copy, "compare").exists()  # nothing written into RUN/compare
