"""A pipeline flow run cancelled from the Prefect CLI while a REAL process worker runs it: the run
shows Cancelled, its flow-run process exits, the run-directory lock is released, the stage it was in
is not complete, and the next run of the same run directory resumes (earlier stages cached)."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from nectar.orchestration.executor import RunDir, last_invocation
from nectar.pipeline import deploy as dep
from nectar.pipeline import operations

from prefect_procs import running_worker

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
POOL = "nectar-cancel"
RUN_TIMEOUT_S = 600
STOP_BOUND_S = 30.0  # the worker polls the server for cancellations every few seconds


def _document(folder: Path) -> Path:
    from pydoc_data.topics import topics

    path = folder / "naming.txt"
    path.write_text(topics["naming"])
    return path


def _flow_run_processes(worker: subprocess.Popen) -> list[psutil.Process]:
    return [p for p in psutil.Process(worker.pid).children(recursive=True) if p.is_running()]


def test_cancelled_flow_run_stops_releases_the_lock_and_resumes(prefect_server, tmp_path):
    doc = _document(tmp_path)
    run_dir = tmp_path / "runs" / "naming"
    dep.deploy(pool=POOL, preset="tiny", working_dir=str(tmp_path))
    with running_worker(prefect_server, POOL, "cancel-worker", tmp_path) as worker:
        flow_run = operations.trigger(str(doc), preset="tiny", run_dir=str(run_dir))
        marker = run_dir / "verify" / "attempt.json"
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while not marker.exists():
            assert time.monotonic() < deadline, (tmp_path / "worker-cancel-worker.log").read_text()[-3000:]
            time.sleep(0.1)
        running = _flow_run_processes(worker)
        assert running, "no flow-run process under the worker"
        cancel = subprocess.run([sys.executable, "-m", "prefect", "flow-run", "cancel", str(flow_run.id)],
                                capture_output=True, text=True, env=prefect_server.env(), timeout=120)
        assert cancel.returncode == 0, cancel.stdout + cancel.stderr
        t0 = time.monotonic()
        done = operations.wait_for_run(flow_run.id, RUN_TIMEOUT_S, poll_s=0.5)
        assert done.state.type.value == "CANCELLED", done.state
        gone, alive = psutil.wait_procs(running, timeout=STOP_BOUND_S)
        assert not alive, [p.pid for p in alive]
        stopped_s = time.monotonic() - t0
        assert not (run_dir / "run.lock").exists()
        run = RunDir(str(run_dir))
        assert run.read_manifest("verify") is None and run.read_manifest("synthesize") is not None

        again = operations.trigger(str(doc), preset="tiny", run_dir=str(run_dir))
        finished = operations.wait_for_run(again.id, RUN_TIMEOUT_S, poll_s=1)
    assert finished.state.type.value == "COMPLETED", finished.state
    assert [last_invocation(run, s)["status"] for s in ("chunk", "synthesize", "verify")] == \
        ["cached", "cached", "done"]
    print(f"cancel → flow-run process gone: {stopped_s:.1f} s")
