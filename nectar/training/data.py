"""Reading training batches from the targets Zarr group (layout: TargetsHeader's docstring).

Two kinds of batches:
  * token batches (pure regression): any b query tokens of the train split — (q, α, A) rows;
  * pair batches (distillation active): b whole pairs, right-padded, with their token ids, the
    teacher's top-K at every position, the positions whose next token is a response token (the
    KL / accuracy mask), and the (q, α, A) rows of their real tokens.

The data order is a pure function of (seed, step): epoch e is a permutation seeded by (seed, e),
and step s takes items [s·b, (s+1)·b) of the concatenated epochs. Resuming needs only the step.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from ..schemas.artifacts import SPLIT_CODES, TargetsHeader
from ..tables import ArtifactError
from ..targets.store import open_targets

# Targets below this size are read into memory once (random token batches would otherwise decode
# a whole zarr chunk per token); bigger stores are read per batch.
IN_MEMORY_BYTES = 8 << 30
VALUE_ARRAYS = ("q", "alpha", "A")


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


class TargetsData:
    """A complete targets group, validated, with its small per-token arrays in memory."""

    def __init__(self, url: str, in_memory_bytes: int = IN_MEMORY_BYTES):
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
        self.token_ids = np.asarray(self.group["token_ids"][:], dtype=np.int64)  # [T]
        self.response_mask = np.asarray(self.group["response_mask"][:], dtype=bool)  # [T]
        self.topk_ids = np.asarray(self.group["topk_ids"][:], dtype=np.int64)  # [T, K]
        self.topk_logprobs = np.asarray(self.group["topk_logprobs"][:], dtype=np.float32)  # [T, K]
        self._values: dict[str, np.ndarray] | None = None
        if self.value_bytes() <= in_memory_bytes:
            self._values = {name: self._read_range(name, 0, h.n_tokens) for name in VALUE_ARRAYS}

    def value_bytes(self) -> int:
        h = self.header
        per_token = h.num_layers * h.num_q_heads * (2 * h.head_dim + 1) * 4
        return per_token * h.n_tokens

    def _read_range(self, name: str, start: int, stop: int) -> np.ndarray:
        return np.asarray(self.group[name][start:stop], dtype=np.float32)

    # ---- splits -------------------------------------------------------------------------------
    def pairs(self, split: str) -> np.ndarray:
        if split not in SPLIT_CODES:
            raise ValueError(f"unknown split {split!r}; the targets' splits are {sorted(SPLIT_CODES)}")
        code = SPLIT_CODES[split]
        return np.flatnonzero(self.pair_split == code)

    def tokens(self, split: str) -> np.ndarray:
        """Global token indices of the split's pairs."""
        ps = self.pairs(split)
        if len(ps) == 0:
            return np.zeros(0, dtype=np.int64)
        return np.concatenate([np.arange(self.offsets[p], self.offsets[p + 1]) for p in ps])

    # ---- reads --------------------------------------------------------------------------------
    def rows(self, index: np.ndarray) -> TokenBatch:
        """(q, α, A) rows of the given global token indices, in that order."""
        index = np.asarray(index, dtype=np.int64)
        if self._values is not None:
            vals = {k: v[index] for k, v in self._values.items()}
        else:
            uniq, inverse = np.unique(index, return_inverse=True)
            vals = {k: np.asarray(self.group[k].get_orthogonal_selection((uniq,)), dtype=np.float32)[inverse]
                    for k in VALUE_ARRAYS}
        return TokenBatch(*(torch.from_numpy(np.ascontiguousarray(vals[k])) for k in VALUE_ARRAYS))

    def pair_batch(self, pair_index: np.ndarray, pad_id: int = 0) -> PairBatch:
        spans = [(int(self.offsets[p]), int(self.offsets[p + 1])) for p in pair_index]
        b, m = len(spans), max(e - s for s, e in spans)
        K = self.header.top_k
        ids = np.full((b, m), pad_id, dtype=np.int64)
        mask = np.zeros((b, m), dtype=np.int64)
        next_ids = np.zeros((b, m), dtype=np.int64)
        kl_mask = np.zeros((b, m), dtype=bool)
        topk_ids = np.zeros((b, m, K), dtype=np.int64)
        topk_lp = np.zeros((b, m, K), dtype=np.float32)
        for i, (s, e) in enumerate(spans):
            k = e - s
            ids[i, :k] = self.token_ids[s:e]
            mask[i, :k] = 1
            next_ids[i, : k - 1] = self.token_ids[s + 1:e]
            kl_mask[i, : k - 1] = self.response_mask[s + 1:e]
            topk_ids[i, :k] = self.topk_ids[s:e]
            topk_lp[i, :k] = self.topk_logprobs[s:e]
        token_index = np.concatenate([np.arange(s, e) for s, e in spans])
        t = torch.from_numpy
        return PairBatch(self.rows(token_index), t(ids), t(mask), t(next_ids), t(kl_mask), t(topk_ids), t(topk_lp))

    def kl_positions(self, pair_index: np.ndarray) -> int:
        """How many KL/accuracy positions these pairs have (for exact global loss normalisation)."""
        total = 0
        for p in pair_index:
            s, e = int(self.offsets[p]), int(self.offsets[p + 1])
            total += int(self.response_mask[s + 1:e].sum())
        return total

    def pair_tokens(self, pair_index: np.ndarray) -> int:
        return int(sum(self.offsets[p + 1] - self.offsets[p] for p in pair_index))


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


