"""Shared-prefix KV caches for the local backend.

Verification asks hundreds of questions about the same document: every prompt is
``template + document + question``. The document part is prefilled ONCE into a KV cache, kept in a
small LRU keyed by the prefix's token hash, and every batch of questions runs on top of a batch
expansion-free view of it — the document is never prefilled per request (docs/design.md §3).
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

import torch

from ..attention.doc_kv import DocKV, prefill_document

PREFILL_CHUNK = 1024  # tokens per forward when prefilling: bounds activation memory on long documents


@dataclass(frozen=True)
class PrefixKV:
    ids: tuple[int, ...]
    kv: DocKV  # per layer [h_kv, P, d]: served to the decode engine by the exact document provider

    @property
    def length(self) -> int:
        return len(self.ids)

    @property
    def key(self) -> str:
        return token_hash(self.ids)

    def nbytes(self) -> int:
        return self.kv.nbytes()

    def doc_kv(self) -> DocKV:
        return self.kv


def token_hash(ids: Sequence[int]) -> str:
    return hashlib.sha256(torch.tensor(list(ids), dtype=torch.int64).numpy().tobytes()).hexdigest()


def common_prefix_len(seqs: Sequence[Sequence[int]]) -> int:
    if not seqs:
        return 0
    first, n = seqs[0], min(len(s) for s in seqs)
    for i in range(n):
        t = first[i]
        if any(s[i] != t for s in seqs):
            return i
    return n


def prefill(base, ids: Sequence[int], start: PrefixKV | None = None) -> PrefixKV:
    """KV cache of ``ids`` (a BaseLM's one document prefill), continuing from ``start`` when it is
    a prefix of ``ids``."""
    if start is not None and tuple(ids[: start.length]) != start.ids:
        raise ValueError("prefill: the cached prefix is not a prefix of these tokens")
    kv = prefill_document(base, ids, chunk_tokens=PREFILL_CHUNK, start=start.kv if start is not None else None)
    return PrefixKV(tuple(ids), kv)


class PrefixCacheLRU:
    """The last few prefixes computed; a lookup finds the longest one shared by all prompts."""

    def __init__(self, max_entries: int = 4):
        self.max_entries = max_entries
        self._entries: OrderedDict[str, PrefixKV] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    def longest_shared(self, prompts: Sequence[Sequence[int]]) -> PrefixKV | None:
        best = None
        for entry in self._entries.values():
            n = entry.length
            if all(len(p) > n and tuple(p[:n]) == entry.ids for p in prompts):
                if best is None or n > best.length:
                    best = entry
        if best is not None:
            self._entries.move_to_end(best.key)
        return best

    def put(self, entry: PrefixKV) -> None:
        self._entries[entry.key] = entry
        self._entries.move_to_end(entry.key)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)
