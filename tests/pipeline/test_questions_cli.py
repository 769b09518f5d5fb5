"""``--questions FILE`` on the command line: a bad file is one line naming its line and the problem,
before anything loads or runs (nectar run and nectar compare)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _nectar(*args, cwd):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "nectar.pipeline.cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_bad_questions_file_is_one_line_naming_the_line(tmp_path):
    bad = tmp_path / "q.jsonl"
    bad.write_text('{"question": "Where are free variables resolved?"}\n{"question": "What is a block?", "answer": 7}\n')
    for args in (["run", "pydoc:naming", "--preset", "tiny", "--run-dir", str(tmp_path / "run")],
                 ["compare", str(tmp_path / "no-run")]):
        done = _nectar(*args, "--questions", str(bad), cwd=tmp_path)
        assert done.returncode == 2, done.stderr
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and "line 2" in lines[0] and '"answer" must be a non-empty string, got 7' in lines[0]
        assert not (tmp_path / "run").exists()  # refused before any run directory was made


def test_the_example_questions_file_reads():
    from nectar.evaluation.questions import read_questions

    q = read_questions(str(ROOT / "docs" / "examples" / "naming-questions.jsonl"))
    assert len(q.rows) == 18 and sum(row.answer is None for _, row in q.rows) == 4
