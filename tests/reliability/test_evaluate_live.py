"""Issue 39: the evaluate stage scores the state the run serves — the one promote put live (or the
pointer moved to since), not always the train stage's module — and its cache follows that state.
Real tiny runs through the orchestration core; the tiny run's promote keeps the first state live
(its refined state is worse on the held-out pairs), so scoring train's module there is the bug."""
from __future__ import annotations

import hashlib
import math
import os
import shutil
from pathlib import Path

import pytest
from matrix_helpers import run_pipeline, tiny_config
from nectar.orchestration import StageInputError, check_inputs_done, live
from nectar.orchestration.executor import RunDir
from nectar.schemas.artifacts import MetricsRow
from nectar.schemas.config import STAGES
from nectar.tables import read_table


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _module_kl(run_dir: str) -> dict[str, float]:
    """The scored state's KL to the full-context model, per split (evaluate's metrics.parquet)."""
    rows = read_table(f"{run_dir}/evaluate/metrics.parquet", MetricsRow)
    return {r.split: r.kl_to_full for r in rows if r.model == "module"}


def _same(a: dict[str, float], b: dict[str, float]) -> bool:
    """Equal to 1e-6 relative: the same state scored twice (tests/reliability/test_signals.py's bound);
    two different states' KL differ by far more (here ~50 %)."""
    return a.keys() == b.keys() and all(math.isclose(a[k], b[k], rel_tol=1e-6, abs_tol=1e-15) for k in a)


def test_evaluate_scores_the_state_promote_kept_live(complete_run):
    from nectar.comparison.sweep import comparison_row
    from nectar.comparison.variants import Variant

    run = RunDir(complete_run)
    promote, evaluate = run.read_manifest("promote"), run.read_manifest("evaluate")
    state = live.read_live(run)
    assert promote.counts["live"] == state.stage == "first", promote.counts["reason"]  # the case this file is about
    served = _sha256(Path(state.url, "module.safetensors"))
    assert served == _sha256(Path(complete_run, "first", "module.safetensors"))
    assert evaluate.counts["scored_state"] == "first"
    assert evaluate.counts["scored_module_sha256"] == served != _sha256(Path(complete_run, "train", "module.safetensors"))
    # the decision and the scored weights are in evaluate's cache key
    assert evaluate.inputs["promote/decision.json"] == promote.outputs["decision.json"]
    assert evaluate.inputs["live/first"] == served
    # and every place that reports the evaluation says which state it is of
    assert "<b>state</b> first (live: " in Path(complete_run, "evaluate", "report.html").read_text()
    assert live.state_summary(run)[-1].startswith("evaluated: the first state (")
    assert comparison_row(Variant("base", {}, tiny_config()), run)["scored_state"] == "first"


def test_a_changed_promote_decision_redoes_evaluate_on_the_new_live_state(run_copy, complete_run):
    # first.enabled=false: promote has only the refined state to publish, so the live decision flips to train
    out = run_pipeline(run_copy, "first.enabled=false")
    assert out.error is None, out.user_line
    assert {s: out.statuses[s] for s in ("train", "promote", "evaluate")} == \
        {"train": "cached", "promote": "done", "evaluate": "done"}  # evaluate's own inputs are unchanged but promote's
    run = RunDir(run_copy)
    state, evaluate = live.read_live(run), run.read_manifest("evaluate")
    assert state.stage == evaluate.counts["scored_state"] == "train"
    assert evaluate.counts["scored_module_sha256"] == _sha256(Path(run_copy, "train", "module.safetensors"))
    assert not _same(_module_kl(run_copy), _module_kl(complete_run))  # another state scored, not a relabel
    again = run_pipeline(run_copy, "first.enabled=false")  # nothing changed: every stage a cache hit
    assert again.error is None and again.statuses == {s: "cached" for s in STAGES}


def test_a_moved_pointer_redoes_evaluate_and_moving_it_back_restores_its_metrics(run_copy, complete_run):
    run = RunDir(run_copy)
    # the pointer moves without promote's decision changing (as a re-run of `first` while it is live does)
    live.publish(run, "train", "test swap")
    assert "not the live train state; re-score it: " in live.state_summary(run)[-1]  # nectar status warns
    out = run_pipeline(run_copy)
    assert out.error is None and out.statuses == {**{s: "cached" for s in STAGES[:-1]}, "evaluate": "done"}
    assert run.read_manifest("evaluate").counts["scored_state"] == "train"
    assert not _same(_module_kl(run_copy), _module_kl(complete_run))
    assert live.state_summary(run)[-1].startswith("evaluated: the train state (")
    live.publish(run, "first", "test swap back")  # its content-named copy is still there: only the pointer moves
    back = run_pipeline(run_copy)
    assert back.statuses["evaluate"] == "done" and _same(_module_kl(run_copy), _module_kl(complete_run))
    assert run_pipeline(run_copy).statuses["evaluate"] == "cached"


def test_evaluate_without_promote_scores_what_the_run_serves(run_copy):
    run = RunDir(run_copy)
    shutil.rmtree(Path(run_copy, "promote"))  # promote never ran: --only evaluate does without it
    check_inputs_done(run, "evaluate", "pydoc:naming")
    out = run_pipeline(run_copy, only="evaluate")
    assert out.error is None, out.user_line
    evaluate = run.read_manifest("evaluate")
    assert evaluate.counts["scored_state"] == "first"  # the pointer the first stage set
    assert not any(name.startswith("promote/") for name in evaluate.inputs)
    shutil.rmtree(Path(run_copy, "state"))  # no pointer at all (a run made before it): train's module answers
    assert run_pipeline(run_copy, only="evaluate").error is None
    evaluate = run.read_manifest("evaluate")
    assert evaluate.counts["scored_state"] == "train"
    assert evaluate.counts["scored_module_sha256"] == run.read_manifest("train").outputs["module.safetensors"]
    os.remove(Path(run_copy, "train", "manifest.json"))  # train stays required
    with pytest.raises(StageInputError, match="--only evaluate needs the outputs of train"):
        check_inputs_done(run, "evaluate", "pydoc:naming")
