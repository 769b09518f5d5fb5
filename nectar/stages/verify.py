"""verify: re-answer with the whole document, judge consistency, filter, split (App. A.1, E, H).

0. Identical (normalised) instructions: the first stays, the later ones become duplicate before any
   request (sampling several replies per prompt repeats ~30 % of instructions; answering and judging
   them would be wasted work, and only one of them could be kept).
1. A long-context model re-answers every remaining instruction with the WHOLE document (the paper's
   answer prompt; the document comes first, so every request shares one prefix KV cache locally).
2. A judge compares the chunk answer (the synthesized response) with the full-document answer
   (consistency prompt + per-task guidance, JSON {is_consistent, confidence, reasoning}).
3. Verdicts: insufficient_context (either answer says INSUFFICIENT_CONTEXT; not judged),
   judge_parse_error, inconsistent, low_confidence (< min_confidence), consistent (kept);
   synthesis parse errors carry through as synthesis_parse_error.
4. Fewer than ``min_kept`` kept → the most confident low_confidence rows are kept too
   (kept_by_floor), because tiny models rarely pass a strict judge.
With ``verify.method = evidence`` (the cpu preset: a small judge passes nothing) steps 2–4 are
judge-free instead (nectar/evaluation/evidence.py): each pair is scored on the base model by how much
the document raises its answer's likelihood (nats per answer token) and by its agreement with the
full-context answer (ROUGE-L); verdicts grounded (kept) / ungrounded / disagrees, and the floor, when
too few pass, takes the highest gains.
5. Seeded 80/20 train/test split of kept rows; challenge = the test instructions least similar
   (max cosine, all-MiniLM-L6-v2) to any training instruction.
Every row — dropped ones included, with their verdict — is written to dataset.parquet. Answers
and judgments are saved in partial files as they arrive, so a killed run resumes. The resume
contract: nothing finished is asked again and finished replies are kept byte for byte; the rest
are asked on the re-run in new batches, so with a batching backend their text may differ from an
uninterrupted run's at float level (batched kernels are not batch-invariant on every processor).
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from ..layout import ContextTooLongError
from ..evaluation.evidence import Scored, answer_agreement, distribution
from ..llm import ChatBackend, ChatResult, make_request
from ..llm.parsing import find_json
from ..prompts import CONSISTENCY_SCHEMA, INSUFFICIENT, answer_prompt, consistency_prompt
from ..schemas.artifacts import DatasetRow, PairRow
from ..schemas.base import Artifact, stable_hash
from ..schemas.config import VerifyConfig
from ..tables import write_table
from ..partial import PartialStore, ask_saving, clear_partial

DATASET_FILE = "dataset.parquet"


class VerifyError(RuntimeError):
    """Some answer/judge requests failed outright; what succeeded is saved for the re-run."""


class AnswerRow(Artifact):  # partial results: one full-document answer
    pair_id: str
    text: str


class JudgeRow(Artifact):  # partial results: one raw judge reply
    pair_id: str
    text: str


@dataclass(frozen=True)
class Judgment:
    is_consistent: bool | None
    confidence: float | None
    reasoning: str
    error: str | None = None


Scorer = Callable[[list[tuple[str, str, str]]], dict[str, Scored]]  # (pair_id, instruction, answer) → gain


def verify(document_text: str, pairs: list[PairRow], cfg: VerifyConfig, answer_backend: ChatBackend,
           judge_backend: ChatBackend | None, embedder_path: str, out_url: str,
           progress: Callable[[int, int], None] | None = None, scorer: Scorer | None = None) -> dict[str, Any]:
    """Write ``<out_url>/dataset.parquet`` (DatasetRow, every pair) and return counts. ``scorer``
    (verify.method = evidence) gives each pair's document gain (evidence.document_gain on the base model)."""
    out_url = out_url.rstrip("/")
    if cfg.method == "evidence" and scorer is None:
        raise ValueError("verify.method=evidence needs a scorer (the base model and the document KV)")
    candidates, duplicate_of = first_of_each_instruction([p for p in pairs if p.parse_error is None])
    check_document_fits(document_text, candidates, cfg, answer_backend)
    ticker = _Ticker(progress, 2 * len(candidates))
    answers = _answer_all(document_text, candidates, cfg, answer_backend, out_url, ticker)
    if cfg.method == "evidence":
        return _verify_by_evidence(pairs, candidates, duplicate_of, answers, cfg, scorer, embedder_path, out_url)
    to_judge = [p for p in candidates if not _insufficient(p.response, answers[p.pair_id])]
    ticker.total = len(candidates) + len(to_judge)
    raw = _judge_all(to_judge, answers, cfg, judge_backend, out_url, answers_key=_answers_key(document_text,
                                                                                              candidates, cfg),
                     ticker=ticker)
    rows = [_row(p, answers.get(p.pair_id, ""), raw.get(p.pair_id), cfg.min_confidence, duplicate_of.get(p.pair_id))
            for p in pairs]
    rows, floor = apply_floor(rows, cfg.min_kept)
    rows = split_rows(rows, cfg.test_fraction, cfg.seed)
    rows = mark_challenge(rows, cfg.challenge_size, embedder_path)
    write_table(f"{out_url}/{DATASET_FILE}", rows, DatasetRow)
    clear_partial(f"{out_url}/partial")  # the dataset holds everything now; a forced re-run starts fresh
    return _counts(rows, floor, len(candidates), len(to_judge), len(duplicate_of))


