"""The vLLM servers of one pipeline run: started on first use, shared by every stage, stopped at the end.

``server_scope(log_dir)`` opens the scope; inside it, ``acquire(spec)`` returns the running server
for that spec, starting it the first time (synthesize starts it, verify and the evaluate judge
reuse it). Scopes nest: a stage run inside a pipeline's scope uses the pipeline's servers, a stage
run alone opens its own. Leaving the outermost scope (normally, by an exception, or by
KeyboardInterrupt) stops every server it started. A spec that failed to start is not retried in
the same scope: every later stage gets the same error at once.
"""
from __future__ import annotations

import contextlib
import dataclasses
import threading
from pathlib import Path
from typing import Iterator

from .notices import say
from .server import ServerSpec, VLLMServer
from .venv import VLLMError


class ServerPool:
    def __init__(self, log_dir: str | Path, python: str | Path | None = None):
        self.log_dir = Path(log_dir)
        self.python = python  # vLLM's interpreter (None: the managed venv's)
        self.servers: dict[ServerSpec, VLLMServer] = {}
        self.failed: dict[ServerSpec, VLLMError] = {}
        self._starts = 0  # numbers the log files
        self._lock = threading.Lock()

    def acquire(self, spec: ServerSpec) -> VLLMServer:
        with self._lock:
            if spec in self.failed:
                raise self.failed[spec]
            server = self.servers.get(spec)
            if server is not None and server.running:
                return server
            if server is not None:  # died between two stages: the same server again, the restart on record
                reason = server.death() or "it was not running"
                say(f"vllm: the managed server died between stages ({reason}); restarting it (log {server.log_path})")
                try:
                    server.restart(reason, server.generation)
                    return server
                except VLLMError as exc:
                    self.failed[spec] = exc
                    raise
            try:
                server = self._start(spec)
            except VLLMError as exc:
                if not spec.compile:
                    self.failed[spec] = exc
                    raise
                # A compile that can't finish on this machine (killed, out of time) is no reason to lose
                # vLLM: the same server eager starts in about a minute.
                say(f"vllm: the compiled server did not start ({exc}); starting it eager instead")
                try:
                    server = self._start(dataclasses.replace(spec, compile=False))
                except VLLMError as eager_exc:
                    self.failed[spec] = eager_exc
                    raise
            self.servers[spec] = server
            return server

    def _start(self, spec: ServerSpec) -> VLLMServer:
        log = self.log_dir / f"vllm-{self._starts}.log"
        self._starts += 1
        server = VLLMServer(spec, log, python=self.python)
        say(f"vllm: starting a {'compiled' if spec.compile else 'eager'} server for {spec.model} (log {log})")
        server.start()
        say(f"vllm: {server.version} serving at {server.url} after {server.startup_s} s")
        return server

    def stop(self) -> None:
        with self._lock:
            for server in self.servers.values():
                server.stop()
            self.servers.clear()


_ACTIVE: ServerPool | None = None
_ACTIVE_LOCK = threading.Lock()
_DEFAULT: ServerPool | None = None  # outside any scope: servers live until the process exits


@contextlib.contextmanager
def server_scope(log_dir: str | Path) -> Iterator[ServerPool]:
    """The active pool, or a new one (logs under ``log_dir``) stopped when this scope ends."""
    global _ACTIVE
    with _ACTIVE_LOCK:
        outer = _ACTIVE
        if outer is None:
            _ACTIVE = ServerPool(log_dir)
        pool = _ACTIVE
    if outer is not None:
        yield outer
        return
    try:
        yield pool
    finally:
        with _ACTIVE_LOCK:
            _ACTIVE = None
        pool.stop()


def server_log_dir(run_root: str) -> Path:
    """``<run>/llm`` for a run on local disk; a run elsewhere (s3://, memory://) logs locally."""
    if "://" in run_root and not run_root.startswith("file://"):
        return Path.home() / ".cache" / "nectar" / "logs"
    return Path(run_root.removeprefix("file://")) / "llm"


def active_pool() -> ServerPool:
    """The pool of the open scope; without one, a process-wide pool whose servers stop at exit."""
    global _DEFAULT
    with _ACTIVE_LOCK:
        if _ACTIVE is not None:
            return _ACTIVE
        if _DEFAULT is None:
            _DEFAULT = ServerPool(Path.home() / ".cache" / "nectar" / "logs")
        return _DEFAULT


def stop_servers() -> None:
    """Stop the active pool's servers (for a SIGINT/SIGTERM handler; the scope's exit does it too)."""
    with _ACTIVE_LOCK:
        pool = _ACTIVE
    if pool is not None:
        pool.stop()
