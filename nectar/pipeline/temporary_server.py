"""Prefect's temporary local server, started in its own session and tied to this process.

Prefect starts one itself when ``PREFECT_API_URL`` is unset, as a child in the command's process
group: a terminal's Ctrl-C kills it before the run can record its stopped state, and a SIGTERM to the
command alone leaves it running. Created before Prefect asks for one, ``SessionServer`` is the
instance Prefect's client finds (``SubprocessASGIServer()`` keeps one per port).
"""
from __future__ import annotations

import os
import subprocess
import sys

import prefect
from prefect.server.api.server import SubprocessASGIServer
from prefect.settings import get_current_settings

from .. import shutdown


class SessionServer(SubprocessASGIServer):
    """The command of Prefect's own ``_run_uvicorn_command``, in a new session, dying with us."""

    def _run_uvicorn_command(self) -> subprocess.Popen:
        server_env = {"PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1"}
        proc = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "--app-dir", str(prefect.__module_path__.parent), "--factory",
             "prefect.server.api.server:create_app", "--host", "127.0.0.1", "--port", str(self.port),
             "--log-level", "error", "--lifespan", "on"],
            env={**os.environ, **server_env, **get_current_settings().to_environment_variables(exclude_unset=True)},
            start_new_session=True, preexec_fn=shutdown.die_with_parent)
        # Registered at once: a Ctrl-C while it is still starting up stops it too.
        shutdown.register_process(proc, "temporary Prefect server", grace_s=5.0)
        return proc
