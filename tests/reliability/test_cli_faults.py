"""Slow matrix rows: through the real ``nectar`` command with Prefect, two runs on one run directory
at once and a zeroed shard seen by ``status`` and repaired by ``run``; a truncated table re-run end to
end; a change to the capture code (a copy of the package) that redoes targets and what follows."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from matrix_helpers import DOCUMENT, outputs, run_pipeline

from nectar.orchestration.executor import RunDir, last_invocation
from nectar.schemas.artifacts import DatasetRow
from nectar.schemas.config import STAGES
from nectar.tables import read_table

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]
NECTAR = [sys.executable, "-m", "nectar.pipeline.cli"]


def _env(tmp_path: Path, pythonpath: Path = REPO) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_HOME=str(tmp_path / "prefect"), PYTHONPATH=str(pythonpath), OMP_NUM_THREADS="1")
    return env


def test_two_runs_on_one_run_directory_exactly_one_writes(run_copy, tmp_path):
    """The second `nectar run` finds the first holding the run directory and, with --no-wait, exits 3
    naming it at once (waiting instead is tested in tests/orchestration/test_lock.py)."""
    shutil.rmtree(Path(run_copy) / "evaluate")  # the first run has one stage to do
    args = [*NECTAR, "run", DOCUMENT, "--preset", "tiny", "--run-dir", run_copy]
    first = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(tmp_path))
    lock = Path(run_copy) / "run.lock"
    deadline = time.monotonic() + 300
    while not lock.exists() and time.monotonic() < deadline and first.poll() is None:
        time.sleep(0.2)
    assert lock.exists(), first.communicate()[1][-3000:]
    second = subprocess.run([*args, "--no-wait"], capture_output=True, text=True, env=_env(tmp_path), timeout=600)
    out1, err1 = first.communicate(timeout=600)
    assert first.returncode == 0, err1[-3000:]
    assert second.returncode == 3 and second.stdout == ""
    (line,) = [x for x in second.stderr.splitlines() if x.strip()]
    assert line.startswith(f"error: {run_copy} is being written by pid {first.pid} on ")
    assert re.search(r"evaluate\W+done", out1)  # the first ran the stage; the second ran nothing
    assert last_invocation(RunDir(run_copy), "evaluate")["status"] == "done"
    assert not lock.exists()  # released


def test_truncated_dataset_then_a_plain_rerun_redoes_verify(run_copy, complete_run):
    path = Path(run_copy) / "verify" / "dataset.parquet"
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)
    out = run_pipeline(run_copy)
    assert out.error is None, out.user_line
    assert out.notices and out.notices[0].startswith("verify: verify/dataset.parquet changed size (")
    assert out.notices[0].endswith("since the stage completed; redoing verify")
    assert out.statuses["verify"] == "done" and out.statuses["chunk"] == out.statuses["synthesize"] == "cached"
    # every pair verified again (the completed stage kept no partial replies): the same pairs, whatever
    # the backend answered this time; what follows is redone exactly when the dataset differs
    ref = read_table(f"{complete_run}/verify/dataset.parquet", DatasetRow)
    got = read_table(f"{run_copy}/verify/dataset.parquet", DatasetRow)
    assert [r.pair_id for r in got] == [r.pair_id for r in ref]
    same = outputs(run_copy)["verify"] == outputs(complete_run)["verify"]
    assert out.statuses["targets"] == ("cached" if same else "done")


def test_zeroed_shard_through_the_cli_status_then_run(run_copy, tmp_path):
    from test_faults import SHARD, zero_keeping_mtime

    zero_keeping_mtime(Path(run_copy) / "targets" / SHARD)
    status = subprocess.run([*NECTAR, "status", run_copy], capture_output=True, text=True, env=_env(tmp_path))
    assert status.returncode == 0 and "stale" in status.stdout and SHARD.split("/")[0] in status.stdout
    proc = subprocess.run([*NECTAR, "run", DOCUMENT, "--preset", "tiny", "--run-dir", run_copy],
                          capture_output=True, text=True, env=_env(tmp_path), timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"targets: targets/{SHARD} changed (sha256 differs) since the stage completed; redoing targets" \
        in proc.stderr
    assert last_invocation(RunDir(run_copy), "targets")["status"] == "done"


def test_capture_code_change_redoes_targets_and_what_follows(run_copy, tmp_path):
    """A copy of the package whose capture scales the recorded scores: targets, train and evaluate are
    redone (new code, then new inputs); chunk, synthesize and verify stay cached."""
    shutil.copytree(REPO / "nectar", tmp_path / "code" / "nectar", ignore=shutil.ignore_patterns("__pycache__"))
    capture = tmp_path / "code" / "nectar" / "targets" / "capture.py"
    capture.write_text(capture.read_text() + "\n\n_original_capture_packed = capture_packed\n\n\n"
                       "def capture_packed(*args, **kwargs):\n"
                       "    cap = _original_capture_packed(*args, **kwargs)\n"
                       "    cap.alpha.mul_(1.5)\n"
                       "    return cap\n")
    script = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
              "from matrix_helpers import run_pipeline; "
              f"out = run_pipeline({run_copy!r}); print(out.statuses); sys.exit(0 if out.error is None else 1)")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path,
                          env=_env(tmp_path, tmp_path / "code"), timeout=900)  # cwd: not this checkout's nectar
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = RunDir(run_copy)
    states = {s: last_invocation(run, s)["status"] for s in STAGES}
    # the first state is a capture too (reconstruction targets): it is redone, and so is the promotion
    assert states == {"chunk": "cached", "first": "done", "synthesize": "cached", "verify": "cached",
                      "targets": "done", "train": "done", "promote": "done", "evaluate": "done"}, states
