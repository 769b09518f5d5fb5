"""synthesize: parsing every reply shape, rows for every request, resume after a kill, bad servers."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from stage_helpers import Counting, CrashAfter, Recording, SimulatedKill

from nectar.llm import ChatResult, LLMUnavailableError
from nectar.llm.local import LocalBackend
from nectar.llm.openai_backend import OpenAIBackend
from nectar.base_model import load_base_model
from nectar.schemas.artifacts import PairRow
from nectar.schemas.config import TASK_TYPES, ChunkConfig, LLMConfig, ModelConfig, SynthesizeConfig
from nectar.stages.chunk import chunk_document
from nectar.stages.synthesize import _seed, parse_pairs, rows_from_result, synthesize
from nectar.tables import read_table

TEXT = " ".join(f"Rule {i}: a name bound in block {i % 7} is local to that block." for i in range(60))
CFG = SynthesizeConfig(counts={"qa": 2, "summarization": 1, "quoting": 0, "paraphrasing": 1}, max_chunks=2,
                       llm=LLMConfig(max_new_tokens=24, temperature=0.7, top_p=1.0, batch_size=4))


@pytest.fixture(scope="module")
def tiny_backend():
    # The tiny model's ops are too small to gain from a second thread, and on a shared 2-core
    # machine spin-waiting OpenMP threads can make them 10x slower. Restored afterwards.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield LocalBackend(load_base_model(ModelConfig(name="tiny:llama")), batch_size=4)
    torch.set_num_threads(before)


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # see tiny_backend; also true for the embedded model on shared cores
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def chunks():
    return chunk_document(TEXT, ChunkConfig(words=120, overlap=20))


def result(text: str, finish: str = "stop", error: str | None = None) -> ChatResult:
    return ChatResult(text=text, error=error, finish_reason=finish)


# ----- parsing -----

def test_parse_structured_object():
    text = '{"scratchpad": "- a\\n- b", "pairs": [{"instruction": "What is a?", "response": "A."}, ' \
           '{"instruction": "What is b?", "response": "B."}]}'
    assert parse_pairs(result(text)) == ([("What is a?", "A."), ("What is b?", "B.")], None)


def test_parse_paper_plain_form_with_scratchpad():
    text = ("<scratchpad>\n- names are bound [by assignment]\n</scratchpad>\n"
            '[{"instruction": "How are names bound?", "response": "By assignment."}]')
    assert parse_pairs(result(text)) == ([("How are names bound?", "By assignment.")], None)


def test_parse_aliases_and_partially_bad_items():
    text = '[{"question": "Q1?", "answer": "A1"}, {"instruction": "Q2?", "response": ""}]'
    pairs, error = parse_pairs(result(text))
    assert pairs == [("Q1?", "A1")] and "item(s) [1] lack" in error


def test_parse_truncated_reply_salvages_complete_items():
    text = '{"scratchpad": "x", "pairs": [{"instruction": "Q1?", "response": "A1"}, {"instruction": "Q2?", "resp'
    pairs, error = parse_pairs(result(text, finish="length"))
    assert pairs == [("Q1?", "A1")] and error is None


@pytest.mark.parametrize("text,finish,error,expect", [
    ("I cannot help with that.", "stop", None, "no JSON list"),
    ('{"scratchpad": "only notes, cut', "length", None, "cut off at max_new_tokens"),
    ("", "error", "server answered 500", "request failed: server answered 500"),
])
def test_unparseable_reply_is_one_error_row(text, finish, error, expect):
    rows = rows_from_result(3, "qa", result(text, finish, error))
    assert len(rows) == 1
    row = rows[0]
    assert row.pair_id == "c3-qa-0" and row.instruction == row.response == "" and expect in row.parse_error
    assert row.raw_output == text


# ----- the stage on a real (tiny) model -----

def test_synthesize_tiny_model_writes_a_row_for_every_request(tmp_path, tiny_backend, chunks):
    seen = []
    counts = synthesize(chunks, CFG, tiny_backend, str(tmp_path), progress=lambda d, t: seen.append((d, t)))
    rows = read_table(str(tmp_path / "pairs.parquet"), PairRow)
    assert counts["requests"] == 2 * 3 and counts["chunks"] == 2
    assert counts["pairs"] + counts["parse_failures"] == len(rows)
    assert counts["pairs"] == sum(counts["pairs_by_task"].values())
    assert len({r.pair_id for r in rows}) == len(rows)
    # every (chunk, task) request left at least one row: pairs or a recorded parse error
    assert {(r.chunk_id, r.task) for r in rows} == {(c, t) for c in (0, 1) for t in ("qa", "summarization",
                                                                                     "paraphrasing")}
    assert all(r.raw_output for r in rows)  # raw model output kept beside the parsed fields
    assert seen[-1] == (6, 6)
    assert not (tmp_path / "partial").exists()


def test_resume_after_crash_redoes_only_unfinished_requests_with_fake_crash(tmp_path, tiny_backend, chunks):
    """Resume contract (as in verify): finished requests are not asked again and their rows are kept
    byte for byte; the rest are the rows of what the backend answered on the re-run. A resumed run is
    not promised to equal an uninterrupted one: batch composition changes batched float kernels."""
    run_dir = tmp_path / "run"
    crashing = Recording(CrashAfter(tiny_backend, 4))
    with pytest.raises(SimulatedKill):
        synthesize(chunks, CFG, crashing, str(run_dir))
    assert len(list((run_dir / "partial").glob("*.parquet"))) == 4 and not (run_dir / "pairs.parquet").exists()
    again = Recording(tiny_backend)
    counts = synthesize(chunks, CFG, again, str(run_dir))
    assert again.requests == 2 and counts["resumed_requests"] == 4
    assert len(crashing.delivered) == 4 and not set(crashing.delivered) & set(again.delivered)
    delivered = {**crashing.delivered, **again.delivered}
    expect = [row for c in chunks[:2] for task in TASK_TYPES if CFG.counts.get(task, 0)
              for row in rows_from_result(c.chunk_id, task, delivered[_seed(CFG.llm.seed, c.chunk_id, task)])]
    assert read_table(str(run_dir / "pairs.parquet"), PairRow) == expect


def test_changed_config_discards_stale_partial_results(tmp_path, tiny_backend, chunks):
    with pytest.raises(SimulatedKill):
        synthesize(chunks, CFG, CrashAfter(tiny_backend, 2), str(tmp_path))
    other = CFG.model_copy(update={"llm": CFG.llm.model_copy(update={"seed": 1})})
    again = Counting(tiny_backend)
    synthesize(chunks, other, again, str(tmp_path))
    assert again.requests == 6  # nothing reused from the run with the other seed


def test_unreachable_server_raises_and_keeps_partial_work(tmp_path, chunks):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dead = OpenAIBackend(f"http://127.0.0.1:{port}/v1", "m", max_retries=1)
    with pytest.raises(LLMUnavailableError, match=f"127.0.0.1:{port}"):
        synthesize(chunks, CFG, dead, str(tmp_path))
    assert not (tmp_path / "pairs.parquet").exists()


def test_nothing_to_do_is_a_clear_error(tmp_path, tiny_backend, chunks):
    cfg = SynthesizeConfig(counts={"qa": 0, "summarization": 0, "quoting": 0, "paraphrasing": 0})
    with pytest.raises(ValueError, match="every synthesize.counts entry is 0"):
        synthesize(chunks, cfg, tiny_backend, str(tmp_path))


CHILD = """
import sys, torch
torch.set_num_threads(1)
from nectar.llm.local import LocalBackend
from nectar.base_model import load_base_model
from nectar.schemas.config import ChunkConfig, ModelConfig
from nectar.stages.chunk import chunk_document
sys.path.insert(0, {tests!r})
from test_synthesize import CFG, TEXT
from nectar.stages.synthesize import synthesize
cfg = CFG.model_copy(update={{"llm": CFG.llm.model_copy(update={{"batch_size": 1}})}})
synthesize(chunk_document(TEXT, ChunkConfig(words=120, overlap=20)), cfg,
           LocalBackend(load_base_model(ModelConfig(name="tiny:llama")), batch_size=1), {out!r})
