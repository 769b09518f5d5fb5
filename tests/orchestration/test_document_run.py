"""The orchestration core: one document through the stages (plan → lock → each stage → manifests),
with the stage runner it is given (the Prefect flows give a subflow; here the real runner in this
process, and a recording one to see the order and the lock)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "reliability"))
from matrix_helpers import tiny_config  # noqa: E402

from nectar.orchestration import RunLocked, plan_document, run_document, run_here  # noqa: E402
from nectar.orchestration.executor import RunDir  # noqa: E402
from nectar.orchestration.lock import read_holder  # noqa: E402
from nectar.schemas.config import STAGES  # noqa: E402
from nectar.schemas.presets import ConfigError  # noqa: E402


def test_every_stage_in_order_under_the_lock_with_run_json_written_first(tmp_path):
    run_dir = str(tmp_path / "run")
    seen = []

    def record(ctx, stage, force):
        holder = read_holder(run_dir)
        seen.append((stage, force, holder.pid if holder else None, RunDir(run_dir).exists("run.json")))
        return stage.upper()

    done = run_document("pydoc:naming", tiny_config(), run_dir, from_stage="targets", run_one=record)
    assert [s for s, *_ in seen] == list(STAGES)
    forced = [STAGES.index("targets") <= i for i in range(len(STAGES))]
    assert [f for _, f, *_ in seen] == forced  # --from forces it and after
    assert all(pid == os.getpid() and wrote for *_, pid, wrote in seen)
    assert done.results == {s: s.upper() for s in STAGES} and done.ctx.run.root == run_dir
    assert read_holder(run_dir) is None  # released


def test_a_bad_request_fails_before_anything_is_written(tmp_path):
    run_dir = tmp_path / "run"
    with pytest.raises(ConfigError, match="use either --from or --only"):
        run_document("pydoc:naming", tiny_config(), str(run_dir), from_stage="chunk", only_stage="train",
                     run_one=lambda *a: pytest.fail("no stage may run"))
    assert not run_dir.exists()
    request = plan_document("pydoc:naming", tiny_config(), str(run_dir), only_stage="chunk")
    assert request.plan == [("chunk", True)] and not run_dir.exists()


def test_a_failing_stage_releases_the_lock_and_keeps_what_ran(tmp_path):
    run_dir = str(tmp_path / "run")
    ran = []

    def chunk_then_fail(ctx, stage, force):  # failure injection after the real chunk stage
        if stage != "chunk":
            raise RuntimeError(f"injected failure in {stage}")
        ran.append(run_here(ctx, stage, force).status)

    with pytest.raises(RuntimeError, match="injected failure in first"):
        run_document("pydoc:naming", tiny_config(), run_dir, run_one=chunk_then_fail)
    assert ran == ["done"] and RunDir(run_dir).read_manifest("chunk") is not None
    assert read_holder(run_dir) is None
    # the real runner: chunk is a cache hit now, and --only reopens the run with its own config
    again = run_document(None, tiny_config(), run_dir, only_stage="chunk", stages=("chunk",))
    assert again.results["chunk"].status == "done"  # --only forces it
    assert run_document("pydoc:naming", tiny_config(), run_dir, stages=("chunk",)).results["chunk"].status == "cached"


def test_a_busy_run_directory_is_refused_at_once_without_waiting(tmp_path):
    run_dir = str(tmp_path / "run")
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time\nfrom nectar.orchestration import run_lock\n"
        f"with run_lock({run_dir!r}):\n    print('held', flush=True); time.sleep(60)")],
        stdout=subprocess.PIPE, text=True, env={**os.environ})
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunLocked):
            run_document("pydoc:naming", tiny_config(), run_dir, wait=False,
                         run_one=lambda *a: pytest.fail("no stage may run"))
    finally:
        holder.kill()
        holder.wait()
