"""Training batches over the targets reader (``nectar.targets.reader``), in a (seed, step)-pure order.

Two kinds of batches:
  * token batches (pure regression): any b query tokens of the train split — (q, α, A) rows;
  * pair batches (distillation active): b whole pairs, right-padded, with their token ids, the
    teacher's top-K at every position, the positions whose next token is a response token (the
    KL / accuracy mask), and the (q, α, A) rows of their real tokens.

The reader's prefetch thread loads the chunks of the next window (tokens) or the next step's pairs
while the current step trains.

The data order is a pure function of (seed, step), so resuming needs only the step:
  * pairs: epoch e is a permutation of the split's pairs seeded by (seed, e) (``batch_items``);
  * tokens (``TokenStream``): epoch e permutes the store's chunks (seeded by (seed, e)), groups them
    into windows of ``window_tokens`` and permutes the split's tokens within each window (seeded by
    (seed, e, w)). A window is read once, chunk-aligned, and every token of the split is visited
    once per epoch. Step s takes items [s·b, (s+1)·b) of the concatenated epochs.
"""
from __future__ import annotations

import functools
from collections import OrderedDict

import numpy as np
import torch

from ..tables import ArtifactError
from ..targets.reader import TargetsData, TokenBatch


def stream(data: TargetsData, split: str, by_pairs: bool, seed: int) -> "PairStream | TokenStream":
    """The split's training items in a (seed, step)-pure order, with reads prefetched."""
    return PairStream(data, split, seed) if by_pairs else TokenStream(data, split, seed, data.window_tokens)


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


UNUSED_SPLIT = -1  # pair_split code of pairs a ``limit_query_tokens`` subset leaves out (in no split)


def subset_pairs(data: TargetsData, split: str, max_tokens: int, seed: int) -> np.ndarray:
    """Pairs of ``split`` kept by ``limit_query_tokens``: each named split in turn ("train+recon":
    train first), its pairs in a seeded order, while the running total of query tokens stays within
    ``max_tokens`` (at least one pair). Nested: a larger ``max_tokens`` keeps a superset."""
    order = [p for name in split.split("+")
             for p in _seeded(data.pairs(name), np.random.default_rng([seed, SPLIT_SEED[name]]))]
    lengths = np.diff(data.offsets)[np.asarray(order, dtype=np.int64)]
    keep = max(1, int(np.searchsorted(np.cumsum(lengths), max_tokens, side="right")))
    return np.sort(np.asarray(order[:keep], dtype=np.int64))


SPLIT_SEED = {"train": 0, "recon": 1}


def _seeded(pairs: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    return pairs[rng.permutation(len(pairs))]


def limit_query_tokens(data: TargetsData, split: str, max_tokens: int, seed: int) -> int:
    """Leave every pair of ``split`` outside ``subset_pairs`` out of training (its split code becomes
    ``UNUSED_SPLIT`` in this reader only; the store is not touched), so the data streams, the
    normalisation statistics and the closed-form inits all see the subset. Returns its tokens."""
    keep = subset_pairs(data, split, max_tokens, seed)
    drop = np.setdiff1d(data.pairs(split), keep)
    data.pair_split = data.pair_split.copy()
    data.pair_split[drop] = UNUSED_SPLIT
    return data.pair_tokens(keep)


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
