"""Reconstruction queries: the document asked back, span by span (KVzip's context reconstruction).

Spans of whole units (sentences, headings, list items — ``probes.split_units``) tile the document,
each of at least ``recon.span_words`` words. Each is a query "repeat the document from where these
words end: «the cue_words words before the span»" whose response is the span verbatim; the first
span is asked for with "repeat the document from its beginning". Reproducing a span attends to
every document token it needs, so their attention picks the keys worth keeping at every position
(query-agnostic: no question about the document is needed).

A fraction of the held-out probe blocks (``recon.withheld_fraction`` of the document) is left out
of the spans: held-out probes there measure what a state keeps of text nobody reconstructed,
probes elsewhere what it keeps of reconstructed text asked in another wording.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Sequence

from ..schemas.artifacts import DatasetRow, ProbeRow
from ..schemas.config import ProbesConfig, ReconConfig
from .probes import Unit, held_out_units, split_units

FIRST = "Repeat the document verbatim from its beginning."
NEXT = "Repeat the document verbatim, continuing from where these words end: «{cue}»"


@dataclass(frozen=True)
class ReconSpan:
    span_id: str
    instruction: str
    response: str  # the span, verbatim (line breaks kept)
    first_unit: int
    last_unit: int


def withheld_units(n_units: int, recon: ReconConfig, probes: ProbesConfig) -> set[int]:
    """Units of ``withheld_fraction`` of the document's blocks, drawn from the held-out probe blocks."""
    held = held_out_units(n_units, probes)
    blocks = sorted({u // probes.block_units for u in held})
    total = (n_units + probes.block_units - 1) // probes.block_units
    k = min(len(blocks), round(recon.withheld_fraction * total))
    chosen = random.Random(recon.seed).sample(blocks, k)
    return {u for b in chosen for u in range(b * probes.block_units, min(n_units, (b + 1) * probes.block_units))
            if u in held}


def withheld_probes(text: str, recon: ReconConfig, probes: ProbesConfig, rows: Sequence[ProbeRow]) -> set[str]:
    """Ids of the held-out probes among ``rows`` lying wholly in the units reconstruction leaves out
    (``probes_withheld``: what a state keeps of text nobody reconstructed)."""
    withheld = withheld_units(len(split_units(text)), recon, probes)
    return {p.probe_id for p in rows if p.split == "probes"
            and all(u in withheld for u in range(p.first_unit, p.last_unit + 1))}


def make_recon(text: str, recon: ReconConfig, probes: ProbesConfig) -> list[ReconSpan]:
    """The reconstruction spans of ``text``: pass after pass, each in document order (withheld units
    excluded from every pass). Pass 0 is ``tile(span_words, cue_words)`` from the first unit; pass
    p ≥ 1 draws (from seed and p) a span length in [span_words/2, 3·span_words/2], a cue length in
    [cue_words/2, 2·cue_words] and a shorter first span, so its boundaries fall elsewhere."""
    units = split_units(text)
    withheld = withheld_units(len(units), recon, probes)
    spans: list[ReconSpan] = []
    for p in range(recon.passes):
        span_words, cue_words, first_words = recon.span_words, recon.cue_words, recon.span_words
        if p > 0:
            rng = random.Random(f"recon-pass/{recon.seed}/{p}")
            span_words = rng.randint(max(4, recon.span_words // 2), recon.span_words * 3 // 2)
            cue_words = rng.randint(max(1, recon.cue_words // 2), recon.cue_words * 2)
            first_words = rng.randint(1, span_words)
        spans += _tile(text, units, withheld, span_words, first_words, cue_words, p)
    return spans


def _tile(text: str, units: list[Unit], withheld: set[int], span_words: int, first_words: int,
          cue_words: int, p: int) -> list[ReconSpan]:
    """One pass: spans of whole units of at least ``span_words`` words (the first ``first_words``)."""
    spans: list[ReconSpan] = []
    current: list[Unit] = []
    for u in units + [None]:
        ends = u is None or u.index in withheld
        if u is not None and not ends:
            current.append(u)
        if current and (ends or sum(x.n_words for x in current) >= (span_words if spans else first_words)):
            spans.append(_span(text, current, cue_words, _span_id(p, len(spans))))
            current = []
    return spans


def _span_id(p: int, i: int) -> str:
    return f"recon-{i:05d}" if p == 0 else f"recon-p{p:03d}-{i:05d}"  # pass 0: the ids before passes


def _span(text: str, units: list[Unit], cue_words: int, span_id: str) -> ReconSpan:
    start = units[0].start
    before = text[:start].split()
    instruction = FIRST if not before else NEXT.format(cue=" ".join(before[-cue_words:]))
    return ReconSpan(span_id, instruction, text[start:units[-1].end], units[0].index, units[-1].index)


def recon_dataset_rows(spans: list[ReconSpan]) -> list[DatasetRow]:
    """Spans as dataset rows of split ``recon`` for the targets stage."""
    return [DatasetRow(pair_id=s.span_id, chunk_id=-1, task="recon", instruction=s.instruction,
                       response=s.response, full_answer=s.response, judge_raw="", is_consistent=None,
                       confidence=None, reasoning="reconstruction span", verdict="recon", kept=True,
                       split="recon") for s in spans]
