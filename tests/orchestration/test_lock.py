"""One writer per run directory (nectar/orchestration/lock.py): real processes contend for real lock
files on local disk; memory:// stands in for an fsspec store."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import fsspec
import pytest

from nectar.orchestration import lock as lockmod
from nectar.orchestration.lock import LOCK_FILE, RunLocked, read_holder, run_lock

HOLD = """
import sys, time
from nectar.orchestration.lock import run_lock
with run_lock(sys.argv[1]):
    print("held", flush=True)
    time.sleep(float(sys.argv[2]))
"""


def hold_in_other_process(root: str, seconds: float) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.Popen([sys.executable, "-c", HOLD, root, str(seconds)], stdout=subprocess.PIPE, text=True,
                            env=env)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_second_writer_fails_at_once_naming_the_holder(tmp_path):
    root = str(tmp_path / "run")
    proc = hold_in_other_process(root, 30)
    try:
        t0 = time.monotonic()
        with pytest.raises(RunLocked) as info:
            with run_lock(root, wait=False):
                pass
        assert time.monotonic() - t0 < 2
        msg = str(info.value)
        assert f"pid {proc.pid} on {socket.gethostname()}" in msg and root in msg
        assert info.value.holder.pid == proc.pid
    finally:
        proc.kill()
        proc.wait()


def test_second_writer_waits_says_who_then_runs(tmp_path):
    root = str(tmp_path / "run")
    proc = hold_in_other_process(root, 2.0)
    notices = []
    t0 = time.monotonic()
    with run_lock(root, notify=notices.append, poll_s=0.2) as me:
        waited = time.monotonic() - t0
        assert read_holder(root).token == me.token
    proc.wait()
    assert waited > 1.0
    assert len(notices) == 1 and f"pid {proc.pid}" in notices[0] and "waiting" in notices[0]
    assert not (tmp_path / "run" / LOCK_FILE).exists()  # released


def test_lock_of_a_killed_process_is_taken_over_with_a_message(tmp_path):
    root = str(tmp_path / "run")
    proc = hold_in_other_process(root, 30)
    proc.kill()  # SIGKILL: no chance to remove its lock
    proc.wait()
    assert read_holder(root).pid == proc.pid
    notices = []
    with run_lock(root, wait=False, notify=notices.append):
        pass
    assert notices == [notices[0]] and "taking over the lock" in notices[0] and "that process is gone" in notices[0]


def _foreign_lock(root: Path, heartbeat_age_s: float) -> None:
    beat = time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime(time.time() - heartbeat_age_s))
    root.mkdir(parents=True, exist_ok=True)
    (root / LOCK_FILE).write_text(json.dumps({
        "host": "worker-7", "pid": 4242, "started_at": beat, "command": "nectar run doc.txt", "token": "t",
        "heartbeat_at": beat, "proc_start": None}))


def test_other_hosts_lock_is_stale_only_without_heartbeat(tmp_path):
    root = tmp_path / "run"
    _foreign_lock(root, heartbeat_age_s=10)
    with pytest.raises(RunLocked, match="pid 4242 on worker-7"):
        with run_lock(str(root), wait=False):
            pass
    _foreign_lock(root, heartbeat_age_s=lockmod.STALE_AFTER_S + 60)
    notices = []
    with run_lock(str(root), wait=False, notify=notices.append):
        pass
    assert "no heartbeat for" in notices[0]


def test_holder_refreshes_its_heartbeat(tmp_path, monkeypatch):
    monkeypatch.setattr(lockmod, "HEARTBEAT_S", 0.2)
    root = str(tmp_path / "run")
    with run_lock(root):
        first = read_holder(root).heartbeat_at
        deadline = time.monotonic() + 5
        while read_holder(root).heartbeat_at == first and time.monotonic() < deadline:
            time.sleep(0.2)
        assert read_holder(root).heartbeat_at > first


def test_reentrant_in_one_process_and_works_on_an_fsspec_store():
    root = "memory://nectar-lock-test/run"
    with run_lock(root, wait=False) as outer:
        with run_lock(root, wait=False) as inner:  # the CLI holds it around the flow, which takes it again
            assert inner.token == outer.token
        assert read_holder(root).token == outer.token  # still held by the outer block
    assert read_holder(root) is None
    with run_lock(root, wait=False):  # creation is exclusive on the store too
        fs, path = fsspec.core.url_to_fs(f"{root}/{LOCK_FILE}")
        other = lockmod.Holder(host="h2", pid=1, started_at=lockmod._now(), command="x", token="other")
        assert not lockmod._create(fs, path, other)
