"""The user's own questions as a measure (``--questions FILE`` in ``nectar run`` and ``nectar compare``).

A questions file is JSONL, one ``{"question": ..., "answer": ...}`` object per line (``answer``
optional; blank lines skipped). Every system is teacher-forced on the same answers, exactly as on the
held-out pairs: the ``questions`` split gets the same columns (KL to full, recovered KL, token
accuracy, greedy agreement) with its own paired bootstrap.

Reference answers. A question without an answer is answered by the full-context model (the base model
over the exact document KV), greedily, once: the answers are cached under the caller's folder with
a header naming what they were made from (the file's sha256, the model's weights, the prompt tokens
of the document, the token budget); a later evaluate or compare with the same file reuses them.
"""
from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass, replace
from typing import Callable, Sequence

from pydantic import ValidationError

from ..layout import PromptLayout
from ..schemas.base import stable_hash
from ..schemas.config import EvaluateConfig
from ..schemas.questions import QuestionRow, ReferenceAnswerRow, ReferenceHeader
from ..tables import ArtifactError, read_json_artifact, read_table, write_json_artifact, write_table
from .selection import Selection
from .teacher import EvalPair

QUESTIONS_SPLIT = "questions"
MAX_QUESTIONS = 10_000  # a file past this is more likely a mistake (a corpus) than questions
_SHAPE = 'each line is one JSON object {"question": "...", "answer": "..."} (answer optional)'


class QuestionsFileError(ValueError):
    """A questions file that can't be used; the message is one line naming the line and the problem."""


@dataclass(frozen=True)
class QuestionsFile:
    path: str
    sha256: str
    rows: tuple[tuple[int, QuestionRow], ...]  # (1-based line, question)

    @property
    def short(self) -> str:
        return self.sha256[:16]


# ----- reading and checking the file -----

def read_questions(path: str) -> QuestionsFile:
    """The questions of ``path``, or QuestionsFileError naming the first bad line and what is wrong."""
    import fsspec

    try:
        with fsspec.open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise QuestionsFileError(f"questions file {path} does not exist; {_SHAPE}") from None
    except (OSError, ValueError) as exc:
        raise QuestionsFileError(f"questions file {path}: cannot read it ({type(exc).__name__}: {exc})") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise QuestionsFileError(f"{path} line {line}: not UTF-8 text (byte {exc.start}); save the file as "
                                 "UTF-8") from None
    rows = []
    for number, raw in enumerate(text.splitlines(), start=1):
        if raw.strip():
            rows.append((number, parse_line(path, number, raw)))
    if not rows:
        raise QuestionsFileError(f"{path} holds no questions; {_SHAPE}")
    if len(rows) > MAX_QUESTIONS:
        raise QuestionsFileError(f"{path} holds {len(rows)} questions, over the limit of {MAX_QUESTIONS}; "
                                 "split it into several files")
    return QuestionsFile(path, hashlib.sha256(data).hexdigest(), tuple(rows))


def parse_line(path: str, number: int, raw: str) -> QuestionRow:
    where = f"{path} line {number}"
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise QuestionsFileError(f"{where}: not JSON ({exc.msg} at column {exc.colno}); {_SHAPE}") from None
    if not isinstance(obj, dict):
        raise QuestionsFileError(f"{where}: a JSON {type(obj).__name__}, not an object; {_SHAPE}")
    unknown = sorted(set(obj) - {"question", "answer"})
    if unknown:
        raise QuestionsFileError(f"{where}: unknown key {unknown[0]!r} (the keys are question and answer)")
    if "question" not in obj:
        raise QuestionsFileError(f"{where}: no \"question\"; {_SHAPE}")
    for key in ("question", "answer"):
        value = obj.get(key)
        if value is None and key == "answer":
            continue
        if not isinstance(value, str) or not value.strip():
            got = "an empty string" if isinstance(value, str) else json.dumps(value)
            raise QuestionsFileError(f"{where}: \"{key}\" must be a non-empty string, got {got}")
    try:
        answer = obj.get("answer")
        return QuestionRow(question=obj["question"].strip(), answer=answer.strip() if answer is not None else None)
    except ValidationError as exc:  # unreachable after the checks above; kept one line all the same
        raise QuestionsFileError(f"{where}: {exc.errors()[0]['msg']}") from None


# ----- reference answers: given, or the full-context model's greedy answer (cached) -----

def pair_id(line: int) -> str:
    return f"question-{line:05d}"


def reference_key(qfile: QuestionsFile, weights_hash: str, layout: PromptLayout, max_new_tokens: int) -> str:
    """Everything a generated answer depends on: the file, the model, the document's prompt tokens, the
    query template around the question, and the token budget."""
    return stable_hash({"file": qfile.sha256, "model": weights_hash, "context": stable_hash(list(layout.context_ids)),
                        "template": [layout.before_instruction, layout.prompt_suffix], "max_new_tokens": max_new_tokens})


