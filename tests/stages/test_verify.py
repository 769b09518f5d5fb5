"""verify: verdict rules, duplicates skipped before any request, floor, splits, challenge (real MiniLM), the whole stage on the tiny
model (prefix reuse, resume, failures) and the too-long-document refusal."""
from __future__ import annotations

import socket

import pytest
import torch
from stage_helpers import Counting, CrashAfter, Recording, SimulatedKill

from nectar.layout import ContextTooLongError
from nectar.llm import ChatResult, LLMUnavailableError
from nectar.llm.local import LocalBackend
from nectar.llm.openai_backend import OpenAIBackend
from nectar.base_model import embedder_path, load_base_model
from nectar.schemas.artifacts import DatasetRow, PairRow
from nectar.schemas.config import LLMConfig, ModelConfig, VerifyConfig
from nectar.stages.verify import (VerifyError, _seed, apply_floor, first_of_each_instruction, mark_challenge, parse_judgment,
                                  split_rows, verify)
from nectar.tables import read_table

DOC = ("Names refer to objects. Names are introduced by name binding operations. A block is a piece of "
       "Python program text that is executed as a unit. A scope defines the visibility of a name within a "
       "block. When a name is not found at all, a NameError exception is raised. ") * 3
QUESTIONS = [
    ("qa", "What do names refer to in Python?", "Objects."),
    ("qa", "What exception is raised when a name is not found?", "NameError."),
    ("qa", "What is a block in Python?", "Program text executed as a unit."),
    ("summarization", "Summarize how Python defines scopes.", "A scope defines where a name is visible."),
    ("quoting", "Quote the definition of a block.", "A block is a piece of Python program text."),
    ("paraphrasing", "Paraphrase the rule about name binding.", "Binding operations introduce names."),
    ("qa", "What do names refer to in Python", "To objects."),  # a duplicate of the first
    ("qa", "Which operations introduce names?", "INSUFFICIENT_CONTEXT"),
    ("qa", "How is the visibility of a name defined?", "By its scope."),
    ("qa", "What happens with an unbound name?", "A NameError is raised."),
]
TINY_LLM = dict(backend="local", batch_size=4, temperature=1.0, top_p=1.0)
CFG = VerifyConfig(answer_llm=LLMConfig(**{**TINY_LLM, "temperature": 0.0}, max_new_tokens=6),
                   judge=LLMConfig(**TINY_LLM, max_new_tokens=100), min_kept=4, challenge_size=1)


def make_pairs() -> list[PairRow]:
    rows = [PairRow(pair_id=f"c0-{t}-{k}", chunk_id=0, task=t, instruction=q, response=a, raw_output="{...}")
            for k, (t, q, a) in enumerate(QUESTIONS)]
    rows.append(PairRow(pair_id="c1-qa-0", chunk_id=1, task="qa", instruction="", response="", raw_output="junk",
                        parse_error="no JSON list of {instruction, response} pairs in the reply"))
    return rows


@pytest.fixture(scope="module")
def tiny_backend():
    # The tiny model's ops are too small to gain from a second thread, and on a shared 2-core
    # machine spin-waiting OpenMP threads can make them 10x slower. Restored afterwards.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield LocalBackend(load_base_model(ModelConfig(name="tiny:llama")), batch_size=4)
    torch.set_num_threads(before)


def drow(pid: str, instruction: str, verdict: str, confidence: float | None = 0.9, **kw) -> DatasetRow:
    kept = verdict == "consistent"
    return DatasetRow(pair_id=pid, chunk_id=0, task="qa", instruction=instruction, response="r", full_answer="f",
                      judge_raw="{}", is_consistent=verdict != "inconsistent", confidence=confidence,
                      reasoning="", verdict=verdict, kept=kept, split="train" if kept else "dropped", **kw)


# ----- pure rules -----

