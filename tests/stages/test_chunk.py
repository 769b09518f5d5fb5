"""chunk: coverage, overlap and tail rules, as properties over random sizes and on real text."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nectar.documents import load_document
from nectar.schemas.config import ChunkConfig
from nectar.stages.chunk import chunk_bounds, chunk_document


@settings(max_examples=300, deadline=None)
@given(n=st.integers(1, 3000), words=st.integers(2, 400), data=st.data())
def test_every_word_covered_with_overlap_and_no_tiny_tail(n, words, data):
    overlap = data.draw(st.integers(0, words - 1))
    bounds = chunk_bounds(n, words, overlap)
    assert bounds[0][0] == 0 and bounds[-1][1] == n
    for (s0, e0), (s1, e1) in zip(bounds, bounds[1:]):
        assert s1 == s0 + words - overlap  # fixed stride
        assert e0 - s1 == overlap  # consecutive chunks share exactly `overlap` words → no gap
    for s, e in bounds[:-1]:
        assert e - s == words
    if len(bounds) > 1:
        assert bounds[-1][1] - bounds[-2][1] >= min(overlap, words - overlap)  # no tiny last chunk
    s, e = bounds[-1]
    assert e - s <= words + max(overlap - 1, 0)  # a merged tail adds fewer than `overlap` words
    covered = set()
    for s, e in bounds:
        covered.update(range(s, e))
    assert covered == set(range(n))


def test_tiny_document_is_one_chunk():
    rows = chunk_document("just three words", ChunkConfig(words=300, overlap=50))
    assert len(rows) == 1
    assert (rows[0].start_word, rows[0].end_word, rows[0].n_words, rows[0].text) == (0, 3, 3, "just three words")


def test_tail_shorter_than_overlap_is_merged():
    # 10-word chunks, stride 7: chunk 2 would add only 2 new words (< overlap 3) → merged.
    assert chunk_bounds(12, 10, 3) == [(0, 12)]
    assert chunk_bounds(17, 10, 3) == [(0, 10), (7, 17)]
    assert chunk_bounds(19, 10, 3) == [(0, 10), (7, 19)]
    assert chunk_bounds(20, 10, 3) == [(0, 10), (7, 17), (14, 20)]


def test_no_words_is_an_error():
    with pytest.raises(ValueError, match="no words"):
        chunk_document(" \n\t ", ChunkConfig(words=10, overlap=2))


def test_real_document_chunks_keep_original_text():
    text, _ = load_document("pydoc:naming")
    cfg = ChunkConfig(words=300, overlap=50)
    rows = chunk_document(text, cfg)
    words = text.split()
    assert len(rows) >= 3 and [r.chunk_id for r in rows] == list(range(len(rows)))
    for r in rows:
        assert r.text.split() == words[r.start_word:r.end_word]
        assert r.text in text  # a verbatim slice: newlines and code indentation preserved
    assert rows[-1].end_word == len(words)
