"""``nectar status``: states, counts and errors read back from real run directories.

The run directories are written by the real ``run_stage`` (manifests last, error.json on failure),
on local disk and on fsspec's memory:// filesystem.
"""
from __future__ import annotations

import io
import uuid

import pytest
from rich.console import Console

from nectar.pipeline.runs_status import available_stages, collect, find_runs, render, status_json
from nectar.orchestration.executor import RunDir, StageError, now, run_stage
from nectar.schemas.artifacts import ChunkRow, RunManifest
from nectar.tables import write_json_artifact, write_table

from nectar.schemas.config import STAGES

ALL = set(STAGES)


def make_run(root: str, doc: str, run_id: str) -> RunDir:
    run = RunDir(f"{root}/{doc}/{run_id}")
    write_json_artifact(run.url("run.json"), RunManifest(
        doc_id=doc, run_id=run_id, source_uri=f"/docs/{doc}.txt", config={"preset": "tiny"},
        code_version="test", created_at=now()))
    return run


def chunk_body(n: int):
    def body(stage_url: str):
        rows = [ChunkRow(chunk_id=i, start_word=i, end_word=i + 1, n_words=1, text="w") for i in range(n)]
        write_table(f"{stage_url}/chunks.parquet", rows, ChunkRow)
        return ["chunks.parquet"], {"chunks": n, "words": n}
    return body


def failing_body(stage_url: str):
    raise ConnectionError("Connection refused: http://127.0.0.1:9/v1 (synthesize LLM endpoint)")


@pytest.fixture(params=["file", "memory"])
def root(request, tmp_path) -> str:
    return str(tmp_path / "runs") if request.param == "file" else f"memory://status-{uuid.uuid4().hex}/runs"


def test_states_counts_and_last_error_across_runs_of_a_document(root):
    ok = make_run(root, "manual-1234abcd", "r1")
    run_stage(ok, "chunk", {"words": 3}, {"document": "h"}, chunk_body(3))
    bad = make_run(root, "manual-1234abcd", "r2")
    run_stage(bad, "chunk", {"words": 5}, {"document": "h"}, chunk_body(5))
    with pytest.raises(StageError):  # the body's ConnectionError, recorded
        run_stage(bad, "synthesize", {"llm": "x"}, {"chunks": "h"}, failing_body)

    statuses = collect(f"{root}/manual-1234abcd", available=ALL)
    assert [s.run_id for s in statuses] == ["r1", "r2"]
    first, second = statuses
    assert [s.state for s in first.stages] == ["done"] + ["missing"] * (len(STAGES) - 1)
    assert first.stages[0].counts == {"chunks": 3, "words": 3}
    assert first.state == "incomplete"
    assert second.state == "failed"
    assert {s.stage: s.state for s in second.stages}["synthesize"] == "failed"
    assert "Connection refused" in second.last_error.error_summary
    assert second.last_error.rerun == (
        f"nectar run /docs/manual-1234abcd.txt --run-dir {bad.root} --only synthesize")

    out = io.StringIO()
    render(statuses, Console(file=out, width=200, color_system=None))
    text = out.getvalue()
    assert "synthesize failed" in text and "ConnectionError: Connection refused" in text
    assert f"--run-dir {bad.root} --only synthesize" in text
    assert f"nectar rerun {bad.root} synthesize" in text  # the same through the stage deployment
    assert "chunks=5" in text


def test_root_of_all_documents_and_single_run_dir(root):
    a = make_run(root, "doc-a", "r1")
    make_run(root, "doc-b", "r1")
    assert [r.root for r in find_runs(root)] == [f"{root}/doc-a/r1", f"{root}/doc-b/r1"]
    assert [r.root for r in find_runs(a.root)] == [a.root]


def test_cached_stage_and_retry_after_failure(root):
    run = make_run(root, "doc", "r1")
    run_stage(run, "chunk", {"words": 3}, {"document": "h"}, chunk_body(3))
    with pytest.raises(StageError):  # the body's ConnectionError, recorded
        run_stage(run, "synthesize", {"llm": "x"}, {"chunks": "h"}, failing_body)
    # The retry: chunk is a cache hit, synthesize (cause fixed) completes.
    run_stage(run, "chunk", {"words": 3}, {"document": "h"}, chunk_body(3))
    run_stage(run, "synthesize", {"llm": "y"}, {"chunks": "h"}, chunk_body(2))
    status = collect(run.root, available=ALL)[0]
    states = {s.stage: s.state for s in status.stages}
    assert [states[k] for k in ("chunk", "synthesize", "verify")] == ["cached", "done", "missing"]
    assert status.last_error is None


def test_partial_stage_and_not_available_stage(root):
    run = make_run(root, "doc", "r1")
    run.makedirs("chunk")  # a stage killed mid-way: folder, no manifest, no error
    status = collect(run.root, available={"chunk", "synthesize"})[0]
    states = {s.stage: s.state for s in status.stages}
    assert states["chunk"] == "partial" and states["synthesize"] == "missing"
    assert states["train"] == "not available"
    data = status_json([status])[0]
    assert data["state"] == "incomplete" and data["stages"][0]["rerun"].endswith(" chunk")


def test_invalid_run_json_is_reported_not_crashing(tmp_path):
    run_dir = tmp_path / "doc" / "r1"
    run_dir.mkdir(parents=True)
    (run_dir / "run.json").write_text('{"doc_id": 3}')
    status = collect(str(tmp_path), available=ALL)[0]
    assert status.state == "invalid" and "run.json" in status.problem


def test_missing_directory_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such directory"):
        collect(str(tmp_path / "nope"))


def test_available_stages_reflects_installed_stage_modules():
    assert available_stages() <= ALL
    assert {"chunk", "synthesize", "verify"} <= available_stages()