@pytest.mark.parametrize("text,expect", [
    ('{"is_consistent": true, "confidence": 0.8, "reasoning": "same"}', (True, 0.8, None)),
    ('Evaluation:\n```json\n{"is_consistent": "false", "confidence": "0.3", "reasoning": "x"}\n```', (False, 0.3, None)),
    ('{"is_consistent": true, "confidence": 85}', (True, 0.85, None)),
    ('{"is_consistent": "maybe", "confidence": 0.5}', (None, None, "not true/false")),
    ('{"is_consistent": true, "confidence": 7000}', (True, None, "not in [0, 1]")),
    ("The responses look consistent to me.", (None, None, "no JSON object")),
])
def test_parse_judgment(text, expect):
    j = parse_judgment(text)
    assert (j.is_consistent, j.confidence) == expect[:2]
    assert (j.error is None) if expect[2] is None else (expect[2] in j.error)


def test_duplicates_are_the_later_pairs_with_the_same_normalised_instruction():
    pairs = [PairRow(pair_id=pid, chunk_id=0, task="qa", instruction=q, response="r", raw_output="{}")
             for pid, q in [("a", "What is a Scope?"), ("b", "what is a  scope"), ("c", "What is a block?"),
                            ("d", "What is a scope?!"), ("e", "What is a scope of a name?")]]
    unique, duplicate_of = first_of_each_instruction(pairs)
    assert [p.pair_id for p in unique] == ["a", "c", "e"]
    assert duplicate_of == {"b": "a", "d": "a"}


def test_floor_keeps_most_confident_low_confidence_rows():
    rows = [drow("a", "q1", "consistent"), drow("b", "q2", "low_confidence", 0.6), drow("c", "q3", "low_confidence", 0.2),
            drow("d", "q4", "low_confidence", 0.4), drow("e", "q5", "inconsistent", 0.99)]
    out, n = apply_floor(rows, 3)
    assert n == 2 and [r.pair_id for r in out if r.kept] == ["a", "b", "d"]
    assert [r.kept_by_floor for r in out] == [False, True, False, True, False]
    assert apply_floor(rows, 1) == (rows, 0)


def test_split_is_seeded_80_20_and_leaves_dropped_rows_alone():
    rows = [drow(f"p{i}", f"q{i}", "consistent") for i in range(20)] + [drow("x", "qx", "inconsistent")]
    a, b, c = split_rows(rows, 0.2, 0), split_rows(rows, 0.2, 0), split_rows(rows, 0.2, 1)
    assert [r.split for r in a] == [r.split for r in b] != [r.split for r in c]
    assert sum(r.split == "test" for r in a) == 4 and sum(r.split == "train" for r in a) == 16
    assert a[-1].split == "dropped"
    two = split_rows(rows[:2], 0.2, 0)
    assert sorted(r.split for r in two) == ["test", "train"]  # both splits non-empty when possible


def test_challenge_is_the_least_similar_test_instructions_with_real_minilm():
    train = ["What exception is raised for an unknown name?", "What does a scope define?",
             "How are names bound to objects?"]
    test = ["Which exception is raised when a name is unknown?", "What is the boiling point of water at sea level?",
            "What does the scope of a name define?"]
    rows = [drow(f"t{i}", q, "consistent") for i, q in enumerate(train)]
    rows += [drow(f"s{i}", q, "consistent").model_copy(update={"split": "test"}) for i, q in enumerate(test)]
    out = mark_challenge(rows, 1, embedder_path())
    assert [r.pair_id for r in out if r.challenge] == ["s1"]  # the off-topic question
    sims = {r.pair_id: r.max_train_similarity for r in out if r.split == "test"}
    assert sims["s1"] < 0.3 < sims["s0"] and sims["s2"] > 0.5
    assert all(r.max_train_similarity is None for r in out if r.split == "train")
    # Asked for more than the test split holds: at most half of it, the least similar first.
    assert [r.pair_id for r in mark_challenge(rows, 10, embedder_path()) if r.challenge] == ["s1"]


# ----- the stage on the tiny model -----

