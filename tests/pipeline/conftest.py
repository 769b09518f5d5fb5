"""Fixtures: a REAL Prefect server for the session (SQLite in a temp PREFECT_HOME, 127.0.0.1, torn
down at the end) and real ``prefect worker start`` processes. See prefect_procs.py."""
from __future__ import annotations

from typing import Iterator

import pytest

from prefect_procs import PrefectServer, running_server


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrefectServer]:
    """One real server for the session; tests use distinct work pools / deployment names."""
    from prefect.settings import PREFECT_API_URL, PREFECT_HOME, temporary_settings

    with running_server(tmp_path_factory.mktemp("prefect-home")) as server:
        # In-process clients (get_client, run_deployment) talk to this server.
        with temporary_settings(updates={PREFECT_API_URL: server.api_url, PREFECT_HOME: server.home}):
            yield server