# ----- 0. duplicates are dropped before any request; the document must fit the answer model -----

def normalize_instruction(text: str) -> str:
    return re.sub(r"\s+", " ", text.lower()).strip(" \t\n.?!:;\"'")


def first_of_each_instruction(pairs: Sequence[PairRow]) -> tuple[list[PairRow], dict[str, str]]:
    """The first pair of each normalised instruction (in order), and {later pair_id: first pair_id}."""
    first: dict[str, str] = {}
    unique: list[PairRow] = []
    duplicate_of: dict[str, str] = {}
    for p in pairs:
        key = normalize_instruction(p.instruction)
        if key in first:
            duplicate_of[p.pair_id] = first[key]
        else:
            first[key] = p.pair_id
            unique.append(p)
    return unique, duplicate_of


def check_document_fits(document: str, pairs: Sequence[PairRow], cfg: VerifyConfig, backend: ChatBackend) -> None:
    """Refuse up front (before any request) a document the answer model can't read whole."""
    window = backend.context_window()
    if window is None or not pairs:
        return  # a server enforces its own window (and answers 400, which fails the stage clearly)
    longest = max(pairs, key=lambda p: len(p.instruction)).instruction
    n_doc = backend.prompt_tokens(make_request(cfg.answer_llm, answer_prompt(document, "")))
    n_max = backend.prompt_tokens(make_request(cfg.answer_llm, answer_prompt(document, longest)))
    total = n_max + cfg.answer_llm.max_new_tokens
    if total > window:
        raise ContextTooLongError(
            f"verification needs the whole document in the answer model's context: the answer prompt with the "
            f"document is {n_doc} tokens, with the longest instruction and {cfg.answer_llm.max_new_tokens} answer "
            f"tokens {total}, over the answer model's window of {window} tokens. Use a shorter document or a "
            "long-context answer model (verify.answer_llm).")


# ----- 1-2. answers and judgments, resumable -----

def _answer_all(document: str, pairs: list[PairRow], cfg: VerifyConfig, backend: ChatBackend, out_url: str,
                ticker: "_Ticker") -> dict[str, str]:
    store = PartialStore(f"{out_url}/partial/answers", _answers_key(document, pairs, cfg), AnswerRow)
    # Every prompt starts with the document: one salt per document lets vLLM serve that prefix from
    # its cache to every question, and to no other document's.
    salt = stable_hash(document)[:16]
    requests = {p.pair_id: make_request(cfg.answer_llm, answer_prompt(document, p.instruction),
                                        seed=_seed(cfg.answer_llm.seed, p.pair_id), cache_salt=salt) for p in pairs}
    return _run_resumable(store, requests, backend, ticker, "answer")


def _judge_all(pairs: list[PairRow], answers: dict[str, str], cfg: VerifyConfig, backend: ChatBackend,
               out_url: str, answers_key: str, ticker: "_Ticker") -> dict[str, str]:
    key = stable_hash({"answers": answers_key, "judge": cfg.judge.cache_dict(),
                       "pairs": [(p.pair_id, p.task, p.response) for p in pairs]})
    store = PartialStore(f"{out_url}/partial/judgments", key, JudgeRow)
    requests = {p.pair_id: make_request(cfg.judge, consistency_prompt(p.task, p.instruction, p.response,
                                                                      answers[p.pair_id]),
                                        json_schema=CONSISTENCY_SCHEMA, seed=_seed(cfg.judge.seed, p.pair_id))
                for p in pairs}
    return _run_resumable(store, requests, backend, ticker, "judge")