def reference_answers(base, layout: PromptLayout, full_provider, qfile: QuestionsFile, cache_url: str,
                      max_new_tokens: int, batch_size: int = 8,
                      progress: Callable[[int, int], None] | None = None) -> tuple[list[ReferenceAnswerRow], int]:
    """(one row per question, how many answers were generated now). Reused from ``cache_url`` when its
    header matches; otherwise the questions without an answer are answered by the full-context model
    (``full_provider``, greedy, up to ``max_new_tokens``) and the table is written there."""
    key = reference_key(qfile, base.weights_hash, layout, max_new_tokens)
    cached = _read_cache(cache_url, key)
    if cached is not None:
        return cached, 0
    missing = [(line, q) for line, q in qfile.rows if q.answer is None]
    generated = _greedy_answers(base, layout, full_provider, [q.question for _, q in missing], max_new_tokens,
                                batch_size, progress)
    by_line = dict(zip((line for line, _ in missing), generated))
    rows = []
    for line, q in qfile.rows:
        if q.answer is not None:
            rows.append(ReferenceAnswerRow(line=line, pair_id=pair_id(line), question=q.question, answer=q.answer,
                                           source="file"))
        else:
            text, reason = by_line[line]
            rows.append(ReferenceAnswerRow(line=line, pair_id=pair_id(line), question=q.question, answer=text,
                                           source="full_model", finish_reason=reason))
    write_table(f"{cache_url}/references.parquet", rows, ReferenceAnswerRow)
    # the header last: a table without its header (a killed write) is regenerated, never trusted
    write_json_artifact(f"{cache_url}/header.json", ReferenceHeader(
        file_sha256=qfile.sha256, key=key, n_questions=len(rows), n_generated=len(missing)))
    return rows, len(missing)


def _read_cache(cache_url: str, key: str) -> list[ReferenceAnswerRow] | None:
    try:
        header = read_json_artifact(f"{cache_url}/header.json", ReferenceHeader)
        if header.key != key:
            return None
        rows = read_table(f"{cache_url}/references.parquet", ReferenceAnswerRow)
    except (ArtifactError, ValidationError, ValueError):
        return None  # missing, partial or from another release: answered again
    return rows if len(rows) == header.n_questions else None


def _greedy_answers(base, layout: PromptLayout, provider, questions: list[str], max_new_tokens: int,
                    batch_size: int, progress) -> list[tuple[str, str]]:
    """(text, finish reason) of the full-context model's greedy answer to each question."""
    from ..attention.engine import generate

    out: list[tuple[str, str]] = [("", "")] * len(questions)
    order = sorted(range(len(questions)), key=lambda i: len(questions[i]))  # similar lengths: less padding
    for lo in range(0, len(order), batch_size):
        idx = order[lo: lo + batch_size]
        prompts = [layout.prompt(questions[i]).ids for i in idx]
        res = generate(base, provider, layout.n, prompts, max_new_tokens=max_new_tokens, temperature=0.0)
        for i, toks, reason in zip(idx, res.tokens, res.finish_reasons):
            # unstripped: the reference is exactly what the full model said (re-encoded for teacher forcing)
            out[i] = (base.tokenizer.decode(toks, skip_special_tokens=True), reason)
        if progress:
            progress(min(lo + batch_size, len(order)), len(order))
    return out


# ----- the split: teacher-forced pairs joining a selection -----

def question_pairs(layout: PromptLayout, refs: Sequence[ReferenceAnswerRow], window: int,
                   path: str = "questions file") -> list[EvalPair]:
    """One EvalPair per question (split ``questions``): the question as instruction, the reference
    answer as the scored response. A question whose pair can't fit the model's window after the
    document is refused in one line."""
    pairs = []
    room = window - layout.n
    for r in refs:
        if not r.answer:
            raise QuestionsFileError(f"{path} line {r.line}: the full-context model's answer is empty (it ended "
                                     "its turn at once); add an \"answer\" to that line")
        q = layout.pair(r.question, r.answer)
        if len(q.ids) > room:
            raise QuestionsFileError(
                f"{path} line {r.line}: question and answer are {len(q.ids)} tokens, over the {room} the model's "
                f"window of {window} leaves after the document's {layout.n}; shorten them")
        pairs.append(EvalPair(r.pair_id, "qa", (QUESTIONS_SPLIT,), tuple(q.ids), q.response_start, start=-1))
    return pairs


def with_questions(sel: Selection, pairs: Sequence[EvalPair], cfg: EvaluateConfig) -> Selection:
    """``sel`` plus the ``questions`` split: scored and bootstrapped like any split, with a seeded greedy
    agreement sample; never judged (no ground-truth chunk) and without cached targets (no per-layer
    errors)."""
    if not pairs:
        return sel
    ids = sorted(p.pair_id for p in pairs)
    clash = set(ids) & {p.pair_id for p in sel.pairs}
    if clash:
        raise ValueError(f"question pair ids {sorted(clash)[:3]} collide with the run's pairs")
    agree = ids if len(ids) <= cfg.agreement_max_samples else sorted(
        random.Random(cfg.seed).sample(ids, cfg.agreement_max_samples))
    return replace(sel, pairs=[*sel.pairs, *sorted(pairs, key=lambda p: p.pair_id)],
                   per_split={**sel.per_split, QUESTIONS_SPLIT: ids},
                   judged={**sel.judged, QUESTIONS_SPLIT: []},
                   agreement={**sel.agreement, QUESTIONS_SPLIT: agree})


@dataclass(frozen=True)
class LoadedQuestions:
    pairs: list[EvalPair]
    references: list[ReferenceAnswerRow]
    generated: int  # reference answers generated by this call (0: all given or cached)
    file: QuestionsFile

    def counts(self) -> dict[str, int | str]:
        return {"questions": len(self.pairs), "questions_file_sha256": self.file.sha256,
                "questions_answers_given": sum(r.source == "file" for r in self.references),
                "questions_answers_generated_now": self.generated}


def load_questions(path: str, base, layout: PromptLayout, full_provider, cache_root: str, cfg: EvaluateConfig,
                   progress: Callable[[int, int], None] | None = None) -> LoadedQuestions:
    """Read ``path``, get its reference answers (cached under ``cache_root/<sha256[:16]>``) and build the
    ``questions`` pairs."""
    qfile = read_questions(path)
    refs, generated = reference_answers(base, layout, full_provider, qfile, f"{cache_root.rstrip('/')}/{qfile.short}",
                                        cfg.questions_answer_tokens, progress=progress)
    return LoadedQuestions(question_pairs(layout, refs, base.max_context_tokens, path), refs, generated, qfile)
