"""Fixtures for the fault and bad-input matrix: one complete run of the ``tiny`` preset, built once
per session through the same orchestration the Prefect flows call, and copied for every row that
damages or resumes it (the copy is the 'uninterrupted run' the row is compared with)."""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
for folder in (HERE, HERE.parent / "llm"):  # matrix helpers; the FAKE OpenAI server (tests/llm/fake_openai.py)
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

from matrix_helpers import build_complete_run  # noqa: E402


@pytest.fixture(scope="session")
def complete_run(tmp_path_factory) -> str:
    """A finished tiny run (every stage done); treat as read-only, copy it with ``run_copy``."""
    root = tmp_path_factory.mktemp("reference") / "run"
    build_complete_run(str(root))
    return str(root)


@pytest.fixture
def run_copy(complete_run, tmp_path) -> str:
    dst = tmp_path / "run"
    shutil.copytree(complete_run, dst)
    return str(dst)