def _run_resumable(store: PartialStore, requests: dict[str, Any], backend: ChatBackend, ticker: "_Ticker",
                   what: str) -> dict[str, str]:
    """Run the requests not already in ``store``; save replies in batches as they arrive."""
    done: dict[str, str] = {}
    for name in sorted(store.done()):
        done.update({r.pair_id: r.text for r in store.read(name)})
    ticker.add(len([k for k in requests if k in done]))
    pending = [k for k in requests if k not in done]
    buffer: list[Artifact] = []
    flush_every = max(8, getattr(backend, "batch_size", 8), getattr(backend, "max_concurrency", 8))
    seq = len(store.done())

    def flush() -> None:
        nonlocal seq, buffer
        if buffer:
            store.write(f"{what}-{seq:06d}", buffer)
            seq, buffer = seq + 1, []

    def save(i: int, result: ChatResult) -> None:
        done[pending[i]] = result.text
        buffer.append(store.row_cls(pair_id=pending[i], text=result.text))
        if len(buffer) >= flush_every:
            flush()

    # replies saved in batches; what arrived is kept also when the backend raised (e.g. server gone)
    ask_saving(backend, [requests[k] for k in pending], pending, save, VerifyError, what,
               tick=lambda: ticker.add(1), finish=flush)
    return done


# ----- 3. verdicts -----

def parse_judgment(text: str | None) -> Judgment:
    if text is None:
        return Judgment(None, None, "", error="not judged")
    obj = find_json(text, lambda v: isinstance(v, dict) and "is_consistent" in v)
    if obj is None:
        return Judgment(None, None, "", error="no JSON object with is_consistent in the judge reply")
    verdict = obj.get("is_consistent")
    if isinstance(verdict, str) and verdict.strip().lower() in ("true", "false"):
        verdict = verdict.strip().lower() == "true"
    confidence = obj.get("confidence")
    if isinstance(confidence, str):
        try:
            confidence = float(confidence.strip().rstrip("%")) / (100 if confidence.strip().endswith("%") else 1)
        except ValueError:
            confidence = None
    if isinstance(confidence, (int, float)) and not isinstance(confidence, bool) and 1 < confidence <= 100:
        confidence = confidence / 100  # "85" meaning 85 %
    reasoning = obj.get("reasoning") if isinstance(obj.get("reasoning"), str) else ""
    if not isinstance(verdict, bool):
        return Judgment(None, None, reasoning, error=f"is_consistent is {verdict!r}, not true/false")
    if not isinstance(confidence, (int, float)) or isinstance(confidence, bool) or not 0 <= confidence <= 1:
        return Judgment(verdict, None, reasoning, error=f"confidence {obj.get('confidence')!r} is not in [0, 1]")
    return Judgment(verdict, float(confidence), reasoning)


def _insufficient(*answers: str) -> bool:
    return any(INSUFFICIENT in a for a in answers)


def _row(pair: PairRow, full_answer: str, judge_raw: str | None, min_confidence: float,
         duplicate_of: str | None = None) -> DatasetRow:
    base = dict(pair_id=pair.pair_id, chunk_id=pair.chunk_id, task=pair.task, instruction=pair.instruction,
                response=pair.response, full_answer=full_answer, judge_raw=judge_raw or "", split="dropped",
                kept=False, is_consistent=None, confidence=None, reasoning="")
    if pair.parse_error is not None:
        return DatasetRow(**{**base, "reasoning": pair.parse_error}, verdict="synthesis_parse_error")
    if duplicate_of is not None:  # not answered, not judged
        return DatasetRow(**{**base, "reasoning": f"same instruction as {duplicate_of}"}, verdict="duplicate")
    if _insufficient(pair.response, full_answer):
        return DatasetRow(**base, verdict="insufficient_context")
    j = parse_judgment(judge_raw)
    fields = {**base, "is_consistent": j.is_consistent, "confidence": j.confidence,
              "reasoning": j.reasoning if j.error is None else f"{j.error}. {j.reasoning}".strip()}
    if j.error is not None:
        return DatasetRow(**fields, verdict="judge_parse_error")
    if not j.is_consistent:
        return DatasetRow(**fields, verdict="inconsistent")
    if j.confidence < min_confidence:
        return DatasetRow(**fields, verdict="low_confidence")
    return DatasetRow(**{**fields, "kept": True, "split": "train"}, verdict="consistent")


# ----- 4. the floor -----

