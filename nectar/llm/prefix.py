"""Shared-prefix KV caches for the local backend.

Verification asks hundreds of questions about the same document: every prompt is
``template + document + question``. The document part is prefilled ONCE into a KV cache, kept in a
small LRU keyed by the prefix's token hash, and every batch of questions runs on top of a batch
expansion-free view of it — the document is never prefilled per request (DESIGN.md §3).
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Sequence

import torch
from transformers import DynamicCache

PREFILL_CHUNK = 1024  # tokens per forward when prefilling: bounds activation memory on long documents


@dataclass(frozen=True)
class PrefixKV:
    ids: tuple[int, ...]
    kv: tuple[tuple[torch.Tensor, torch.Tensor], ...]  # per layer (keys, values), each [1, h_kv, P, d]

    @property
    def length(self) -> int:
        return len(self.ids)

    @property
    def key(self) -> str:
        return token_hash(self.ids)

    def nbytes(self) -> int:
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in self.kv)

    def doc_kv(self):
        """The prefix as nectar.attention's DocKV: per layer [h_kv, P, d] views, no copy."""
        from ..attention.prefix import DocKV

        return DocKV([k[0] for k, _ in self.kv], [v[0] for _, v in self.kv])

    def expand(self, batch: int, config) -> DynamicCache:
        """A fresh cache holding this prefix for ``batch`` rows ([b, h_kv, P, d] per layer)."""
        data = [(k.expand(batch, -1, -1, -1), v.expand(batch, -1, -1, -1)) for k, v in self.kv]
        return DynamicCache(ddp_cache_data=data, config=config)


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


@torch.inference_mode()
def prefill(model, ids: Sequence[int], base: PrefixKV | None = None) -> PrefixKV:
    """KV cache of ``ids`` (batch 1), continuing from ``base`` when it is a prefix of ``ids``."""
    device = next(model.parameters()).device
    start = 0
    cache = DynamicCache(config=model.config)
    if base is not None:
        assert tuple(ids[: base.length]) == base.ids
        cache, start = base.expand(1, model.config), base.length
    for s in range(start, len(ids), PREFILL_CHUNK):
        chunk = torch.tensor([list(ids[s:s + PREFILL_CHUNK])], device=device)  # [1, c]
        model(input_ids=chunk, past_key_values=cache, use_cache=True, logits_to_keep=1)
    kv = tuple((layer.keys.contiguous(), layer.values.contiguous()) for layer in cache.layers)
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
