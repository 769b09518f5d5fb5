"""A user's own questions about a document (``--questions FILE``) and their cached reference answers.

The file is JSONL: one object per line, ``{"question": "...", "answer": "..."}`` with ``answer``
optional. A question without an answer is answered once by the full-context model (greedy); those
answers are cached in a ``ReferenceAnswerRow`` table keyed by the file's digest, the model and the
document (nectar/evaluation/questions.py).
"""
from __future__ import annotations

from typing import Literal

from pydantic import Field

from .base import Artifact


class QuestionRow(Artifact):
    """One line of a questions file (extra keys are refused: a typo is an error, not a silent drop)."""

    question: str = Field(min_length=1)
    answer: str | None = None


class ReferenceAnswerRow(Artifact):
    """One question with the answer every system is teacher-forced on (questions/<digest>/references.parquet)."""

    schema_version: int = 1
    line: int  # 1-based line of the question in its file
    pair_id: str  # "question-<line>"
    question: str
    answer: str
    source: Literal["file", "full_model"]  # given in the file, or the full-context model's greedy answer
    finish_reason: str = "given"  # the full model's: "stop" | "length"; "given" for the file's answers


class ReferenceHeader(Artifact):
    """What the cached reference answers were made from: reused only when all of it matches."""

    schema_version: int = 1
    file_sha256: str
    key: str  # stable_hash of file digest, model weights, document, layout and generation settings
    n_questions: int
    n_generated: int
