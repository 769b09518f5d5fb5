"""The Prefect API a command runs against, and what happens when it goes away.

* ``PREFECT_API_URL`` set: it is asked for ``/health`` before anything starts; if nothing answers,
  one line naming the fix (start the server, or unset the variable for a temporary local one).
* unset: Prefect's temporary local server, started here in its own session (a terminal's Ctrl-C
  reaches the run, not the server the run still has to report to), tied to this process
  (``shutdown.die_with_parent``) and stopped with it (``shutdown.register_process``).

While the command runs, a thread watches the API: the temporary server exiting, or a configured
server not answering for ``API_GRACE_S`` seconds (longer than a restart takes), stops the run with
one line (``shutdown.request_stop``, exit 1). We stop rather than go on with local logging because
Prefect cannot run a flow or its stage subflows without its API — going on would mean running the
stages outside Prefect, a second path the server never sees — and because stopping loses nothing:
every finished stage and the interrupted stage's partial work are on disk, and the same command
resumes them.
"""
from __future__ import annotations

import os
import signal
import subprocess
import time
import sys
import threading
from contextlib import contextmanager
from typing import Iterator

import prefect

import httpx
from prefect.events.worker import EventsWorker
from prefect.logging.handlers import APILogWorker
from prefect.server.api.server import SubprocessASGIServer
from prefect.settings import PREFECT_API_URL, get_current_settings

from .. import shutdown
from .errors import OrchestratorUnreachable

API_GRACE_S = float(os.environ.get("NECTAR_API_GRACE_S", "60"))  # a configured server may be down this long
HEALTH_TIMEOUT_S = 5.0
POLL_S = 1.0
DRAIN_S = 3.0  # at exit, the longest the last logs and events may take to reach the server


class _SessionServer(SubprocessASGIServer):
    """Prefect's temporary server (the command of Prefect's own ``_run_uvicorn_command``), started in
    its own session and tied to this process. Created before Prefect asks for one, it is the instance
    Prefect's client finds for the ephemeral API (``SubprocessASGIServer()`` keeps one per port)."""

    def _run_uvicorn_command(self) -> subprocess.Popen:
        server_env = {"PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1"}
        return subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "--app-dir", str(prefect.__module_path__.parent), "--factory",
             "prefect.server.api.server:create_app", "--host", "127.0.0.1", "--port", str(self.port),
             "--log-level", "error", "--lifespan", "on"],
            env={**os.environ, **server_env, **get_current_settings().to_environment_variables(exclude_unset=True)},
            start_new_session=True, preexec_fn=shutdown.die_with_parent)


def configured_url() -> str | None:
    return PREFECT_API_URL.value() or None


def check_reachable(url: str) -> None:
    """Raise ``OrchestratorUnreachable`` (one line with the fix) if nothing answers at ``url``."""
    try:
        httpx.get(f"{url.rstrip('/')}/health", timeout=HEALTH_TIMEOUT_S).raise_for_status()
    except httpx.HTTPError as exc:
        why = "connection refused" if isinstance(exc, httpx.ConnectError) else f"{type(exc).__name__}: {exc}"
        raise OrchestratorUnreachable(
            f"no Prefect server answers at {url} (PREFECT_API_URL): {why}; start it (prefect server start, or "
            "docker compose up -d, see docs/deployment.md) or unset PREFECT_API_URL to run with a temporary "
            "local server") from None


@contextmanager
def prefect_api() -> Iterator[str]:
    """The API for the block (its URL): the configured server, checked first, or a temporary local
    one; a watch thread stops the run (``shutdown.request_stop``) if it goes away."""
    url = configured_url()
    stop = threading.Event()
    if url:
        check_reachable(url)
        watch = threading.Thread(target=_watch_remote, args=(url, stop), name="nectar-api-watch", daemon=True)
    else:
        server = _SessionServer()
        server.start()
        url = server.api_url
        assert server.server_process is not None
        shutdown.register_process(server.server_process, "temporary Prefect server", grace_s=5.0)
        watch = threading.Thread(target=_watch_temporary, args=(server.server_process, stop),
                                 name="nectar-api-watch", daemon=True)
    # Runs before the server stops (cleanups run newest first): the flow runs' last log lines reach it.
    shutdown.register(_drain_logs, "Prefect log and event queues")
    watch.start()
    try:
        yield url
    finally:
        stop.set()


def _drain_logs(fast: bool) -> None:
    if not fast:
        APILogWorker.drain_all(timeout=DRAIN_S)
        EventsWorker.drain_all(timeout=DRAIN_S)


def _watch_temporary(proc: subprocess.Popen, stop: threading.Event) -> None:
    while not stop.wait(POLL_S):
        code = proc.poll()
        if code is not None and not stop.is_set():
            how = f"was killed by {_signal_name(-code)}" if code < 0 else f"exited with code {code}"
            shutdown.request_stop(f"the temporary Prefect server (pid {proc.pid}) {how}")
            return


def _watch_remote(url: str, stop: threading.Event) -> None:
    down_since: float | None = None
    while not stop.wait(POLL_S * 5):
        try:
            httpx.get(f"{url.rstrip('/')}/health", timeout=HEALTH_TIMEOUT_S).raise_for_status()
            down_since = None
        except httpx.HTTPError:
            down_since = down_since or time.monotonic()
            if time.monotonic() - down_since > API_GRACE_S and not stop.is_set():
                shutdown.request_stop(f"the Prefect server at {url} has not answered for {API_GRACE_S:.0f} s")
                return


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
