"""Document probes: queries made from the document itself, no LLM needed (docs/design.md §11).

Without the document the model cannot answer them, so they measure whether a module actually carries
the document, and they give thousands of held-out tokens for free:

  continue  "Continue this passage of the document: «unit i»"  →  the next units, verbatim
  locate    "Quote the sentence of the document that contains the phrase «p»"  →  that unit, verbatim
            (p: a few consecutive words that occur exactly once in the document)

A *unit* is a sentence, a heading or a list item: the document split at sentence ends and blank
lines, each unit an exact slice of the text (line breaks kept), so responses are verbatim.
Positions are split into disjoint train and held-out sets by blocks of consecutive units: a probe
belongs to a set only when every unit it reads or writes lies in that set's blocks (probes that
straddle a boundary are dropped). Held-out probes (split ``probes``) never enter training; train
probes (split ``train``) are an optional extra query source (``targets.probes.train``).
"""
from __future__ import annotations

import random
import re
from collections import Counter
from dataclasses import dataclass

from ..schemas.artifacts import DatasetRow, ProbeRow
from ..schemas.config import ProbesConfig

# A sentence ends at . ! ? before a capital, a colon ends a line (a list follows), a blank line ends a block.
_BOUNDARY = re.compile(r"(?<=[.!?])\s+(?=[A-Z])|(?<=:)[ \t]*\n\s*|\n\s*\n\s*")
_WORD = re.compile(r"[A-Za-z][A-Za-z'-]*")
CONTINUE = "Continue this passage of the document: «{text}»"
LOCATE = "Quote the sentence of the document that contains the phrase «{phrase}»."


@dataclass(frozen=True)
class Unit:
    index: int
    start: int  # character offsets into the document
    end: int
    text: str

    @property
    def n_words(self) -> int:
        return len(self.text.split())


def split_units(text: str) -> list[Unit]:
    """Sentences, headings and list items as exact, stripped slices of ``text`` (document order)."""
    units, pos = [], 0
    for m in list(_BOUNDARY.finditer(text)) + [None]:
        end = m.start() if m else len(text)
        piece = text[pos:end]
        stripped = piece.strip()
        if stripped and any(c.isalnum() for c in stripped):
            offset = pos + len(piece) - len(piece.lstrip())
            units.append(Unit(len(units), offset, offset + len(stripped), stripped))
        pos = m.end() if m else len(text)
    return units


def held_out_units(n_units: int, cfg: ProbesConfig) -> set[int]:
    """Indices of the units in held-out blocks: round(fraction · blocks) blocks, seeded."""
    blocks = (n_units + cfg.block_units - 1) // cfg.block_units
    k = min(blocks, max(1, round(cfg.held_out_fraction * blocks))) if blocks else 0
    chosen = random.Random(cfg.seed).sample(range(blocks), k)
    return {u for b in chosen for u in range(b * cfg.block_units, min(n_units, (b + 1) * cfg.block_units))}


def make_probes(text: str, cfg: ProbesConfig) -> list[ProbeRow]:
    """Every probe of the configured kinds whose units lie wholly in one set (train or held-out)."""
    units = split_units(text)
    held = held_out_units(len(units), cfg)
    rows: list[ProbeRow] = []
    for probe in [*(_continue_probes(text, units, cfg) if "continue" in cfg.kinds else []),
                  *(_locate_probes(text, units, cfg) if "locate" in cfg.kinds else [])]:
        span = range(probe.first_unit, probe.last_unit + 1)
        inside = sum(u in held for u in span)
        if inside == len(span):
            rows.append(probe.model_copy(update={"split": "probes"}))
        elif inside == 0:
            rows.append(probe.model_copy(update={"split": "train"}))
    return rows


def _continue_probes(text: str, units: list[Unit], cfg: ProbesConfig) -> list[ProbeRow]:
    out = []
    for i, u in enumerate(units):
        if u.n_words < cfg.min_prompt_words:
            continue
        j, words = i + 1, 0  # the response: the following units, until it has enough words
        while j < len(units) and words < cfg.min_response_words and j - i <= cfg.max_response_units:
            words += units[j].n_words
            j += 1
        if words < cfg.min_response_words:
            continue
        response = text[units[i + 1].start:units[j - 1].end]  # verbatim, line breaks included
        out.append(ProbeRow(probe_id=f"probe-continue-{i:05d}", kind="continue",
                            instruction=CONTINUE.format(text=u.text), response=response,
                            first_unit=i, last_unit=j - 1, split="train"))
    return out


def _locate_probes(text: str, units: list[Unit], cfg: ProbesConfig) -> list[ProbeRow]:
    counts = Counter(_ngrams([w.lower() for w in _WORD.findall(text)], cfg.phrase_words))
    out = []
    for u in units:
        if u.n_words < cfg.min_response_words:
            continue
        matches = list(_WORD.finditer(u.text))
        words = [m.group() for m in matches]
        k, found = 0, 0
        # Up to locate_per_unit phrases per unit, each unique in the document, not overlapping.
        while k <= len(words) - cfg.phrase_words and found < cfg.locate_per_unit:
            gram = tuple(w.lower() for w in words[k:k + cfg.phrase_words])
            if counts[gram] == 1 and sum(len(w) for w in gram) >= 4 * cfg.phrase_words:
                # the phrase as it stands in the text (quotes, line breaks inside it collapsed)
                phrase = " ".join(u.text[matches[k].start():matches[k + cfg.phrase_words - 1].end()].split())
                out.append(ProbeRow(probe_id=f"probe-locate-{u.index:05d}-{found}", kind="locate",
                                    instruction=LOCATE.format(phrase=phrase),
                                    response=u.text, first_unit=u.index, last_unit=u.index, split="train"))
                found += 1
                k += cfg.phrase_words
            else:
                k += 1
    return out


def _ngrams(words: list[str], n: int) -> list[tuple[str, ...]]:
    return [tuple(words[i:i + n]) for i in range(len(words) - n + 1)]


def probe_dataset_rows(probes: list[ProbeRow], include_train: bool) -> list[DatasetRow]:
    """Probes as dataset rows for the targets stage: held-out ones always, train ones when asked."""
    return [DatasetRow(pair_id=p.probe_id, chunk_id=-1, task=p.kind, instruction=p.instruction,
                       response=p.response, full_answer=p.response, judge_raw="", is_consistent=None,
                       confidence=None, reasoning="document probe", verdict="probe", kept=True, split=p.split)
            for p in probes if p.split == "probes" or include_train]
