"""Processes for the Prefect tests: a REAL server (SQLite, temp PREFECT_HOME) on 127.0.0.1, and real workers.

Nothing here is faked: ``prefect server start`` runs as a subprocess exactly as a data engineer
would start it, and workers are ``prefect worker start --type process`` subprocesses that pick up
flow runs from the server and execute them in their own child processes.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import httpx

from nectar.ports import free_port  # noqa: F401  (re-exported for the tests)

REPO_ROOT = Path(__file__).resolve().parents[2]
PREFECT = [sys.executable, "-m", "prefect"]
SERVER_START_TIMEOUT_S = 90.0


@dataclass
class PrefectServer:
    api_url: str
    home: Path
    process: subprocess.Popen
    log_path: Path

    def env(self, **extra: str) -> dict[str, str]:
        """Environment for a subprocess that talks to this server (and imports this repo)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
        env.update(
            PREFECT_HOME=str(self.home),
            PREFECT_API_URL=self.api_url,
            PREFECT_SERVER_ANALYTICS_ENABLED="false",
            PREFECT_LOGGING_LEVEL="INFO",
            # Results of flow runs picked up by workers must be readable by the test process.
            PREFECT_RESULTS_PERSIST_BY_DEFAULT="true",
            PREFECT_LOCAL_STORAGE_PATH=str(self.home / "storage"),
            PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
            # Two cores: keep torch from oversubscribing them when two runs overlap.
            OMP_NUM_THREADS="1",
        )
        env.update(extra)
        return env

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]


def _wait_healthy(server: PrefectServer, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"prefect server exited with {server.process.returncode}:\n{server.log_tail()}")
        try:
            if httpx.get(f"{server.api_url}/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"prefect server not healthy after {timeout_s}s:\n{server.log_tail()}")


def stop_process_group(proc: subprocess.Popen, grace_s: float = 15.0) -> None:
    """SIGTERM the process group we started (server/worker and their children), then SIGKILL."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


@contextmanager
def running_server(home: Path) -> Iterator[PrefectServer]:
    home.mkdir(parents=True, exist_ok=True)
    port = free_port()
    api_url = f"http://127.0.0.1:{port}/api"
    log_path = home / "server.log"
    server = PrefectServer(api_url, home, None, log_path)  # type: ignore[arg-type]
    env = server.env(
        PREFECT_API_DATABASE_CONNECTION_URL=f"sqlite+aiosqlite:///{home / 'prefect.db'}",
        PREFECT_SERVER_UI_ENABLED="false",
    )
    env.pop("PREFECT_API_URL")  # the server itself must not think it is a client of itself
    with open(log_path, "w") as log:
        server.process = subprocess.Popen(
            [*PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port), "--analytics-off"],
            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
    try:
        _wait_healthy(server, SERVER_START_TIMEOUT_S)
        yield server
    finally:
        stop_process_group(server.process)


@contextmanager
def running_worker(server: PrefectServer, pool: str, name: str, log_dir: Path,
                   limit: int | None = None, **env: str) -> Iterator[subprocess.Popen]:
    """A real ``prefect worker start`` subprocess polling ``pool``."""
    cmd = [*PREFECT, "worker", "start", "--pool", pool, "--type", "process", "--name", name]
    if limit is not None:
        cmd += ["--limit", str(limit)]
    log_path = log_dir / f"worker-{name}.log"
    worker_env = server.env(PREFECT_WORKER_QUERY_SECONDS="1", PREFECT_WORKER_PREFETCH_SECONDS="5", **env)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=worker_env, cwd=REPO_ROOT, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield proc
    finally:
        stop_process_group(proc)