def apply_floor(rows: list[DatasetRow], min_kept: int, verdicts: tuple[str, ...] = ("low_confidence",),
                score: Callable[[DatasetRow], float] = lambda r: r.confidence or 0.0) -> tuple[list[DatasetRow], int]:
    """Keep the best-scored rows of ``verdicts`` (the most confident low_confidence rows) until
    ``min_kept`` rows are kept."""
    missing = min_kept - sum(r.kept for r in rows)
    if missing <= 0:
        return rows, 0
    pool = sorted((i for i, r in enumerate(rows) if r.verdict in verdicts),
                  key=lambda i: -score(rows[i]))[:missing]
    out = list(rows)
    for i in pool:
        out[i] = rows[i].model_copy(update={"kept": True, "kept_by_floor": True, "split": "train"})
    return out, len(pool)


# ----- 2-4 without a judge: evidence from the base model (verify.method = evidence) -----

def _verify_by_evidence(pairs: list[PairRow], candidates: list[PairRow], duplicate_of: dict[str, str],
                        answers: dict[str, str], cfg: VerifyConfig, scorer: Scorer, embedder_path: str,
                        out_url: str) -> dict[str, Any]:
    scorable = [p for p in candidates if not _insufficient(p.response, answers[p.pair_id])]
    gains = scorer([(p.pair_id, p.instruction, p.response) for p in scorable])
    rows = [evidence_row(p, answers.get(p.pair_id, ""), gains.get(p.pair_id), cfg, duplicate_of.get(p.pair_id))
            for p in pairs]
    # the floor as a last resort, by gain: the pairs the document helps most, though below the bar
    rows, floor = apply_floor(rows, cfg.min_kept, ("ungrounded", "disagrees"),
                              lambda r: r.evidence_gain if r.evidence_gain is not None else float("-inf"))
    rows = split_grounded(rows, cfg.test_fraction, cfg.seed)
    rows = mark_challenge(rows, cfg.challenge_size, embedder_path)
    write_table(f"{out_url}/{DATASET_FILE}", rows, DatasetRow)
    clear_partial(f"{out_url}/partial")
    counts = _counts(rows, floor, len(candidates), 0, len(duplicate_of))
    return {**counts, **evidence_counts(rows, cfg)}


def split_grounded(rows: list[DatasetRow], test_fraction: float, seed: int) -> list[DatasetRow]:
    """The seeded train/test split over the pairs kept by evidence only; pairs kept by the floor train
    and are never test pairs: a test answer the document does not make likelier measures nothing
    (with none grounded, the test split is empty and the probes and --questions are the measure)."""
    floor = {i for i, r in enumerate(rows) if r.kept_by_floor}
    held = [r.model_copy(update={"kept": False}) if i in floor else r for i, r in enumerate(rows)]
    split = split_rows(held, test_fraction, seed)
    return [rows[i].model_copy(update={"split": "train"}) if i in floor else r for i, r in enumerate(split)]


def evidence_row(pair: PairRow, full_answer: str, scored: Scored | None, cfg: VerifyConfig,
                 duplicate_of: str | None = None) -> DatasetRow:
    """A pair's verdict from its document gain and its agreement with the full-context answer."""
    row = _row(pair, full_answer, None, cfg.min_confidence, duplicate_of)
    if pair.parse_error is not None or duplicate_of is not None or _insufficient(pair.response, full_answer):
        return row  # synthesis error, duplicate, insufficient context: as with a judge
    agreement = answer_agreement(pair.response, full_answer)
    fields = {**row.model_dump(exclude={"verdict", "schema_version"}), "reasoning": "", "agreement": round(agreement, 4)}
    if scored is None:
        return DatasetRow(**{**fields, "reasoning": "no answer tokens to score"}, verdict="ungrounded")
    fields["evidence_gain"] = round(scored.gain, 4)
    if scored.gain < cfg.min_gain:
        return DatasetRow(**{**fields, "reasoning": f"the document adds {scored.gain:.3f} nats per answer token "
                                                    f"(< verify.min_gain {cfg.min_gain:g})"}, verdict="ungrounded")
    if agreement < cfg.min_agreement:
        return DatasetRow(**{**fields, "reasoning": f"ROUGE-L {agreement:.3f} with the full-context answer "
                                                    f"(< verify.min_agreement {cfg.min_agreement:g})"},
                          verdict="disagrees")
    return DatasetRow(**{**fields, "kept": True, "split": "train",
                         "reasoning": f"the document adds {scored.gain:.3f} nats per answer token"},
                      verdict="grounded")


