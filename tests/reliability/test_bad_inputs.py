"""The bad-input half of the matrix (docs/artifacts.md, "What goes wrong"): the real ``nectar`` command,
in this process. Each bad input must give ONE line on stderr that names the problem (and the limit
and the fix where there is one), no traceback, a non-zero exit code, and write nothing — all before
Prefect starts. ``--debug`` adds the traceback."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from matrix_helpers import cli, outputs

from nectar.documents import MAX_CONTROL_FRACTION


def _write(path: Path, data: bytes) -> str:
    path.write_bytes(data)
    return str(path)


# (row id, how to build the arguments from a tmp dir, what the one line must contain, exit code)
ROWS = [
    ("doc-empty", lambda t: ["run", _write(t / "e.txt", b"")], "is empty (0 bytes)", 2),
    ("doc-whitespace", lambda t: ["run", _write(t / "w.txt", b"  \n\t\n")], "is empty (only whitespace)", 2),
    ("doc-binary", lambda t: ["run", _write(t / "b.bin", b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" * 40)],
     "looks binary: NUL byte at offset 8", 2),
    ("doc-control-chars", lambda t: ["run", _write(t / "c.txt", b"\x01\x02\x03\x04 text " * 50)],
     f"control characters (limit {MAX_CONTROL_FRACTION:.0%})", 2),
    ("doc-not-utf8", lambda t: ["run", _write(t / "l.txt", "Café crème\n".encode("latin-1"))],
     "is not valid UTF-8: byte 0xe9 at offset 3", 2),
    ("doc-missing", lambda t: ["run", str(t / "nope.txt")], "does not exist", 2),
    # a directory is a corpus (one run per document inside): with --run-dir it is refused in one line
    ("doc-directory", lambda t: ["run", str(t)], "--run-dir applies to one document; a corpus gives each", 2),
    ("doc-url-missing", lambda t: ["run", "memory://nectar-matrix/none.txt"], "does not exist", 2),
    ("doc-pydoc-unknown", lambda t: ["run", "pydoc:no-such-topic"], "unknown pydoc topic 'no-such-topic'", 2),
    ("doc-too-long", lambda t: ["run", _write(t / "long.txt", b"The keeper wrote in the ledger. " * 1200)],
     "over the model's window of 4096 tokens", 2),
    ("preset-unknown", lambda t: ["run", "--preset", "huge"], "unknown preset 'huge'", 2),
    ("regime-unknown", lambda t: ["run", "--regime", "fast"], "unknown regime 'fast'", 2),
    ("override-unknown-key", lambda t: ["run", "--set", "train.bogus=1"], "train.bogus: unknown key", 2),
    ("override-bad-value", lambda t: ["run", "--set", "train.samples=lots"],
     "train.samples: Input should be a valid integer", 2),
    ("override-malformed", lambda t: ["run", "--set", "trainsamples"], "must look like section.key=value", 2),
    ("config-invalid", lambda t: ["run", "--set", "chunk.words=50", "--set", "chunk.overlap=60"],
     "chunk.overlap (60) must be smaller than chunk.words (50)", 2),
    ("config-file-missing", lambda t: ["run", "--config", str(t / "none.yaml")], "does not exist", 2),
    ("config-file-not-yaml", lambda t: ["run", "--config", _write(t / "bad.yaml", b"train: [unclosed\n")],
     "is not valid YAML", 2),
    ("stage-unknown", lambda t: ["run", "--from", "tokenize"], "unknown stage 'tokenize'", 2),
    ("stage-from-and-only", lambda t: ["run", "--from", "train", "--only", "train"], "either --from or --only", 2),
    ("model-path-missing", lambda t: ["run", "--set", f"model.name={t}/no-model"], "no such model folder", 2),
    ("model-unknown-tiny", lambda t: ["run", "--set", "model.name=tiny:gpt"], "unknown tiny model tiny:gpt", 2),
    ("only-without-inputs", lambda t: ["run", "--run-dir", str(t / "new"), "--only", "verify"],
     "--only verify needs the outputs of synthesize, which has not completed", 2),
    ("rundir-corrupt", lambda t: ["run", "--run-dir", str(_corrupt_run(t)), "--only", "chunk"],
     "run.json: field '<root>': Invalid JSON", 2),
    ("ask-not-a-run", lambda t: ["ask", str(t), "Who?"], "not a run directory (no run.json)", 2),
]


def _corrupt_run(t: Path) -> Path:
    (t / "corrupt").mkdir()
    (t / "corrupt" / "run.json").write_text("{not json")
    return t / "corrupt"


def _one_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr
    return lines[0]


@pytest.mark.parametrize("row", ROWS, ids=[r[0] for r in ROWS])
def test_bad_input_is_one_line_and_writes_nothing(row, tmp_path):
    _, make_args, fragment, code = row
    args = make_args(tmp_path)
    if args[0] == "run":
        args += [] if "--preset" in args else ["--preset", "tiny"]
        args += [] if "--run-dir" in args else ["--run-dir", str(tmp_path / "run")]
    before = sorted(p.name for p in tmp_path.iterdir())
    exit_code, _, stderr = cli(args)
    line = _one_line(stderr)
    assert exit_code == code and line.startswith("error: ") and fragment in line, (exit_code, line)
    assert not (tmp_path / "run").exists()  # nothing written
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_debug_shows_the_traceback(tmp_path):
    empty = _write(tmp_path / "e.txt", b"")
    exit_code, _, stderr = cli(["run", empty, "--preset", "tiny", "--debug"])
    assert exit_code == 2 and "Traceback (most recent call last)" in stderr and "DocumentError" in stderr
    assert stderr.strip().splitlines()[-1] == f"error: document {empty} is empty (0 bytes)"


def test_run_directory_of_another_document_is_refused_and_untouched(run_copy, tmp_path):
    other = _write(tmp_path / "other.txt", b"A different manual about ledgers and keepers. " * 20)
    before = outputs(run_copy)
    exit_code, _, stderr = cli(["run", other, "--preset", "tiny", "--run-dir", run_copy])
    line = _one_line(stderr)
    assert exit_code == 2 and "holds a run of another document (pydoc-naming-" in line and "other-" in line
    assert outputs(run_copy) == before
    exit_code, _, stderr = cli(["run", other, "--preset", "tiny", "--run-dir", run_copy, "--only", "train"])
    assert exit_code == 2 and "holds a run of another document" in _one_line(stderr)


def _edit_spec(run_dir: str, **changes) -> None:
    """Edit the spec of the state that answers: the live one (state/<sha16>/), or train/ in older runs."""
    live = Path(run_dir) / "state" / "live.json"
    folder = Path(run_dir) / json.loads(live.read_text())["dir"] if live.exists() else Path(run_dir) / "train"
    spec = folder / "module.json"
    data = json.loads(spec.read_text())
    data.update(changes)
    spec.write_text(json.dumps(data))


@pytest.mark.parametrize("which", ["document", "model"])
def test_ask_refuses_a_module_of_another_document_or_model(run_copy, which):
    # the module folder of another run, as far as the checks can tell: its spec names another
    # document (sha256) or another base model (weights hash)
    if which == "document":
        _edit_spec(run_copy, doc_sha256="0" * 64)
        fragment = "module was trained for document sha256 000000000000…"
    else:
        _edit_spec(run_copy, base_model_hash="feedfacefeedface")
        fragment = "module was trained for base model 'tiny:llama' (weights hash feedfacefeedface)"
    exit_code, stdout, stderr = cli(["ask", run_copy, "Who binds names?"])
    line = _one_line(stderr)
    assert exit_code == 2 and fragment in line and stdout == ""


def test_ask_without_a_trained_module(run_copy):
    shutil.rmtree(Path(run_copy) / "train")
    shutil.rmtree(Path(run_copy) / "state", ignore_errors=True)  # nor a first state (issue 39's live pointer)
    exit_code, _, stderr = cli(["ask", run_copy, "Who binds names?"])
    assert exit_code == 2 and "no state to answer with yet" in _one_line(stderr)