def shard_for_rank(batch: np.ndarray, rank: int, world_size: int) -> np.ndarray:
    """This rank's share of a global batch (strided, so shares differ in size by at most one)."""
    return batch[rank::world_size]


def target_statistics(data: TargetsData, num_kv_heads: int, max_tokens: int = 8192,
                      seed: int = 0) -> dict[str, torch.Tensor]:
    """Per (layer, KV head) mean/std of q, α and A over train tokens (query heads of a group pooled).

    Means of q and A are per coordinate [L, Hkv, d]; stds are one scalar per head [L, Hkv] so a
    near-constant coordinate can't blow up the normalised loss. Tokens with non-finite targets are
    left out (the loop masks their steps; they must not poison every prediction).
    """
    tokens = data.tokens("train")
    if len(tokens) > max_tokens:
        tokens = np.sort(np.random.default_rng(seed).choice(tokens, max_tokens, replace=False))
    batch = data.rows(tokens)
    finite = (batch.q.flatten(1).isfinite().all(1) & batch.A.flatten(1).isfinite().all(1)
              & batch.alpha.flatten(1).isfinite().all(1))  # [T]: one corrupt row must not poison the stats
    if not bool(finite.any()):
        raise ArtifactError(f"{data.url}: every sampled train token has non-finite targets")
    batch = TokenBatch(batch.q[finite], batch.alpha[finite], batch.A[finite])
    T, L, hq, d = batch.q.shape
    g = hq // num_kv_heads

    def grouped(x: torch.Tensor) -> torch.Tensor:  # [T, L, Hq, …] → [T·g, L, Hkv, …]
        x = x.reshape(T, L, num_kv_heads, g, *x.shape[3:]).movedim(3, 1)
        return x.reshape(T * g, L, num_kv_heads, *x.shape[4:])

    stats = {}
    for name in ("q", "A"):
        x = grouped(getattr(batch, name).double())  # [N, L, Hkv, d]
        mean = x.mean(0)
        stats[f"{name}_mean"] = mean.float()
        stats[f"{name}_std"] = ((x - mean).pow(2).mean((0, 3)).sqrt().clamp_min(1e-6)).float()
    a = grouped(batch.alpha.double())  # [N, L, Hkv]
    stats["alpha_mean"] = a.mean(0).float()
    stats["alpha_std"] = a.std(0, unbiased=False).clamp_min(1e-6).float()
    return stats

