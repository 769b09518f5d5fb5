"""Slow matrix rows: the real ``nectar run`` (with its temporary Prefect server) stopped by a signal
inside a stage, or by its Prefect server dying, then resumed to the end.

One run directory goes through the chain (each step a new ``nectar run`` in its own session): a
double Ctrl-C to the process group inside verify, the temporary Prefect server SIGKILLed inside
targets, SIGTERM inside evaluate, SIGINT to the process alone inside evaluate, then a run to the end. After
each stop: the exit status, the one line (the stage, the resume command), the stop time, no process
left (the group and every process it had started), the lock released, the stage not complete. The
last run must report cached only what was complete and end with the uninterrupted run's digests
(verify, interrupted mid-way, by the LLM stages' resume contract instead). Every process is started in its own session; teardown SIGKILLs its group.
"""
from __future__ import annotations

import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from matrix_helpers import DOCUMENT, outputs

from nectar.orchestration.executor import RunDir, last_invocation
from nectar.schemas.config import STAGES
from nectar.shutdown import group_alive

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]  # five runs (~4 min on an idle 2-core machine)
REPO = Path(__file__).resolve().parents[2]
NECTAR = [sys.executable, "-m", "nectar.pipeline.cli"]
STOP_BOUND_S = 15.0  # signal → process and everything it started gone (the deadline is 10 s)
START_TIMEOUT_S = 600.0


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_HOME=str(tmp_path / "prefect"), PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", **extra)
    return env


class Run:
    """One ``nectar run`` in its own session; ``stop`` always kills its group."""

    def __init__(self, run_dir: str, tmp_path: Path, **env: str):
        self.run_dir, self.started = run_dir, time.time()
        self.err_path = tmp_path / f"stderr-{time.monotonic_ns()}.txt"
        with open(self.err_path, "w") as err:
            self.proc = subprocess.Popen([*NECTAR, "run", DOCUMENT, "--preset", "tiny", "--run-dir", run_dir],
                                         stdout=subprocess.DEVNULL, stderr=err, env=_env(tmp_path, **env),
                                         start_new_session=True)

    def wait_inside(self, stage: str) -> list[psutil.Process]:
        """Wait until ``stage`` has started its work in THIS run (an interrupted one left its marker);
        return every process the run has started."""
        marker = Path(self.run_dir) / stage / "attempt.json"
        deadline = time.monotonic() + START_TIMEOUT_S
        while not (marker.exists() and marker.stat().st_mtime >= self.started):
            assert self.proc.poll() is None, f"exited {self.proc.returncode} before {stage}: {self.stderr()[-3000:]}"
            assert time.monotonic() < deadline, f"{stage} did not start: {self.stderr()[-3000:]}"
            time.sleep(0.05)
        return psutil.Process(self.proc.pid).children(recursive=True)

    def stderr(self) -> str:
        return self.err_path.read_text(errors="replace")

    def kill_group(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=30)


@pytest.fixture
def runs():
    started: list[Run] = []
    yield started
    for run in started:  # whatever happened, nothing outlives the test
        run.kill_group()


def _stopped(run: Run, children: list[psutil.Process], t0: float, code: int) -> tuple[float, str]:
    """The run exited with ``code`` and, within the bound, left nothing behind; (seconds, its line)."""
    run.proc.wait(timeout=STOP_BOUND_S + 30)
    exited = time.monotonic() - t0
    while (group_alive(run.proc.pid) or any(c.is_running() and c.status() != psutil.STATUS_ZOMBIE
                                              for c in children)) and time.monotonic() - t0 < STOP_BOUND_S:
        time.sleep(0.05)
    gone = time.monotonic() - t0
    assert not group_alive(run.proc.pid), "the process group outlived the run"
    assert not [c.pid for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE], \
        "a process the run started outlived it"
    assert run.proc.returncode == code, (run.proc.returncode, run.stderr()[-3000:])
    assert exited < STOP_BOUND_S and gone < STOP_BOUND_S, (exited, gone)
    assert not (Path(run.run_dir) / "run.lock").exists()  # released
    lines = [x.split("\r")[-1].strip() for x in run.stderr().splitlines()]
    return gone, [x for x in lines if x][-1]


def _interrupted_inside(run_dir: str, stage: str) -> None:
    rd = RunDir(run_dir)
    assert rd.read_manifest(stage) is None  # nothing looks complete
    assert all(rd.read_manifest(s) is not None for s in STAGES[: STAGES.index(stage)])
    assert last_invocation(rd, stage)["status"] == "failed"  # `nectar status` shows it


