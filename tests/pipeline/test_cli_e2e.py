"""The whole DAG through the real CLI and Prefect (ephemeral mode) on the tiny preset."""
import os
import signal
import subprocess
import sys
import time

import pytest

from nectar.orchestration.executor import RunDir, stage_status
from nectar.schemas.config import STAGES

pytestmark = pytest.mark.slow

NECTAR = [sys.executable, "-m", "nectar.pipeline.cli"]


def _env(tmp_path):
    env = dict(os.environ)
    env["PREFECT_HOME"] = str(tmp_path / "prefect")  # an isolated ephemeral Prefect database
    env.pop("PREFECT_API_URL", None)
    return env


def _run(args, tmp_path, timeout=900):
    return subprocess.run([*NECTAR, *args], capture_output=True, text=True, env=_env(tmp_path), timeout=timeout)


def test_run_cache_only_and_status(tmp_path):
    run_dir = str(tmp_path / "run")
    first = _run(["run", "pydoc:naming", "--preset", "tiny", "--run-dir", run_dir], tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    run = RunDir(run_dir)
    assert [stage_status(run, s)["state"] for s in STAGES] == ["done"] * len(STAGES)
    assert run.exists("evaluate", "report.html")

    second = _run(["run", "pydoc:naming", "--preset", "tiny", "--run-dir", run_dir], tmp_path)
    assert second.returncode == 0, second.stderr[-3000:]
    assert [stage_status(run, s)["state"] for s in STAGES] == ["cached"] * len(STAGES)
    # every stage a cache hit is the behaviour; how long the cached pass takes is load's business
    # (it took 151 s under a load average of 24), so no wall-clock bound here

    only = _run(["run", "pydoc:naming", "--preset", "tiny", "--run-dir", run_dir, "--only", "verify"], tmp_path)
    assert only.returncode == 0, only.stderr[-3000:]
    assert stage_status(run, "verify")["state"] == "done"
    assert stage_status(run, "chunk")["state"] == "cached"  # untouched since the cached pass

    status = _run(["status", run_dir], tmp_path)
    assert status.returncode == 0 and "verify" in status.stdout and "done" in status.stdout


def test_kill_during_synthesize_then_rerun_completes(tmp_path):
    run_dir = tmp_path / "run"
    args = [*NECTAR, "run", "pydoc:naming", "--preset", "tiny", "--run-dir", str(run_dir),
            "--set", "synthesize.max_chunks=6", "--set", "train.samples=200"]
    proc = subprocess.Popen(args, env=_env(tmp_path), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    partial = run_dir / "synthesize" / "partial"
    deadline = time.time() + 600
    while time.time() < deadline and not (partial.exists() and any(partial.iterdir())):
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)  # killed mid-stage, no chance to clean up
    proc.wait()
    run = RunDir(str(run_dir))
    assert run.read_manifest("synthesize") is None  # nothing looks complete
    done_before = len(list(partial.iterdir()))
    assert done_before >= 1
    again = subprocess.run(args, env=_env(tmp_path), capture_output=True, text=True, timeout=900)
    assert again.returncode == 0, again.stderr[-3000:]
    manifest = run.read_manifest("synthesize")
    assert manifest is not None and manifest.counts["requests"] >= 6
    from nectar.schemas import PairRow
    from nectar.tables import read_table

    rows = read_table(run.url("synthesize", "pairs.parquet"), PairRow)
    assert len({r.pair_id for r in rows}) == len(rows)  # resumed, not duplicated


def test_bad_inputs_fail_with_clear_messages(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("   \n")
    out = _run(["run", str(empty), "--preset", "tiny"], tmp_path)
    assert out.returncode == 2 and "empty" in out.stderr
    binary = tmp_path / "blob.bin"
    binary.write_bytes(b"\x89PNG\x00\x01\x02" * 10)
    out = _run(["run", str(binary), "--preset", "tiny"], tmp_path)
    assert out.returncode == 2 and "binary" in out.stderr
    out = _run(["run", "pydoc:naming", "--preset", "nope"], tmp_path)
    assert out.returncode == 2 and "unknown preset" in out.stderr
    out = _run(["run", "pydoc:naming", "--preset", "tiny", "--set", "train.bogus=1"], tmp_path)
    assert out.returncode == 2 and "train.bogus: unknown key" in out.stderr


def test_document_longer_than_the_window_is_refused_before_any_stage(tmp_path):
    long_doc = tmp_path / "long.txt"
    long_doc.write_text("The keeper wrote in the ledger. " * 1200)  # ~8k tokens > tiny's 4096 window
    run_dir = tmp_path / "run"
    out = _run(["run", str(long_doc), "--preset", "tiny", "--run-dir", str(run_dir)], tmp_path)
    assert out.returncode == 2
    assert "over the model's window of 4096 tokens" in out.stderr and "yarn_factor" in out.stderr
    assert not (run_dir / "chunk").exists()


def test_document_past_the_window_runs_every_stage_with_rope_scaling(tmp_path):
    """A real text longer than the tiny model's 4,096-token window (CPython's sequence-types
    reference, ~5.7k tokens) through every stage with model.yarn_factor=2: full-context
    verification through the local backend, capture, training, module and full-context evaluation.
    With online targets (q, α, A recomputed from the document KV in training and evaluation)."""
    run_dir = tmp_path / "run"
    out = _run(["run", "pydoc:typesseq", "--preset", "tiny", "--run-dir", str(run_dir),
                "--set", "model.yarn_factor=2", "--set", "train.samples=200", "--set", "targets.mode=online"],
               tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    run = RunDir(str(run_dir))
    assert [stage_status(run, s)["state"] for s in STAGES] == ["done"] * len(STAGES)
    from nectar.schemas.artifacts import DocumentInfo
    from nectar.tables import read_json_artifact

    info = read_json_artifact(run.url("document", "info.json"), DocumentInfo)
    assert 4096 < info.n_context_tokens < 8192
    assert run.read_manifest("verify").counts["answer_requests"] > 0
    targets = run.read_manifest("targets").counts
    assert targets["tokens"] > 0 and targets["bytes_written"] <= targets["estimated_bytes"]
