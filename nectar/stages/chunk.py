"""chunk: overlapping word-level chunks of the document (paper App. A.1, docs/design.md §5).

Chunk k starts at word k·(words − overlap) and is ``words`` long, so consecutive chunks share
``overlap`` words and every word is in at least one chunk. A tail that would add fewer than
``overlap`` new words is merged into the previous chunk instead of becoming a tiny last chunk
(a chunk of a handful of words yields useless synthetic pairs). Chunk text is sliced from the
original document, so newlines and indentation (code in a manual) survive.
"""
from __future__ import annotations

import re

from ..schemas.artifacts import ChunkRow
from ..schemas.config import ChunkConfig

_WORD = re.compile(r"\S+")


def word_spans(text: str) -> list[tuple[int, int]]:
    """Character (start, end) of every whitespace-separated word, in order."""
    return [m.span() for m in _WORD.finditer(text)]


def chunk_bounds(n_words: int, words: int, overlap: int) -> list[tuple[int, int]]:
    """Word ranges [start, end) covering 0 … n_words−1 with the overlap and tail rules above."""
    if n_words <= 0:
        raise ValueError("cannot chunk a document with no words")
    step = words - overlap
    bounds = [(0, min(words, n_words))]
    while bounds[-1][1] < n_words:
        start = bounds[-1][0] + step
        end = min(start + words, n_words)
        if end == n_words and end - bounds[-1][1] < overlap:  # tiny tail: grow the previous chunk
            bounds[-1] = (bounds[-1][0], end)
        else:
            bounds.append((start, end))
    return bounds


def chunk_document(text: str, cfg: ChunkConfig) -> list[ChunkRow]:
    spans = word_spans(text)
    rows = []
    for i, (s, e) in enumerate(chunk_bounds(len(spans), cfg.words, cfg.overlap)):
        body = text[spans[s][0]:spans[e - 1][1]]
        rows.append(ChunkRow(chunk_id=i, start_word=s, end_word=e, n_words=e - s, text=body))
    return rows
