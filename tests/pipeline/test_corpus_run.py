"""`nectar run MANIFEST` on the tiny preset: a corpus of two documents, one of which fails at
synthesize (its manifest entry points synthesis at a closed port on 127.0.0.1 — the injected fault);
the same command again skips the finished document and resumes the failed one at synthesize.
A malformed manifest stops the command before anything runs, with one line naming the entry."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from nectar.orchestration.corpus import progress

from prefect_procs import REPO_ROOT, free_port

def _nectar(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS="1", COLUMNS="200")
    return subprocess.run([sys.executable, "-m", "nectar.pipeline.cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=800)


def _write_docs(folder: Path) -> tuple[Path, Path]:
    from pydoc_data.topics import topics

    a, b = folder / "naming.txt", folder / "calls.txt"
    a.write_text(topics["naming"])
    b.write_text(topics["calls"])
    return a, b


def test_a_malformed_manifest_is_one_line_naming_the_entry(tmp_path: Path):
    a, _ = _write_docs(tmp_path)
    manifest = tmp_path / "corpus.jsonl"
    manifest.write_text(json.dumps({"document": a.name}) + "\n" + '{"document": "calls.txt",}\n')
    done = _nectar(tmp_path, "run", str(manifest), "--preset", "tiny")
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2, done.stderr
    assert len(lines) == 1 and lines[0].startswith(f"error: manifest {manifest} line 2: not JSON"), lines
    assert not (tmp_path / "runs").exists()  # nothing ran


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_rerun_skips_finished_documents_and_retries_the_failed_one_from_its_stage(tmp_path: Path):
    a, b = _write_docs(tmp_path)
    runs, b_dir = tmp_path / "runs", tmp_path / "runs" / "calls-fixed"
    manifest = tmp_path / "corpus.jsonl"
    broken = ["synthesize.llm.backend=openai", f"synthesize.llm.base_url=http://127.0.0.1:{free_port()}/v1",
              "synthesize.llm.model=unreachable", "synthesize.llm.max_retries=0", "synthesize.llm.timeout_s=5"]
    manifest.write_text(json.dumps({"document": a.name}) + "\n"
                        + json.dumps({"document": b.name, "run_dir": str(b_dir), "set": broken}) + "\n")

    first = _nectar(tmp_path, "run", str(manifest), "--preset", "tiny", "--runs", str(runs))
    assert first.returncode == 1, first.stdout + first.stderr
    assert "1 done, 1 failed" in first.stdout, first.stdout
    assert progress(str(b_dir)).state == "failed" and progress(str(b_dir)).stage == "synthesize"
    (a_dir,) = [p.parent for p in runs.glob("naming-*/*/run.json")]
    assert progress(str(a_dir), verify=True).state == "done"
    a_eval = (a_dir / "evaluate" / "manifest.json").read_bytes()
    b_chunk = (b_dir / "chunk" / "manifest.json").read_bytes()

    manifest.write_text(json.dumps({"document": a.name}) + "\n"
                        + json.dumps({"document": b.name, "run_dir": str(b_dir)}) + "\n")  # the fix
    second = _nectar(tmp_path, "run", str(manifest), "--preset", "tiny", "--runs", str(runs))
    assert second.returncode == 0, second.stdout + second.stderr
    assert "1 done, 1 skipped" in second.stdout, second.stdout
    assert "retry from synthesize" in second.stderr and "retried from synthesize" in second.stdout
    assert (a_dir / "evaluate" / "manifest.json").read_bytes() == a_eval  # the finished one untouched
    assert (b_dir / "chunk" / "manifest.json").read_bytes() == b_chunk  # resumed at synthesize: chunk kept
    assert progress(str(b_dir), verify=True).state == "done"


def test_flags_for_one_run_directory_are_refused_for_a_corpus(tmp_path: Path):
    a, b = _write_docs(tmp_path)
    done = _nectar(tmp_path, "run", str(a), str(b), "--preset", "tiny", "--from", "train", "--force")
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert lines[0].startswith("error: --from, --force apply to one document"), lines
