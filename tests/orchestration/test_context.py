"""What ``nectar run`` is asked to do, checked before anything starts (check_request), and
``--only chunk`` on a new run directory (chunk needs nothing but the document)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "reliability"))
from matrix_helpers import run_pipeline, tiny_config  # noqa: E402

from nectar.orchestration import RunDirMismatch, StageInputError, check_inputs_done, check_request  # noqa: E402
from nectar.orchestration.executor import RunDir  # noqa: E402


def test_only_chunk_on_a_new_run_directory_runs(tmp_path):
    run_dir = str(tmp_path / "new")
    checked = check_request("pydoc:naming", tiny_config(), run_dir, "chunk")
    assert not checked.reopen and not Path(run_dir).exists()  # checked, nothing written yet
    out = run_pipeline(run_dir, only="chunk")
    assert out.error is None and out.statuses == {"chunk": "done"}
    assert RunDir(run_dir).read_manifest("chunk") is not None and RunDir(run_dir).exists("run.json")


def test_only_on_an_existing_run_reopens_it_and_checks_the_document(tmp_path):
    run_dir = str(tmp_path / "run")
    assert run_pipeline(run_dir, only="chunk").error is None
    reopened = check_request(None, tiny_config(), run_dir, "synthesize")  # no document: the run's own
    assert reopened.reopen and reopened.info.source_uri == "pydoc:naming"
    assert check_request("pydoc:naming", tiny_config(), run_dir, "synthesize").reopen
    other = tmp_path / "other.txt"
    other.write_text("Another text entirely, about lighthouses and their keepers. " * 10)
    with pytest.raises(RunDirMismatch, match="holds a run of another document"):
        check_request(str(other), tiny_config(), run_dir, "synthesize")
    with pytest.raises(StageInputError, match="--only verify needs the outputs of synthesize"):
        check_inputs_done(RunDir(run_dir), "verify", "pydoc:naming")
    check_inputs_done(RunDir(run_dir), "synthesize", "pydoc:naming")  # chunk is done: fine