def test_verify_tiny_model_end_to_end(tmp_path, tiny_backend):
    pairs = make_pairs()
    answer = LocalBackend(tiny_backend.base, batch_size=4)
    counts = verify(DOC, pairs, CFG, answer, tiny_backend, embedder_path(), str(tmp_path))
    rows = read_table(str(tmp_path / "dataset.parquet"), DatasetRow)
    assert [r.pair_id for r in rows] == [p.pair_id for p in pairs]  # every pair, dropped ones included
    by_id = {r.pair_id: r for r in rows}
    assert by_id["c1-qa-0"].verdict == "synthesis_parse_error" and by_id["c1-qa-0"].split == "dropped"
    assert by_id["c0-qa-7"].verdict == "insufficient_context" and by_id["c0-qa-7"].judge_raw == ""
    assert all(r.full_answer for r in rows if r.verdict not in ("synthesis_parse_error", "duplicate"))
    assert sum(counts["verdicts"].values()) == len(rows) == counts["kept"] + counts["dropped"]
    # the duplicate (c0-qa-6 repeats c0-qa-0) is neither answered nor judged
    assert by_id["c0-qa-6"].verdict == "duplicate" and by_id["c0-qa-6"].full_answer == by_id["c0-qa-6"].judge_raw == ""
    assert "c0-qa-0" in by_id["c0-qa-6"].reasoning and not by_id["c0-qa-6"].kept
    assert counts["duplicates_skipped"] == 1 and counts["verdicts"]["duplicate"] == 1
    assert counts["answer_requests"] == 9 and counts["judge_requests"] == 8
    kept = [r for r in rows if r.kept]
    assert len(kept) == counts["kept"] == counts["train"] + counts["test"] and all(r.split != "dropped" for r in kept)
    assert all(not r.kept and r.split == "dropped" for r in rows if r.verdict not in ("consistent", "low_confidence"))
    assert counts["kept"] >= min(CFG.min_kept, counts["verdicts"].get("consistent", 0)
                                 + counts["verdicts"].get("low_confidence", 0))
    assert counts["challenge"] == min(1, counts["test"])
    # the document was prefilled once for all nine answers
    assert answer.prefixes.misses == 1 and answer.prefill_tokens < 250 + 9 * 40
    assert not (tmp_path / "partial").exists()


def test_resume_after_crash_with_fake_crash(tmp_path, tiny_backend):
    """The resume contract: nothing finished is asked again, finished replies are kept byte for byte,
    and the unfinished ones are whatever the backend answers for exactly those requests.

    It is NOT promised that a resumed run equals an uninterrupted one: the resumed batches hold other
    requests, and batched float kernels (padding, GEMM blocking) change the random tiny model's
    output with batch composition on some processors. Each side of the contract is checked here."""
    pairs = make_pairs()
    verify(DOC, pairs, CFG, tiny_backend, tiny_backend, embedder_path(), str(tmp_path / "ref"))
    ref = {r.pair_id: r for r in read_table(str(tmp_path / "ref" / "dataset.parquet"), DatasetRow)}
    run = tmp_path / "run"
    crashing = Recording(CrashAfter(tiny_backend, 3))
    with pytest.raises(SimulatedKill):
        verify(DOC, pairs, CFG, tiny_backend, crashing, embedder_path(), str(run))
    assert (run / "partial" / "answers").exists() and not (run / "dataset.parquet").exists()
    assert len(crashing.delivered) == 3
    answer, judge = Counting(tiny_backend), Recording(tiny_backend)
    verify(DOC, pairs, CFG, answer, judge, embedder_path(), str(run))
    assert answer.requests == 0 and judge.requests == 8 - 3  # nothing finished is asked again
    assert not set(judge.delivered) & set(crashing.delivered)
    rows = read_table(str(run / "dataset.parquet"), DatasetRow)
    assert [r.pair_id for r in rows] == list(ref)  # every pair, in order, dropped ones included
    got = {r.pair_id: r for r in rows}
    pair_of_seed = {_seed(CFG.judge.seed, p.pair_id): p.pair_id for p in pairs}
    for seed, result in {**crashing.delivered, **judge.delivered}.items():
        assert got[pair_of_seed[seed]].judge_raw == result.text  # finished replies byte for byte, the rest as answered
    # the answers all finished before the crash, in the same batches as the reference run's
    assert all(got[p].full_answer == ref[p].full_answer for p in ref)


