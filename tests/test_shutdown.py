"""nectar/shutdown.py in real processes: a Python child installs the handlers, registers a real child
process (``sleep``, in its own session), and is sent real signals. No Prefect, no model: seconds."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent("""
    import subprocess, sys, time
    from nectar import shutdown

    mode, grace = sys.argv[1], float(sys.argv[2])
    child = subprocess.Popen(["sleep", "600"], start_new_session=True, preexec_fn=shutdown.die_with_parent)
    shutdown.register_process(child, "sleep")
    print(child.pid, flush=True)
    line = lambda stop, stage: f"stopped by {shutdown.signal_name(stop.signum)} during {stage}"
    try:
        with shutdown.handling_signals(forced_line=line, grace_s=grace), shutdown.doing("work"):
            print("ready", flush=True)
            while True:
                time.sleep(0.05)
    except shutdown.Interrupted as stop:
        print(f"raised {stop.exit_code}", flush=True)
        if mode == "stuck":  # a main thread that never comes back (a native call, an API that hangs)
            time.sleep(600)
        shutdown.exit_now(stop.exit_code)
""")


def _start(mode: str, grace_s: float = 1.0) -> tuple[subprocess.Popen, int]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT, mode, str(grace_s)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, start_new_session=True)
    child = int(proc.stdout.readline())
    assert proc.stdout.readline().strip() == "ready"
    return proc, child


@pytest.fixture
def procs():
    started: list[tuple[subprocess.Popen, int]] = []
    yield started
    for proc, child in started:
        for pid in (proc.pid, child):
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait(10)


def _gone(pid: int, timeout_s: float = 5.0) -> bool:
    try:
        psutil.Process(pid).wait(timeout_s)
    except psutil.NoSuchProcess:
        pass
    except psutil.TimeoutExpired:
        return False
    return True


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_raises_interrupted_and_the_registered_child_is_stopped(procs, sig, code):
    procs.append(started := _start("normal"))
    proc, child = started
    t0 = time.monotonic()
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == code and f"raised {code}" in out
    assert time.monotonic() - t0 < 10 and _gone(child)


def test_a_stuck_main_thread_is_forced_out_after_the_grace_with_its_line(procs):
    procs.append(started := _start("stuck"))
    proc, child = started
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    took = time.monotonic() - t0
    assert proc.returncode == 143 and "raised 143" in out
    assert err.strip().splitlines()[-1] == "stopped by SIGTERM during work (forced after 1 s)"
    assert 0.9 < took < 10, took
    assert _gone(child)


def test_a_second_ctrl_c_exits_at_once(procs):
    procs.append(started := _start("stuck", grace_s=60.0))
    proc, child = started
    os.killpg(proc.pid, signal.SIGINT)  # the terminal: the whole group (the child has its own session)
    time.sleep(0.3)
    t0 = time.monotonic()
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    assert time.monotonic() - t0 < 10  # not the 60 s grace
    assert proc.returncode == 130
    assert err.strip().splitlines()[-1] == "interrupted again: exiting now; stopped by SIGINT (Ctrl-C) during work"
    assert _gone(child)


def test_a_child_outlives_nothing_even_when_its_parent_is_sigkilled(procs):
    procs.append(started := _start("normal"))
    proc, child = started
    proc.kill()  # no handler, no cleanup: only PR_SET_PDEATHSIG
    proc.wait(10)
    assert _gone(child)
