"""Reading training batches from the targets Zarr group (layout: TargetsHeader's docstring), streamed.

Two kinds of batches:
  * token batches (pure regression): any b query tokens of the train split — (q, α, A) rows;
  * pair batches (distillation active): b whole pairs, right-padded, with their token ids, the
    teacher's top-K at every position, the positions whose next token is a response token (the
    KL / accuracy mask), and the (q, α, A) rows of their real tokens.

Nothing is read into memory whole: every per-token array is read in whole zarr chunks
(``chunk_tokens`` rows, chunk-aligned) through a bounded LRU of decoded chunks (``ChunkCache``),
and a prefetch thread loads the chunks of the next window (tokens) or the next step's pairs while
the current step trains. Memory is the cache's bound, however large the store; in memory beside it
are only per-pair arrays (offsets, splits).

The data order is a pure function of (seed, step), so resuming needs only the step:
  * pairs: epoch e is a permutation of the split's pairs seeded by (seed, e) (``batch_items``);
  * tokens (``TokenStream``): epoch e permutes the store's chunks (seeded by (seed, e)), groups them
    into windows of ``window_tokens`` and permutes the split's tokens within each window (seeded by
    (seed, e, w)). A window is read once, chunk-aligned, and every token of the split is visited
    once per epoch. Step s takes items [s·b, (s+1)·b) of the concatenated epochs.
"""
from __future__ import annotations

import functools
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from ..schemas.artifacts import SPLIT_CODES, TargetsHeader
from ..tables import ArtifactError
from ..targets.store import VALUE_ARRAYS, array_view, decode_values, open_targets

# Chunks kept in memory at most (bytes, as stored); at least two token windows (the one being
# trained on and the one being prefetched) and a few chunks more are always allowed.
CACHE_BYTES = 1 << 30
TOKEN_ARRAYS = ("token_ids", "response_mask", "topk_ids", "topk_logprobs")

# (q, α, A) of global token indices, computed rather than read (online targets, nectar/targets/online.py).
ValueSource = Callable[[np.ndarray], "TokenBatch"]


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
        return int(sum(self.offsets[p + 1] - self.offsets[p] for p in pair_index))

    # ---- data order ---------------------------------------------------------------------------
    def stream(self, split: str, by_pairs: bool, seed: int) -> "PairStream | TokenStream":
        """The split's training items in a (seed, step)-pure order, with reads prefetched."""
        return PairStream(self, split, seed) if by_pairs else TokenStream(self, split, seed, self.window_tokens)


