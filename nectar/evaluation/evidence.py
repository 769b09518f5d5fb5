"""Judge-free verification evidence for synthesized pairs (verify.method = evidence; issue 40).

A pair is worth keeping when its answer needs the document: the base model (the one whose document KV
the state replaces) finds the answer more likely with the document in context than without it. Per
pair, teacher forced on the answer tokens exactly as evaluation scores them (nectar/layout.py):

  gain = (1/T) Σ_t [log p(a_t | document, question, a_<t) − log p(a_t | question, a_<t)]   nats/token

(without the document: the same chat around an empty document). An answer copied from the document scores high; a generic answer the model would give
anyway scores near 0; an answer the document contradicts scores below 0. ``agreement`` (ROUGE-L F1
between the answer and the full-context model's own answer to the question) catches the other failure:
a grounded-looking answer to a different question than the one asked.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from ..layout import PromptLayout
from .rouge import rouge_l
from .teacher import EvalPair, teacher_forced_pair_sums


@dataclass(frozen=True)
class Scored:
    gain: float  # nats per answer token the document adds (above)
    n_tokens: int  # answer tokens scored (the end-of-turn marker included)


def document_gain(base, layout: PromptLayout, full_provider, items: Sequence[tuple[str, str, str]],
                  max_tokens: int, batch_size: int = 8,
                  progress: Callable[[int, int], None] | None = None) -> dict[str, Scored]:
    """{pair_id: Scored} for ``items`` = (pair_id, instruction, answer). A pair is cut to ``max_tokens``
    query tokens (keeping at least 8 answer tokens): the start of an answer says whether it reads the
    document. Pairs without answer tokens are left out.

    Without the document means the same chat with an empty document (its own prefilled template), not
    the bare query: without the template every answer, generic ones too, looks ~0.6 nats/token likelier
    with the document (measured on SmolLM2), which would hide the document's own effect."""
    from ..attention.doc_kv import prefill_document
    from ..attention.exact import ExactDocState
    from ..layout import build_layout

    empty = build_layout(base.tokenizer, "")
    empty_provider = ExactDocState(prefill_document(base, empty.context_ids))  # the template, no document
    with_doc = _pairs(layout, items, max_tokens)
    without = {p.pair_id: p for p in _pairs(empty, items, max_tokens)}
    with_doc = [p for p in with_doc if p.pair_id in without]
    if not with_doc:
        return {}
    half = (lambda d, t: progress(d, 2 * t)) if progress else None
    rest = (lambda d, t: progress(t + d, 2 * t)) if progress else None
    doc_sums = teacher_forced_pair_sums(base, {"full": full_provider}, with_doc, layout.n, batch_size, half)["full"]
    bare = [without[p.pair_id] for p in with_doc]
    bare_sums = teacher_forced_pair_sums(base, {"full": empty_provider}, bare, empty.n, batch_size, rest)["full"]
    if not np.array_equal(doc_sums.n, bare_sums.n):  # the answer tokens are encoded alike in both layouts
        raise ValueError("the answer tokens differ with and without the document; the layouts disagree")
    gain = (bare_sums.nll - doc_sums.nll) / np.maximum(doc_sums.n, 1)  # [P] nats per answer token
    return {p.pair_id: Scored(float(g), int(k)) for p, g, k in zip(with_doc, gain, doc_sums.n)}


def _pairs(layout: PromptLayout, items: Sequence[tuple[str, str, str]], max_tokens: int) -> list[EvalPair]:
    out = []
    for pid, instruction, answer in items:
        q = layout.pair(instruction, answer)
        ids = q.ids[: max(max_tokens, q.response_start + 8)]
        if q.response_start < len(ids):
            out.append(EvalPair(pid, "qa", ("verify",), tuple(ids), q.response_start, start=-1))
    return out


def answer_agreement(answer: str, full_answer: str) -> float:
    """ROUGE-L F1 (words) of a pair's answer against the full-context model's answer; 0 when either is empty."""
    if not answer.strip() or not full_answer.strip():
        return 0.0
    return float(rouge_l(answer, full_answer).f1)


def distribution(values: Sequence[float]) -> dict[str, float]:
    """min, deciles that matter and max, rounded for a manifest ({} for no values)."""
    if not len(values):
        return {}
    v = np.asarray(values, dtype=np.float64)
    qs = {"min": 0, "p10": 10, "p25": 25, "p50": 50, "p75": 75, "p90": 90, "max": 100}
    return {k: round(float(np.percentile(v, q)), 4) for k, q in qs.items()}
