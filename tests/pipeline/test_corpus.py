"""The corpus command's pure parts: expanding arguments and manifests into documents (a bad entry is
one line naming it), and what a run directory's state asks for (skip / retry / start).

The skip / retry behaviour end to end (real tiny runs) is test_corpus_run.py; several hosts,
test_corpus_hosts.py."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from nectar.orchestration.corpus import CorpusError, DocProgress, action, expand, is_manifest, read_manifest
from nectar.pipeline.corpus import corpus_name, is_corpus


@pytest.fixture
def docs(tmp_path: Path) -> Path:
    folder = tmp_path / "docs"
    folder.mkdir()
    for name in ("b.txt", "a.txt", "c.rst"):
        (folder / name).write_text(f"text of {name}\n")
    (folder / ".hidden").write_text("x")
    return folder


def test_directory_glob_and_files_expand_in_order_each_once(docs: Path):
    entries = expand([str(docs), str(docs / "*.txt"), str(docs / "a.txt"), "pydoc:naming"])
    assert [Path(e.document).name if "/" in e.document else e.document for e in entries] == \
        ["a.txt", "b.txt", "c.rst", "pydoc:naming"]  # sorted directory, then the glob's and file's repeats dropped


def test_jsonl_manifest_paths_are_relative_to_it_and_carry_run_dir_and_overrides(docs: Path):
    manifest = docs.parent / "corpus.jsonl"
    manifest.write_text("# the corpus\n" + json.dumps({"document": "docs/a.txt"}) + "\n\n"
                        + json.dumps({"document": str(docs / "b.txt"), "run_dir": "/r/b",
                                      "set": ["train.samples=10"]}) + "\n")
    a, b = read_manifest(str(manifest))
    assert a.document == str(docs / "a.txt") and a.run_dir is None and a.origin.endswith("corpus.jsonl:2")
    assert b.run_dir == "/r/b" and b.overrides == ("train.samples=10",)
    assert [e.document for e in expand([str(manifest)])] == [a.document, b.document]


def test_plain_and_yaml_manifests(docs: Path):
    plain = docs.parent / "corpus.manifest"
    plain.write_text("docs/a.txt\n  # skipped\ndocs/c.rst\n")
    assert [Path(e.document).name for e in read_manifest(str(plain))] == ["a.txt", "c.rst"]
    yml = docs.parent / "corpus.yaml"
    yml.write_text("- docs/b.txt\n- {document: docs/a.txt, run_dir: /r/a}\n")
    b, a = read_manifest(str(yml))
    assert Path(b.document).name == "b.txt" and a.run_dir == "/r/a"


@pytest.mark.parametrize("line, expected", [
    ('{"document": "docs/a.txt"', "corpus.jsonl line 2: not JSON"),
    ('["docs/a.txt"]', "corpus.jsonl line 2: expected a document URI or a mapping, got list"),
    ('{"doc": "docs/a.txt"}', "corpus.jsonl line 2: unknown key(s) doc"),
    ('{"document": 3}', "corpus.jsonl line 2: 'document' is missing or not a string"),
    ('{"document": "docs/nope.txt"}', "corpus.jsonl line 2: "),
    ('{"document": "docs/a.txt", "set": ["train.samples"]}', "corpus.jsonl line 2: 'set' must be a list"),
])
def test_a_malformed_manifest_entry_is_one_line_naming_it(docs: Path, line: str, expected: str):
    manifest = docs.parent / "corpus.jsonl"
    manifest.write_text(json.dumps({"document": "docs/b.txt"}) + "\n" + line + "\n")
    with pytest.raises(CorpusError) as err:
        expand([str(manifest)])
    message = str(err.value)
    assert expected in message and "\n" not in message, message
    if "nope" in line:
        assert "docs/nope.txt does not exist" in message


def test_arguments_that_name_nothing_fail_with_the_fix(tmp_path: Path):
    with pytest.raises(CorpusError, match="matches no file"):
        expand([str(tmp_path / "*.txt")])
    (tmp_path / "empty").mkdir()
    with pytest.raises(CorpusError, match="holds no document"):
        expand([str(tmp_path / "empty")])
    with pytest.raises(CorpusError, match="no such file"):
        expand([str(tmp_path / "missing.txt")])
    yml = tmp_path / "c.yaml"
    yml.write_text("document: a.txt\n")
    with pytest.raises(CorpusError, match="expected a YAML list"):
        expand([str(yml)])


def test_actions_from_a_run_directory_state():
    assert action(DocProgress("done", stages_done=6)) == "skip"
    assert action(DocProgress("failed", "synthesize", "ConnectError")) == "retry"
    assert action(DocProgress("partial", "train")) == "start"
    assert action(DocProgress("new", "chunk")) == "start"


def test_what_counts_as_a_corpus(docs: Path):
    assert not is_corpus(None) and not is_corpus(["pydoc:naming"]) and not is_corpus([str(docs / "a.txt")])
    assert is_corpus([str(docs)]) and is_corpus([str(docs / "*.txt")]) and is_corpus(["a", "b"])
    assert is_corpus(["x.jsonl"]) and is_manifest("x.yml") and not is_corpus(["s3://b/x.txt"])
    assert corpus_name([str(docs)]) == "docs" and corpus_name(["a", "b"]).startswith("corpus-")


@pytest.mark.slow
def test_deploy_keeps_one_crash_automation_and_updates_its_window(prefect_server):
    """`nectar deploy` twice: one `nectar-crashed-runs` automation, its window the latest (the
    behaviour — a dead host's run marked Crashed and retried — is test_corpus_hosts.py)."""
    from prefect.automations import Automation
    from prefect.client.orchestration import get_client

    from nectar.pipeline import deploy as dep

    dep.ensure_crash_detection(600)
    dep.ensure_crash_detection(90)
    with get_client(sync_client=True) as client:
        found = client.read_automations_by_name(dep.CRASH_AUTOMATION)
    assert len(found) == 1
    auto = Automation.read(name=dep.CRASH_AUTOMATION)
    assert auto.trigger.within.total_seconds() == 90 and auto.trigger.posture.value == "Proactive"
    assert auto.trigger.after == {"prefect.flow-run.heartbeat"} and auto.actions[0].state.value == "CRASHED"
