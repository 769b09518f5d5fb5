"""``nectar serve``: bind the port, load the run's module, serve until SIGTERM/SIGINT, exit 0.

The port is bound before the model loads, so a port in use fails in a second with a clear message
instead of after the load. On SIGTERM uvicorn stops accepting connections, lets in-flight requests
(streams included) finish within ``shutdown_timeout_s``, then runs the app's shutdown, which drains
the scheduler; the process then exits 0.
"""
from __future__ import annotations

import logging
import signal
import socket
import sys

import uvicorn

from .app import create_app
from .limits import ServeLimits
from .loader import load_served_module


class PortInUse(OSError):
    pass


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
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


def serve(run_dir: str, host: str = "127.0.0.1", port: int = 8000, limits: ServeLimits | None = None,
          name: str | None = None, log_level: str = "info") -> None:
    limits = limits or ServeLimits()
    sock = bind(host, port)
    served = load_served_module(run_dir, name)
    app = create_app(served, limits)
    config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=int(limits.shutdown_timeout_s),
                            timeout_keep_alive=5)
    server = _Server(config, app.state.nectar)
    # uvicorn re-raises the signal that stopped it once it has shut down, which with the default
    # handlers kills the process (exit status 143) or raises KeyboardInterrupt. A graceful shutdown
    # is a success: ignore the replay.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    bound = sock.getsockname()
    print(f"nectar serve: {served.name} (n={served.n_context}, {served.spec.arch}, "
          f"{served.spec.module_bytes / 1e6:.2f} MB) on http://{host}:{bound[1]}/v1", flush=True)
    logging.getLogger("nectar.serve").setLevel(log_level.upper())
    server.run(sockets=[sock])
    sys.stdout.flush()
