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
import threading
import time
from contextlib import contextmanager
from typing import Iterator

import httpx

from .. import shutdown
from .errors import OrchestratorUnreachable

API_GRACE_S = float(os.environ.get("NECTAR_API_GRACE_S", "60"))  # a configured server may be down this long
HEALTH_TIMEOUT_S = 5.0
POLL_S = 1.0
DRAIN_S = 3.0  # at exit, the longest the last logs and events may take to reach the server


def configured_url() -> str | None:
    from prefect.settings import PREFECT_API_URL  # Prefect is imported only once a flow will run

    return PREFECT_API_URL.value() or None


def check_environment_url() -> None:
    """``check_reachable`` on ``$PREFECT_API_URL`` before anything else is loaded (a URL set in a
    Prefect profile instead is checked by ``prefect_api``)."""
    if os.environ.get("PREFECT_API_URL"):
        check_reachable(os.environ["PREFECT_API_URL"])


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
        from .temporary_server import SessionServer  # the server's app: heavy, and only needed here

        server = SessionServer()
        server.start()
        url = server.api_url
        assert server.server_process is not None  # registered with shutdown as it started
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
    stop, _ = shutdown.stopped_by()
    if not fast and (stop is None or stop.reason is None):  # not when the API is what went away
        from prefect.events.worker import EventsWorker
        from prefect.logging.handlers import APILogWorker

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