def evidence_counts(rows: list[DatasetRow], cfg: VerifyConfig) -> dict[str, Any]:
    """What the evidence verifier did: kept by evidence / by the floor, and the score distributions
    (every scored pair, and the kept ones) against the thresholds."""
    scored = [r for r in rows if r.evidence_gain is not None]
    kept = [r for r in scored if r.kept]
    return {
        "method": "evidence", "kept_by_evidence": sum(r.verdict == "grounded" for r in rows),
        "thresholds": {"min_gain": cfg.min_gain, "min_agreement": cfg.min_agreement},
        "gain_nats_per_token": distribution([r.evidence_gain for r in scored]),
        "gain_kept": distribution([r.evidence_gain for r in kept]),
        "agreement_rouge_l": distribution([r.agreement for r in scored if r.agreement is not None]),
    }


# ----- 5. splits -----

def split_rows(rows: list[DatasetRow], test_fraction: float, seed: int) -> list[DatasetRow]:
    kept = [i for i, r in enumerate(rows) if r.kept]
    n_test = round(len(kept) * test_fraction)
    if len(kept) >= 2:
        n_test = min(max(n_test, 1), len(kept) - 1)  # both splits non-empty
    else:
        n_test = 0
    order = list(kept)
    random.Random(seed).shuffle(order)
    test = set(order[:n_test])
    return [r.model_copy(update={"split": "test" if i in test else "train"}) if r.kept else r
            for i, r in enumerate(rows)]


def mark_challenge(rows: list[DatasetRow], challenge_size: int, embedder_path: str) -> list[DatasetRow]:
    """For each test instruction its max cosine similarity to any training instruction; the
    ``challenge_size`` least similar test rows (at most half the test split) are the challenge
    split (they stay test rows)."""
    train = [r.instruction for r in rows if r.split == "train"]
    test_idx = [i for i, r in enumerate(rows) if r.split == "test"]
    if not train or not test_idx:
        return rows
    sims = max_similarity([rows[i].instruction for i in test_idx], train, embedder_path)
    # At most half of the test split, so the challenge split stays a harder subset rather than
    # a copy of the whole (small) test split.
    size = min(max(0, challenge_size), max(1, len(test_idx) // 2))
    ranked = sorted(range(len(test_idx)), key=lambda k: sims[k])[:size]
    challenge = {test_idx[k] for k in ranked}
    out = list(rows)
    for k, i in enumerate(test_idx):
        out[i] = rows[i].model_copy(update={"max_train_similarity": round(sims[k], 6), "challenge": i in challenge})
    return out


def max_similarity(queries: list[str], corpus: list[str], embedder_path: str) -> list[float]:
    import torch

    model = _embedder(embedder_path)
    q = model.encode(queries, convert_to_tensor=True, normalize_embeddings=True)  # [n_test, e]
    c = model.encode(corpus, convert_to_tensor=True, normalize_embeddings=True)  # [n_train, e]
    with torch.inference_mode():
        return (q @ c.T).max(dim=1).values.tolist()  # [n_test]


def _embedder(path: str):
    from ..base_model import load_embedder

    return load_embedder(path)


# ----- bookkeeping -----

def _seed(seed: int, pair_id: str) -> int:
    """Per-request seed from (config seed, pair): independent of batching and of resumes."""
    return int(stable_hash({"seed": seed, "pair": pair_id})[:8], 16)


def _answers_key(document: str, pairs: list[PairRow], cfg: VerifyConfig) -> str:
    return stable_hash({"doc": stable_hash(document), "answer": cfg.answer_llm.cache_dict(),
                        "instructions": [(p.pair_id, p.instruction) for p in pairs]})


class _Ticker:
    def __init__(self, progress: Callable[[int, int], None] | None, total: int):
        self.progress, self.total, self.done = progress, total, 0

    def add(self, n: int) -> None:
        self.done += n
        if self.progress is not None and n:
            self.progress(self.done, max(self.total, self.done))


def _counts(rows: list[DatasetRow], floor: int, n_answered: int, n_judged: int, n_duplicates: int) -> dict[str, Any]:
    verdicts: dict[str, int] = {}
    for r in rows:
        verdicts[r.verdict] = verdicts.get(r.verdict, 0) + 1
    return {
        "pairs": len(rows), "duplicates_skipped": n_duplicates, "answer_requests": n_answered, "judge_requests": n_judged,
        "kept": sum(r.kept for r in rows), "dropped": sum(not r.kept for r in rows),
        "kept_by_floor": floor, "verdicts": verdicts,
        "train": sum(r.split == "train" for r in rows), "test": sum(r.split == "test" for r in rows),
        "challenge": sum(r.challenge for r in rows),
    }
