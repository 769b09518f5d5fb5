"""Reading the targets Zarr group (layout: TargetsHeader's docstring) token by token, streamed.

Nothing is read into memory whole: every per-token array is read in whole zarr chunks
(``chunk_tokens`` rows, chunk-aligned) through a bounded LRU of decoded chunks (``ChunkCache``),
which a prefetch thread fills ahead of the reader. Memory is the cache's bound, however large the
store; in memory beside it are only per-pair arrays (offsets, splits). The training data order over
this reader is ``nectar.training.data``.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from ..schemas.artifacts import SPLIT_CODES, TargetsHeader
from ..tables import ArtifactError
from .store import VALUE_ARRAYS, array_view, decode_values, open_targets

# Chunks kept in memory at most (bytes, as stored); at least two token windows (the one being
# trained on and the one being prefetched) and a few chunks more are always allowed.
CACHE_BYTES = 1 << 30
TOKEN_ARRAYS = ("token_ids", "response_mask", "topk_ids", "topk_logprobs")

# (q, α, A) of global token indices, computed rather than read (online targets, nectar/targets/online.py).
ValueSource = Callable[[np.ndarray], "TokenBatch"]


def padded_groups(lengths, max_tokens: int) -> list[list[int]]:
    """Indices of consecutive items grouped so that each group's padded size (count × its longest) stays
    within ``max_tokens`` (at least one item a group): the training loop's micro-batches of pairs and
    recon_refine's batches of spans."""
    groups: list[list[int]] = []
    cur: list[int] = []
    longest = 0
    for i, k in enumerate(lengths):
        k = int(k)
        if cur and (len(cur) + 1) * max(longest, k) > max_tokens:
            groups.append(cur)
            cur, longest = [], 0
        cur.append(i)
        longest = max(longest, k)
    if cur:
        groups.append(cur)
    return groups


@dataclass
class TokenBatch:
    q: torch.Tensor  # [N, L, Hq, d]
    alpha: torch.Tensor  # [N, L, Hq]
    A: torch.Tensor  # [N, L, Hq, d]

    @property
    def n_tokens(self) -> int:
        return self.q.shape[0]


@dataclass
class PairBatch:
    targets: TokenBatch  # rows of the real (unpadded) tokens, pair after pair
    input_ids: torch.Tensor  # [b, m] right-padded
    attention_mask: torch.Tensor  # [b, m] 1 = real token
    next_ids: torch.Tensor  # [b, m] token at t+1 (0 where none)
    kl_mask: torch.Tensor  # [b, m] bool: t+1 is a response token of the same pair
    topk_ids: torch.Tensor  # [b, m, K] teacher's next-token top-K at t
    topk_logprobs: torch.Tensor  # [b, m, K]