"""


@pytest.mark.slow
def test_sigkill_during_synthesize_then_rerun_completes(tmp_path, tiny_backend, chunks):
    """A real process is SIGKILLed mid-stage; the rerun finishes from its partial files."""
    out = tmp_path / "synth"
    code = CHILD.format(tests=str(Path(__file__).parent), out=str(out))
    proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    deadline = time.monotonic() + 240
    while len(list((out / "partial").glob("*.parquet"))) < 2:
        assert proc.poll() is None, "child finished or died before it could be killed"
        assert time.monotonic() < deadline
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    finished = len(list((out / "partial").glob("*.parquet")))
    assert 2 <= finished < 6 and not (out / "pairs.parquet").exists()
    again = Counting(tiny_backend)
    counts = synthesize(chunks, CFG, again, str(out))
    assert again.requests == 6 - finished and counts["resumed_requests"] == finished
    rows = read_table(str(out / "pairs.parquet"), PairRow)
    assert {(r.chunk_id, r.task) for r in rows} == {(c, t) for c in (0, 1) for t in ("qa", "summarization",
                                                                                     "paraphrasing")}


@pytest.mark.slow
def test_synthesize_embedded_model_produces_real_pairs(tmp_path, one_thread):
    """SmolLM2-135M with xgrammar-constrained output on a real manual section: pairs that parse."""
    from nectar.documents import load_document

    text, _ = load_document("pydoc:naming")
    chunks = chunk_document(text, ChunkConfig(words=150, overlap=20))[:1]
    cfg = SynthesizeConfig(counts={"qa": 1, "summarization": 0, "quoting": 0, "paraphrasing": 1},
                           llm=LLMConfig(max_new_tokens=200, temperature=0.7, top_p=0.95, batch_size=2))
    backend = LocalBackend(load_base_model(ModelConfig()), batch_size=2)
    counts = synthesize(chunks, cfg, backend, str(tmp_path))
    rows = read_table(str(tmp_path / "pairs.parquet"), PairRow)
    good = [r for r in rows if r.parse_error is None]
    assert counts["pairs"] == len(good) >= 1, [r.raw_output for r in rows]
    assert all(len(r.instruction) > 5 and r.response for r in good)
    assert all(r.raw_output.lstrip().startswith('{"scratchpad":') for r in rows)  # scratchpad first
