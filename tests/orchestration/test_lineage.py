"""Code digests in cache keys (nectar/orchestration/lineage.py), on a copy of the real package:
a statement changed in the capture code changes the targets stage's digest and no data stage
before it; comments, docstrings and the README change nothing; prompt texts are code too."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from nectar.orchestration import STAGE_RUNNERS
from nectar.orchestration.lineage import PACKAGE_ROOT, code_digest, code_modules, code_version

REPO = PACKAGE_ROOT.parent


@pytest.fixture
def repo_copy(tmp_path) -> Path:
    shutil.copytree(PACKAGE_ROOT, tmp_path / "nectar", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "README.md", tmp_path / "README.md")
    return tmp_path


def digests(root: Path) -> dict[str, str]:
    return {stage: code_digest(runner, root / "nectar") for stage, runner in STAGE_RUNNERS.items()}


def changed(before: dict[str, str], after: dict[str, str]) -> list[str]:
    return [s for s in before if before[s] != after[s]]


def test_a_copy_of_the_package_has_the_same_digests(repo_copy):
    assert digests(repo_copy) == digests(REPO)


def test_a_capture_statement_changes_targets_and_no_earlier_stage(repo_copy):
    before = digests(repo_copy)
    capture = repo_copy / "nectar" / "targets" / "capture.py"
    capture.write_text(capture.read_text() + "\nSCALE_ALPHA = 1.0001\n")
    after = digests(repo_copy)
    assert "targets" in changed(before, after)
    assert not {"chunk", "synthesize", "verify"} & set(changed(before, after))


def test_comments_docstrings_and_the_readme_change_nothing(repo_copy):
    before = digests(repo_copy)
    capture = repo_copy / "nectar" / "targets" / "capture.py"
    text = capture.read_text()
    head, _, rest = text.partition('"""')
    doc, _, body = rest.partition('"""')
    capture.write_text(head + '"""' + doc + " Reworded." + '"""' + body.replace("\n", "  # a comment\n", 3))
    readme = repo_copy / "README.md"
    readme.write_text(readme.read_text() + "\nA new paragraph.\n")
    assert digests(repo_copy) == before


def test_a_prompt_text_is_code_of_the_stages_that_send_it(repo_copy):
    before = digests(repo_copy)
    prompt = repo_copy / "nectar" / "prompts" / "synth_qa.txt"
    prompt.write_text(prompt.read_text() + "\nBe brief.\n")
    touched = changed(before, digests(repo_copy))
    assert "synthesize" in touched and "chunk" not in touched and "targets" not in touched


def test_stage_code_covers_the_modules_it_runs_and_not_the_plumbing():
    targets = code_modules(STAGE_RUNNERS["targets"])
    assert {"nectar.targets.capture", "nectar.stages.targets", "nectar.attention.doc_kv",
            "nectar.base_model"} <= set(targets)
    everything = {m for runner in STAGE_RUNNERS.values() for m in code_modules(runner)}
    assert not {m for m in everything if m.startswith(("nectar.storage", "nectar.orchestration",
                                                        "nectar.pipeline", "nectar.schemas.config"))}
    assert code_modules(STAGE_RUNNERS["chunk"]) == ["nectar.schemas.artifacts", "nectar.schemas.base",
                                                     "nectar.stages.chunk", "nectar.tables"]


def test_code_version_is_release_plus_digest():
    from nectar import __version__

    version = code_version(STAGE_RUNNERS["targets"])
    assert version == f"{__version__}+{code_digest(STAGE_RUNNERS['targets'])[:16]}"