def test_signals_and_a_dying_server_stop_the_run_and_it_resumes(run_copy, complete_run, tmp_path, runs):
    for later in STAGES[STAGES.index("verify"):]:
        shutil.rmtree(Path(run_copy) / later)
    resume = f"resume with: nectar run {DOCUMENT} --preset tiny --run-dir {run_copy}"
    times = {}

    # Ctrl-C twice in a terminal (the whole group) inside verify: the second exits at once.
    runs.append(run := Run(run_copy, tmp_path))
    children = run.wait_inside("verify")
    t0 = time.monotonic()
    os.killpg(run.proc.pid, signal.SIGINT)
    time.sleep(0.2)
    os.killpg(run.proc.pid, signal.SIGINT)
    times["2×SIGINT group, verify"], line = _stopped(run, children, t0, 130)
    assert "interrupted" in line and "during verify" in line and resume in line, line
    _interrupted_inside(run_copy, "verify")

    # The temporary Prefect server killed inside targets: one line, exit 1, nothing left; verify resumed
    # (done, not cached).
    runs.append(run := Run(run_copy, tmp_path))
    children = run.wait_inside("targets")
    assert last_invocation(RunDir(run_copy), "verify")["status"] == "done"
    (server,) = [c for c in children if "uvicorn" in " ".join(c.cmdline())]
    t0 = time.monotonic()
    server.kill()
    times["server SIGKILL, targets"], line = _stopped(run, children, t0, 1)
    assert line.startswith(f"error: the temporary Prefect server (pid {server.pid}) was killed by SIGKILL "
                           "during targets; the run stopped"), line
    assert line.endswith(resume), line
    _interrupted_inside(run_copy, "targets")

    # SIGTERM (timeout, systemd, docker stop) inside evaluate.
    runs.append(run := Run(run_copy, tmp_path))
    children = run.wait_inside("evaluate")
    t0 = time.monotonic()
    run.proc.send_signal(signal.SIGTERM)
    times["SIGTERM process, evaluate"], line = _stopped(run, children, t0, 143)
    assert line == f"interrupted by SIGTERM during evaluate; {resume}"
    _interrupted_inside(run_copy, "evaluate")

    # SIGINT to the process alone inside evaluate.
    runs.append(run := Run(run_copy, tmp_path))
    children = run.wait_inside("evaluate")
    t0 = time.monotonic()
    run.proc.send_signal(signal.SIGINT)
    times["SIGINT process, evaluate"], line = _stopped(run, children, t0, 130)
    assert line == f"interrupted by SIGINT (Ctrl-C) during evaluate; {resume}"
    _interrupted_inside(run_copy, "evaluate")

    # To the end: only what was complete is cached, and the result is the uninterrupted run's.
    runs.append(run := Run(run_copy, tmp_path))
    assert run.proc.wait(timeout=START_TIMEOUT_S) == 0, run.stderr()[-3000:]
    status = {s: last_invocation(RunDir(run_copy), s)["status"] for s in STAGES}
    assert status == {**{s: "cached" for s in STAGES[:-1]}, "evaluate": "done"}
    got, ref = outputs(run_copy), outputs(complete_run)
    # verify was interrupted mid-way: its unfinished requests ran in new batches, whose replies may differ
    # at float level (docs/artifacts.md, the resume contract for the LLM stages), and so do evaluate's
    # judgments of them; every other stage, and evaluate's metrics, are the uninterrupted run's.
    assert {s: got[s] for s in ("chunk", "synthesize", "targets", "train")} == \
        {s: ref[s] for s in ("chunk", "synthesize", "targets", "train")}
    print("stop times (s):", {k: round(v, 2) for k, v in times.items()})
    # evaluate's metrics are the uninterrupted run's: every count and string to the bit, every float to
    # 1e-6 relative. Not to the bit: the reference run was built in this process (torch at 2 threads) and
    # the resumed one in a `nectar run` at OMP_NUM_THREADS=1, and the sentence embedder's matmuls round
    # their last bits differently at another thread count (agreement_cosine moved by ~1e-9). Its other
    # source of noise, the texts sharing an embedding batch, is gone (evaluation/agreement.py).
    import pyarrow.parquet as pq

    a = pq.read_table(Path(run_copy) / "evaluate" / "metrics.parquet").to_pylist()
    b = pq.read_table(Path(complete_run) / "evaluate" / "metrics.parquet").to_pylist()
    assert len(a) == len(b)
    diff = [(i, k, ra[k], rb.get(k)) for i, (ra, rb) in enumerate(zip(a, b)) for k in ra
            if not _same_value(ra[k], rb.get(k))]
    assert not diff, f"the resumed run's evaluate metrics differ from the uninterrupted run's: {diff[:20]}"


def _same_value(x, y) -> bool:
    if isinstance(x, float) and isinstance(y, float):
        return (math.isnan(x) and math.isnan(y)) or math.isclose(x, y, rel_tol=1e-6, abs_tol=1e-12)
    return x == y


def test_unreachable_prefect_api_url_names_the_fix(tmp_path):
    with socket_port() as port:  # bound, not listening: nothing answers
        url = f"http://127.0.0.1:{port}/api"
        t0 = time.monotonic()
        done = subprocess.run([*NECTAR, "run", DOCUMENT, "--preset", "tiny", "--run-dir", str(tmp_path / "run")],
                              capture_output=True, text=True, env=_env(tmp_path, PREFECT_API_URL=url), timeout=120,
                              start_new_session=True)
        took = time.monotonic() - t0
    assert done.returncode == 1, done.stderr[-2000:]
    (line,) = [x for x in done.stderr.splitlines() if x.strip()]
    assert line.startswith(f"error: no Prefect server answers at {url} (PREFECT_API_URL): connection refused; "
                           "start it"), line
    assert "unset PREFECT_API_URL to run with a temporary local server" in line
    assert took < 60, took  # ~8 s on an idle machine (Python and the document check)
    assert not (tmp_path / "run" / "run.lock").exists()


class socket_port:
    """A TCP port bound but not listening, held for the block (connections to it are refused)."""

    def __enter__(self) -> int:
        import socket

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        return self.sock.getsockname()[1]

    def __exit__(self, *exc) -> None:
        self.sock.close()