class ChunkCache:
    """Whole chunks of the group's per-token arrays (as stored), read chunk-aligned, LRU-bounded.

    ``prefetch`` queues chunks for a background thread; ``get`` returns a chunk, waiting for a
    queued read or reading it now. Values are decoded to float32 only when gathered, so half-
    precision stores also halve the cache's memory.
    """

    def __init__(self, group, names: tuple[str, ...], chunk_tokens: int, n_tokens: int, capacity: int):
        self.group, self.names = group, names
        self.arrays = {name: group[name] for name in names}  # opened once: group[name] re-reads metadata
        self.chunk_tokens, self.n_tokens = chunk_tokens, n_tokens
        self.capacity = max(1, capacity)
        self._chunks: OrderedDict[int, dict[str, np.ndarray]] = OrderedDict()
        self._pending: dict[int, Future] = {}
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self.reads = 0  # chunks read from the store (for tests and benchmarks)

    def _read(self, chunk: int) -> dict[str, np.ndarray]:
        start = chunk * self.chunk_tokens
        stop = min(start + self.chunk_tokens, self.n_tokens)
        block = {name: a[start:stop] for name, a in self.arrays.items()}  # one chunk each, aligned
        self.reads += 1
        return block

    def _store(self, chunk: int, block: dict[str, np.ndarray]) -> None:
        with self._lock:
            self._chunks[chunk] = block
            self._chunks.move_to_end(chunk)
            while len(self._chunks) > self.capacity:
                self._chunks.popitem(last=False)

    def _load(self, chunk: int) -> dict[str, np.ndarray]:
        block = self._read(chunk)
        self._store(chunk, block)
        return block

    def _prefetched(self, chunk: int) -> dict[str, np.ndarray]:
        try:
            return self._load(chunk)
        finally:
            with self._lock:  # the future must not keep the block alive once the LRU drops it
                self._pending.pop(chunk, None)

    def get(self, chunk: int) -> dict[str, np.ndarray]:
        with self._lock:
            block = self._chunks.get(chunk)
            if block is not None:
                self._chunks.move_to_end(chunk)
                return block
            fut = self._pending.get(chunk)
        if fut is not None:
            return fut.result()
        return self._load(chunk)

    def prefetch(self, chunks) -> None:
        """Read these chunks on the background thread (those not cached or queued already)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="targets-prefetch")
        with self._lock:
            todo = [int(c) for c in dict.fromkeys(chunks) if c not in self._chunks and c not in self._pending]
            for c in todo:
                self._pending[c] = self._pool.submit(self._prefetched, c)

    def gather(self, name: str, index: np.ndarray) -> np.ndarray:
        """Rows ``index`` (global token indices) of array ``name``, as stored, in that order."""
        index = np.asarray(index, dtype=np.int64)
        chunks = index // self.chunk_tokens
        first = self.get(int(chunks[0]))[name] if len(index) else self.arrays[name][0:0]
        out = np.empty((len(index), *first.shape[1:]), dtype=first.dtype)
        for c in np.unique(chunks):
            sel = chunks == c
            out[sel] = self.get(int(c))[name][index[sel] - c * self.chunk_tokens]
        return out

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        with self._lock:
            self._pending.clear()


class TargetsData:
    """A complete targets group, validated; per-token arrays streamed through a ``ChunkCache``."""

    def __init__(self, url: str, cache_bytes: int = CACHE_BYTES, window_tokens: int = 4096):
        self.url = url
        self.group, self.header = open_targets(url, mode="r")
        h: TargetsHeader = self.header
        if not h.complete:
            raise ArtifactError(f"{url}: targets group is incomplete (the targets stage did not finish); "
                                "re-run the targets stage")
        self.offsets = np.asarray(self.group["pair_offsets"][:], dtype=np.int64)  # [P+1]
        self.pair_split = np.asarray(self.group["pair_split"][:], dtype=np.int8)[: h.n_pairs]  # [P]
        if len(self.offsets) != h.n_pairs + 1 or self.offsets[-1] != h.n_tokens:
            raise ArtifactError(f"{url}: pair_offsets has {len(self.offsets)} entries ending at "
                                f"{self.offsets[-1] if len(self.offsets) else None}; the header says "
                                f"{h.n_pairs} pairs, {h.n_tokens} tokens")
        self.chunk_tokens = int(self.group["token_ids"].chunks[0])
        self.online = h.mode == "online"
        names = TOKEN_ARRAYS + (() if self.online else VALUE_ARRAYS)
        self.views = {name: array_view(self.group, name) for name in VALUE_ARRAYS} if not self.online else {}
        chunk_bytes = self.chunk_tokens * sum(int(np.prod(self.group[n].shape[1:])) * self.group[n].dtype.itemsize
                                              for n in names)
        window_chunks = max(1, window_tokens // self.chunk_tokens)
        self.cache = ChunkCache(self.group, names, self.chunk_tokens, h.n_tokens,
                                capacity=max(2 * window_chunks + 2, cache_bytes // max(chunk_bytes, 1)))
        self.window_tokens = window_tokens
        self._values: ValueSource | None = None

    def attach_values(self, source: ValueSource) -> None:
        """Where (q, α, A) come from when the group does not store them (online targets)."""
        self._values = source

    def close(self) -> None:
        self.cache.close()

    def value_bytes(self) -> int:
        """Bytes of the stored (q, α, A) arrays (0 for online targets)."""
        if self.online:
            return 0
        return sum(self.group[n].nbytes for n in VALUE_ARRAYS)

    # ---- splits -------------------------------------------------------------------------------
    def split_codes(self, split: str) -> list[int]:
        """Codes of ``split``; "train+recon" names the union of two splits (training on both)."""
        unknown = [s for s in split.split("+") if s not in SPLIT_CODES]
        if unknown:
            raise ValueError(f"unknown split {unknown[0]!r}; the targets' splits are {sorted(SPLIT_CODES)}")
        return [SPLIT_CODES[s] for s in split.split("+")]

    def in_split(self, codes: np.ndarray, split: str) -> np.ndarray:
        """[P] bool: which of these pair split codes belong to ``split``."""
        return np.isin(codes, self.split_codes(split))

    def pairs(self, split: str) -> np.ndarray:
        return np.flatnonzero(self.in_split(self.pair_split, split))

    def tokens(self, split: str) -> np.ndarray:
        """Global token indices of the split's pairs (O(tokens) memory: for tests and small stores)."""
        ps = self.pairs(split)
        if len(ps) == 0:
            return np.zeros(0, dtype=np.int64)
        return np.concatenate([np.arange(self.offsets[p], self.offsets[p + 1]) for p in ps])

    def split_tokens_below(self, split: str, x: np.ndarray) -> np.ndarray:
        """How many tokens of ``split`` have a global index < x (vectorised; O(pairs) memory)."""
        x = np.asarray(x, dtype=np.int64)
        in_split = self.in_split(self.pair_split, split).astype(np.int64)  # [P]
        lengths = np.diff(self.offsets) * in_split
        before = np.concatenate([[0], np.cumsum(lengths)])  # [P+1] split tokens in pairs < k
        k = np.clip(np.searchsorted(self.offsets, x, side="right") - 1, 0, len(in_split) - 1)
        return before[k] + np.clip(x - self.offsets[k], 0, None) * in_split[k]

    # ---- reads --------------------------------------------------------------------------------
    def rows(self, index: np.ndarray) -> TokenBatch:
        """(q, α, A) rows of the given global token indices, in that order (float32)."""
        index = np.asarray(index, dtype=np.int64)
        if self.online:
            if self._values is None:
                raise ArtifactError(f"{self.url}: online targets store no q/α/A; attach the online "
                                    "source (nectar.targets.online) to compute them")
            return self._values(index)
        vals = [decode_values(self.cache.gather(k, index), self.views[k]) for k in VALUE_ARRAYS]
        return TokenBatch(*(torch.from_numpy(np.ascontiguousarray(v)) for v in vals))

    def token_rows(self, name: str, index: np.ndarray) -> np.ndarray:
        """Rows of a per-token array (token_ids, response_mask, topk_*), as stored."""
        return self.cache.gather(name, index)

    def span_index(self, pair_index: np.ndarray) -> np.ndarray:
        return np.concatenate([np.arange(self.offsets[p], self.offsets[p + 1]) for p in pair_index])

    def pair_batch(self, pair_index: np.ndarray, pad_id: int = 0) -> PairBatch:
        spans = [(int(self.offsets[p]), int(self.offsets[p + 1])) for p in pair_index]
        b, m = len(spans), max(e - s for s, e in spans)
        K = self.header.top_k
        token_index = self.span_index(pair_index)
        tok = self.token_rows("token_ids", token_index).astype(np.int64)
        resp = self.token_rows("response_mask", token_index).astype(bool)
        top_ids = self.token_rows("topk_ids", token_index).astype(np.int64)
        top_lp = self.token_rows("topk_logprobs", token_index).astype(np.float32)
        ids = np.full((b, m), pad_id, dtype=np.int64)
        mask = np.zeros((b, m), dtype=np.int64)
        next_ids = np.zeros((b, m), dtype=np.int64)
        kl_mask = np.zeros((b, m), dtype=bool)
        topk_ids = np.zeros((b, m, K), dtype=np.int64)
        topk_lp = np.zeros((b, m, K), dtype=np.float32)
        at = 0
        for i, (s, e) in enumerate(spans):
            k = e - s
            ids[i, :k] = tok[at:at + k]
            mask[i, :k] = 1
            next_ids[i, : k - 1] = tok[at + 1:at + k]
            kl_mask[i, : k - 1] = resp[at + 1:at + k]
            topk_ids[i, :k] = top_ids[at:at + k]
            topk_lp[i, :k] = top_lp[at:at + k]
            at += k
        t = torch.from_numpy
        return PairBatch(self.rows(token_index), t(ids), t(mask), t(next_ids), t(kl_mask), t(topk_ids), t(topk_lp))

    def kl_positions(self, pair_index: np.ndarray) -> int:
        """How many KL/accuracy positions these pairs have (for exact global loss normalisation)."""
        total = 0
        for p in pair_index:
            s, e = int(self.offsets[p]), int(self.offsets[p + 1])
            if e - s > 1:
                total += int(self.token_rows("response_mask", np.arange(s + 1, e)).sum())
        return total

    def pair_tokens(self, pair_index: np.ndarray) -> int:
        return int(np.diff(self.offsets)[np.asarray(pair_index, dtype=np.int64)].sum())
