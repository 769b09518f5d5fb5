"""``nectar serve``: check the keys, bind the port, open the runs, serve until SIGTERM/SIGINT, exit 0.

A non-loopback address without an API key is refused unless ``allow_unauthenticated`` says so
explicitly: the module is the document's content, compressed. The port is bound before the model loads, so a port in use fails in a second with a clear message
instead of after the load. On SIGTERM uvicorn stops accepting connections, lets in-flight requests
(streams included) finish within ``shutdown_timeout_s``, then runs the app's shutdown, which drains
the scheduler; the process then exits 0.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import ipaddress
import logging
import os
import signal
import socket
import sys

import uvicorn

from .. import ports
from .app import create_app
from .limits import ServeLimits
from .registry import ServedRun, open_registry

KEY_ENV = "NECTAR_API_KEY"  # one key, or several separated by commas


class PortInUse(OSError):
    pass


class Unauthenticated(ValueError):
    """A non-loopback address with no API key and no explicit --allow-unauthenticated."""


def api_keys(flags: list[str] | None) -> tuple[str, ...]:
    """The keys of --api-key (repeatable) and NECTAR_API_KEY (comma-separated), blanks dropped."""
    keys = list(flags or []) + os.environ.get(KEY_ENV, "").split(",")
    return tuple(dict.fromkeys(k.strip() for k in keys if k.strip()))


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


def check_exposure(host: str, keys: tuple[str, ...], allow_unauthenticated: bool) -> None:
    if not keys and not allow_unauthenticated and not is_loopback(host):
        raise Unauthenticated(f"--host {host} exposes the modules (the documents' content) to the network "
                              f"without an API key; give --api-key (or {KEY_ENV}), or pass "
                              "--allow-unauthenticated if a proxy in front authenticates")


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound before anything loads and kept (no window for another process)."""
    try:
        sock = ports.bind(host, port)
    except OSError as exc:
        raise PortInUse(f"cannot listen on {host}:{port}: {exc.strerror}; pick another with --port "
                        "(or stop what holds it)") from exc
    sock.set_inheritable(True)
    return sock


class _Server(uvicorn.Server):
    """uvicorn's server, telling the app as soon as a shutdown signal arrives (so /health says
    "draining" and requests on kept-alive connections get a 503 instead of starting late)."""

    def __init__(self, config: uvicorn.Config, app_state):
        super().__init__(config)
        self.app_state = app_state

    def handle_exit(self, sig, frame) -> None:
        self.app_state.draining = True
        super().handle_exit(sig, frame)


MMAP_THRESHOLD = 1 << 20  # bytes: allocations above it are mapped on their own and unmapped when freed


def return_freed_buffers() -> bool:
    """Have glibc map allocations above 1 MiB on their own, so freed ones go back to the OS at once.

    The engine frees and reallocates batch buffers as the running batch changes size (tens of MB each).
    glibc's default threshold adapts upward after such frees (up to 32 MiB), so they are then carved out
    of the heap and kept: measured with five equal 32-client loads (docs/deployment.md §13), the
    server's RSS swung 1.15–1.37 GB by default and stayed at 1.12–1.19 GB with the fixed threshold.
    Setting it (M_MMAP_THRESHOLD) also turns the adaptation off. False where libc has no mallopt."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.mallopt(-3, MMAP_THRESHOLD))  # -3: M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        return False


def serve(runs: list[ServedRun], sock: socket.socket, limits: ServeLimits | None = None,
          names: list[str] | None = None, keys: tuple[str, ...] = (), log_level: str = "info") -> None:
    """Serve ``runs`` on ``sock`` (``bind``; the caller has applied ``check_exposure`` to its host)."""
    return_freed_buffers()
    limits = limits or ServeLimits()
    host = sock.getsockname()[0]
    registry = open_registry(runs, names, limits.max_module_bytes, limits.keep_dequantized)
    app = create_app(registry, limits, keys)
    config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=int(limits.shutdown_timeout_s),
                            timeout_keep_alive=5)
    server = _Server(config, app.state.nectar)
    # uvicorn re-raises the signal that stopped it once it has shut down, which with the default
    # handlers kills the process (exit status 143) or raises KeyboardInterrupt. A graceful shutdown
    # is a success: ignore the replay.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    bound = sock.getsockname()
    for doc in registry.documents.values():  # never the keys
        print(f"nectar serve: model {doc.name} (n={doc.n_context}, {doc.spec.arch}, "
              f"{doc.spec.module_bytes / 1e6:.2f} MB module, loaded on first request)", flush=True)
    auth = f"{len(keys)} API key(s)" if keys else "no API key"
    print(f"nectar serve: {len(registry.documents)} model(s), {auth}, on http://{host}:{bound[1]}/v1", flush=True)
    logging.getLogger("nectar.serve").setLevel(log_level.upper())
    server.run(sockets=[sock])
    sys.stdout.flush()