class FailingJudge(Counting):
    """Failure injection: the judge returns an error result for every second request."""

    def chat_many(self, requests, progress=None, on_result=None):
        out = []
        for i, _ in enumerate(requests):
            r = ChatResult(text="", error="server answered 500: boom", finish_reason="error") if i % 2 else \
                ChatResult(text='{"is_consistent": true, "confidence": 0.9, "reasoning": "ok"}')
            on_result(i, r)
            out.append(r)
        return out


def test_failed_judge_requests_fail_the_stage_and_are_retried_with_fake_failing_judge(tmp_path, tiny_backend):
    pairs = make_pairs()
    with pytest.raises(VerifyError, match=r"4 of 8 judge request\(s\) failed .*server answered 500"):
        verify(DOC, pairs, CFG, tiny_backend, FailingJudge(tiny_backend), embedder_path(), str(tmp_path))
    judge = Counting(tiny_backend)
    verify(DOC, pairs, CFG, tiny_backend, judge, embedder_path(), str(tmp_path))
    assert judge.requests == 4


def test_unreachable_judge_raises_and_keeps_answers(tmp_path, tiny_backend):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dead = OpenAIBackend(f"http://127.0.0.1:{port}/v1", "judge", max_retries=0)
    with pytest.raises(LLMUnavailableError, match=f"127.0.0.1:{port}"):
        verify(DOC, make_pairs(), CFG, tiny_backend, dead, embedder_path(), str(tmp_path))
    assert list((tmp_path / "partial" / "answers").glob("*.parquet"))


def test_document_longer_than_the_answer_window_is_refused_before_any_request(tmp_path, tiny_backend):
    counting = Counting(tiny_backend)
    long_doc = "word " * 5000
    with pytest.raises(ContextTooLongError, match=r"over the answer model's window of 4096 tokens"):
        verify(long_doc, make_pairs(), CFG, counting, counting, embedder_path(), str(tmp_path))
    assert counting.requests == 0


@pytest.mark.slow
def test_verify_embedded_model_on_a_real_document(tmp_path):
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # shared cores: see tiny_backend
    try:
        _verify_embedded(tmp_path)
    finally:
        torch.set_num_threads(before)


def _verify_embedded(tmp_path):
    """SmolLM2-135M answers with the whole pydoc:naming section (one prefix prefill) and judges."""
    from nectar.documents import load_document

    doc, _ = load_document("pydoc:naming")
    pairs = make_pairs()[:3]
    llm = dict(backend="local", batch_size=3, temperature=0.0)
    cfg = VerifyConfig(answer_llm=LLMConfig(**llm, max_new_tokens=16), judge=LLMConfig(**llm, max_new_tokens=90),
                       min_kept=2, challenge_size=1)
    base = load_base_model(ModelConfig())
    answer, judge = LocalBackend(base, batch_size=3), LocalBackend(base, batch_size=3)
    counts = verify(doc, pairs, cfg, answer, judge, embedder_path(), str(tmp_path))
    rows = read_table(str(tmp_path / "dataset.parquet"), DatasetRow)
    assert len(rows) == 3 and answer.prefixes.misses == 1  # the document was prefilled once
    assert all(r.full_answer.strip() for r in rows)
    judged = [r for r in rows if r.verdict not in ("insufficient_context",)]
    assert all(r.judge_raw.startswith('{"is_consistent":') for r in judged)  # constrained judge output
    assert counts["verdicts"].get("judge_parse_error", 0) == 0
    assert counts["kept"] >= min(2, sum(r.verdict in ("consistent", "low_confidence") for r in rows))