@functools.lru_cache(maxsize=8)
def _epoch_permutation(seed: int, epoch: int, n_items: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(n_items)


def batch_items(items: np.ndarray, step: int, batch_size: int, seed: int) -> np.ndarray:
    """The items of global batch ``step`` (0-based): a pure function of (seed, step)."""
    n = len(items)
    if n == 0:
        raise ArtifactError("the targets have no training items (no train pairs); check the verify split")
    out = np.empty(batch_size, dtype=items.dtype)
    for j, i in enumerate(range(step * batch_size, (step + 1) * batch_size)):
        epoch, pos = divmod(i, n)
        out[j] = items[_epoch_permutation(seed, epoch, n)[pos]]
    return out


class PairStream:
    """Whole pairs of a split: epoch permutations of the pairs (``batch_items``); the chunks of the
    next step's pairs are prefetched while this step trains."""

    def __init__(self, data: TargetsData, split: str, seed: int):
        self.data, self.seed = data, seed
        self.items = data.pairs(split)
        self.n_items = len(self.items)

    def batch(self, step: int, batch_size: int) -> np.ndarray:
        out = batch_items(self.items, step, batch_size, self.seed)
        nxt = batch_items(self.items, step + 1, batch_size, self.seed)
        self.data.cache.prefetch(np.unique(self.data.span_index(nxt) // self.data.chunk_tokens))
        return out


class TokenStream:
    """Tokens of a split in chunk windows (module docstring): every token once per epoch, each
    window read whole and chunk-aligned, the next window prefetched while this one trains."""

    def __init__(self, data: TargetsData, split: str, seed: int, window_tokens: int):
        self.data, self.split, self.seed = data, split, seed
        C, T = data.chunk_tokens, data.header.n_tokens
        self.n_chunks = -(-T // C)
        bounds = np.minimum(np.arange(self.n_chunks + 1) * C, T)
        self.per_chunk = np.diff(data.split_tokens_below(split, bounds))  # [n_chunks] split tokens in each
        self.n_items = int(self.per_chunk.sum())
        if self.n_items == 0:
            raise ArtifactError(f"the targets have no {split} tokens; check the verify split")
        self.window_chunks = max(1, window_tokens // C)
        self._memo: OrderedDict[tuple, object] = OrderedDict()  # a few epochs' windows and windows' items

    def _memoised(self, key: tuple, make):
        if key not in self._memo:
            self._memo[key] = make()
            while len(self._memo) > 8:
                self._memo.popitem(last=False)
        return self._memo[key]

    def _windows(self, epoch: int) -> tuple[list[np.ndarray], np.ndarray]:
        """Epoch ``epoch``: its windows (chunk ids) and where each window starts in the epoch's items."""
        return self._memoised(("windows", epoch), lambda: self._make_windows(epoch))

    def _make_windows(self, epoch: int) -> tuple[list[np.ndarray], np.ndarray]:
        used = np.flatnonzero(self.per_chunk)
        order = used[np.random.default_rng([self.seed, epoch]).permutation(len(used))]
        windows = [order[i:i + self.window_chunks] for i in range(0, len(order), self.window_chunks)]
        sizes = np.array([self.per_chunk[w].sum() for w in windows], dtype=np.int64)
        return windows, np.concatenate([[0], np.cumsum(sizes)])

    def _window_items(self, epoch: int, w: int) -> np.ndarray:
        return self._memoised(("items", epoch, w), lambda: self._make_window_items(epoch, w))

    def _make_window_items(self, epoch: int, w: int) -> np.ndarray:
        """The split's global token indices of window w of epoch ``epoch``, in their shuffled order."""
        chunks = self._windows(epoch)[0][w]
        C, T = self.data.chunk_tokens, self.data.header.n_tokens
        idx = np.concatenate([np.arange(c * C, min((c + 1) * C, T)) for c in chunks])
        d = self.data
        pair = np.searchsorted(d.offsets, idx, side="right") - 1
        idx = idx[d.in_split(d.pair_split[pair], self.split)]
        return idx[np.random.default_rng([self.seed, epoch, w]).permutation(len(idx))]

    def _locate(self, i: int) -> tuple[int, int, int]:
        epoch, pos = divmod(i, self.n_items)
        starts = self._windows(epoch)[1]
        w = int(np.searchsorted(starts, pos, side="right") - 1)
        return epoch, w, pos - int(starts[w])

    def batch(self, step: int, batch_size: int) -> np.ndarray:
        out = np.empty(batch_size, dtype=np.int64)
        for j, i in enumerate(range(step * batch_size, (step + 1) * batch_size)):
            epoch, w, k = self._locate(i)
            out[j] = self._window_items(epoch, w)[k]
        # The window after the last item of this batch, read in the background meanwhile.
        epoch, w, _ = self._locate((step + 1) * batch_size - 1)
        windows = self._windows(epoch)[0]
        nxt = windows[w + 1] if w + 1 < len(windows) else self._windows(epoch + 1)[0][0]
        self.data.cache.prefetch(np.concatenate([windows[w], nxt]))
        return out


def shard_for_rank(batch: np.ndarray, rank: int, world_size: int) -> np.ndarray:
    """This rank's share of a global batch (strided, so shares differ in size by at most one)."""
    return batch[rank::world_size]


def target_statistics(data: TargetsData, num_kv_heads: int, max_tokens: int = 8192,
                      seed: int = 0, block_tokens: int = 512) -> dict[str, torch.Tensor]:
    """Per (layer, KV head) mean/std of q, α and A over train tokens (query heads of a group pooled).

    Means of q and A are per coordinate [L, Hkv, d]; stds are one scalar per head [L, Hkv] so a
    near-constant coordinate can't blow up the normalised loss. The sample is whole train pairs in a
    seeded order until ``max_tokens`` tokens (contiguous reads; online targets compute whole pairs,
    no prefix thrown away), accumulated in float64 over blocks of ``block_tokens`` rows, so memory
    is a block whatever the sample. Tokens with non-finite targets are left out (the loop masks
    their steps; they must not poison every prediction).
    """
    pairs = data.pairs("train")
    pairs = pairs[np.random.default_rng(seed).permutation(len(pairs))]
    lengths = data.offsets[pairs + 1] - data.offsets[pairs]
    keep = int(np.searchsorted(np.cumsum(lengths), max_tokens)) + 1  # pairs until max_tokens
    tokens = data.span_index(np.sort(pairs[:keep])) if len(pairs) else np.zeros(0, dtype=np.int64)
    acc = _Moments()
    for start in range(0, len(tokens), block_tokens):
        acc.add(data.rows(tokens[start:start + block_tokens]), num_kv_heads)
    if acc.n == 0:
        raise ArtifactError(f"{data.url}: every sampled train token has non-finite targets")
    return acc.statistics()


class _Moments:
    """Running float64 sums for ``target_statistics`` (one pass, any number of blocks)."""

    def __init__(self):
        self.n = 0  # grouped rows seen: tokens x query heads per KV head
        self.sums: dict[str, torch.Tensor] = {}

    def add(self, batch: TokenBatch, num_kv_heads: int) -> None:
        q, alpha, A = batch.q.cpu(), batch.alpha.cpu(), batch.A.cpu()
        finite = q.flatten(1).isfinite().all(1) & A.flatten(1).isfinite().all(1) & alpha.flatten(1).isfinite().all(1)
        if not bool(finite.any()):
            return
        q, alpha, A = q[finite], alpha[finite], A[finite]
        T, L, hq = alpha.shape
        g = hq // num_kv_heads

        def grouped(x: torch.Tensor) -> torch.Tensor:  # [T, L, Hq, …] → [T·g, L, Hkv, …] float64
            x = x.double().reshape(T, L, num_kv_heads, g, *x.shape[3:]).movedim(3, 1)
            return x.reshape(T * g, L, num_kv_heads, *x.shape[4:])

        parts = {"q": grouped(q), "A": grouped(A), "alpha": grouped(alpha)}
        for name, x in parts.items():  # Σx per coordinate, Σx² per head (q, A) or per head (α)
            s1, s2 = x.sum(0), x.pow(2).sum(0)
            s2 = s2.sum(-1) if name != "alpha" else s2  # [L, Hkv]
            for key, v in ((f"{name}_s1", s1), (f"{name}_s2", s2)):
                self.sums[key] = self.sums[key] + v if key in self.sums else v
        self.n += T * g

    def statistics(self) -> dict[str, torch.Tensor]:
        n, out = self.n, {}
        for name in ("q", "A"):
            mean = self.sums[f"{name}_s1"] / n  # [L, Hkv, d]
            d = mean.shape[-1]
            var = (self.sums[f"{name}_s2"] / n - mean.pow(2).sum(-1)) / d  # mean over d of per-coordinate variances
            out[f"{name}_mean"] = mean.float()
            out[f"{name}_std"] = var.clamp_min(0).sqrt().clamp_min(1e-6).float()
        mean = self.sums["alpha_s1"] / n
        out["alpha_mean"] = mean.float()
        out["alpha_std"] = (self.sums["alpha_s2"] / n - mean.pow(2)).clamp_min(0).sqrt().clamp_min(1e-6).float()
        return out