# ----- verify.method = evidence: judge-free, scored on the base model -----

def _evidence_scorer(base):
    from nectar.attention.doc_kv import prefill_document
    from nectar.attention.exact import ExactDocState
    from nectar.evaluation.evidence import document_gain
    from nectar.layout import build_layout

    layout = build_layout(base.tokenizer, DOC)
    full = ExactDocState(prefill_document(base, layout.context_ids))
    return lambda items: document_gain(base, layout, full, items, max_tokens=96)


def test_evidence_verifier_on_the_tiny_model_keeps_by_gain_and_never_asks_a_judge(tmp_path, tiny_backend):
    pairs = make_pairs()
    scorer = _evidence_scorer(tiny_backend.base)
    gains = scorer([(p.pair_id, p.instruction, p.response) for p in pairs if p.parse_error is None])
    ranked = sorted(gains.values(), key=lambda s: s.gain)
    # a bar between the gains: the pairs above it pass on their own, the floor tops up by gain
    bar = (ranked[3].gain + ranked[4].gain) / 2
    cfg = CFG.model_copy(update={"method": "evidence", "min_gain": bar, "min_agreement": 0.0, "min_kept": 7})
    counts = verify(DOC, pairs, cfg, LocalBackend(tiny_backend.base, batch_size=4), None, embedder_path(),
                    str(tmp_path), scorer=scorer)
    rows = {r.pair_id: r for r in read_table(str(tmp_path / "dataset.parquet"), DatasetRow)}
    assert counts["judge_requests"] == 0 and all(r.judge_raw == "" for r in rows.values())
    assert rows["c0-qa-6"].verdict == "duplicate" and rows["c0-qa-7"].verdict == "insufficient_context"
    grounded = [r for r in rows.values() if r.verdict == "grounded"]
    assert grounded and all(r.evidence_gain >= bar and r.kept and not r.kept_by_floor for r in grounded)
    assert all(r.evidence_gain < bar for r in rows.values() if r.verdict == "ungrounded")
    floor = [r for r in rows.values() if r.kept_by_floor]
    assert counts["kept_by_floor"] == len(floor) == 7 - len(grounded) == counts["kept"] - counts["kept_by_evidence"]
    # the floor took the highest gains below the bar
    left = [r.evidence_gain for r in rows.values() if r.verdict == "ungrounded" and not r.kept]
    assert all(f.evidence_gain >= max(left) for f in floor)
    assert counts["gain_nats_per_token"]["max"] == pytest.approx(max(r.evidence_gain for r in rows.values()
                                                                     if r.evidence_gain is not None), abs=1e-4)
    assert counts["thresholds"]["min_gain"] == bar and counts["train"] + counts["test"] == 7
    # test pairs are grounded ones: the floor's pairs only train
    assert all(r.split == "train" for r in floor) and counts["test"] >= 1
    assert all(r.verdict == "grounded" for r in rows.values() if r.split == "test")


def test_evidence_row_verdicts():
    from nectar.evaluation.evidence import Scored
    from nectar.stages.verify import evidence_row

    cfg = VerifyConfig(method="evidence", min_gain=0.5, min_agreement=0.2)
    pair = PairRow(pair_id="p", chunk_id=0, task="qa", instruction="What is raised?", response="A NameError is raised.",
                   raw_output="")
    assert evidence_row(pair, "NameError is raised", Scored(1.2, 6), cfg).verdict == "grounded"
    assert evidence_row(pair, "NameError is raised", Scored(0.1, 6), cfg).verdict == "ungrounded"
    low = evidence_row(pair, "Names refer to objects", Scored(1.2, 6), cfg)
    assert low.verdict == "disagrees" and not low.kept and "ROUGE-L" in low.reasoning
    assert evidence_row(pair, "x", None, cfg).verdict == "ungrounded"
