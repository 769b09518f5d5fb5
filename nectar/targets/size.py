"""How many bytes a targets group will take, before the stage computes any of it.

Per query token the group holds, at every layer and query head, q and A (head_dim values each, in
the storage dtype) and α (float32), plus the teacher's top-K (int32 ids + float32 log-probs), the
token id, position and response flag. "online" groups hold only the latter. Arrays are stored in
whole chunks of ``chunk_tokens`` rows, so the token count is rounded up to a chunk. At paper scale
(Qwen3-1.7B: 28 layers x 16 query heads x d = 128) that is 460 kB per query token in float32, and
100k pairs of 150 tokens would be about 7 TB: the stage refuses such a run up front
(``targets.max_bytes``) and says how to make it fit.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from .store import STORAGE_DTYPES


class TargetsTooLarge(ValueError):
    """The targets would exceed ``targets.max_bytes``."""


@dataclass(frozen=True)
class TargetsSize:
    n_pairs: int
    n_tokens: int
    num_layers: int
    num_q_heads: int
    head_dim: int
    top_k: int
    dtype: str  # storage of q and A: float32 | float16 | bfloat16
    mode: str  # cached | online
    chunk_tokens: int
    shard_tokens: int

    def value_bytes_per_token(self) -> int:
        """q, A and α at every layer and query head (0 for online targets)."""
        if self.mode == "online":
            return 0
        itemsize = np.dtype(STORAGE_DTYPES[self.dtype]).itemsize
        return self.num_layers * self.num_q_heads * (2 * self.head_dim * itemsize + 4)

    def token_bytes_per_token(self) -> int:
        """Teacher top-K (int32 ids, float32 log-probs), token id, position, response flag."""
        return self.top_k * (4 + 4) + 4 + 4 + 1

    def compressible_bytes(self) -> int:
        """The part of ``total`` in zstd-compressed integer arrays (ids, positions, mask, pair
        arrays): on disk it shrinks, so ``total`` is an upper bound and total minus this a lower one."""
        return self.stored_tokens * (self.top_k * 4 + 4 + 4 + 1) + 8 * (self.n_pairs + 1) + max(self.n_pairs, 1)

    def bytes_per_token(self) -> int:
        return self.value_bytes_per_token() + self.token_bytes_per_token()

    @property
    def stored_tokens(self) -> int:
        """Rows on disk: the arrays are written in whole chunks."""
        return math.ceil(self.n_tokens / self.chunk_tokens) * self.chunk_tokens

    @property
    def total(self) -> int:
        pair_arrays = 8 * (self.n_pairs + 1) + max(self.n_pairs, 1)  # pair_offsets int64, pair_split int8
        return self.stored_tokens * self.bytes_per_token() + pair_arrays + self.overhead()

    def overhead(self) -> int:
        """zarr's metadata (~1 kB of JSON per array, the header on the group) and shard indexes
        (16 B per chunk + a checksum per shard and array): negligible except on tiny runs."""
        token_arrays = 5 + (3 if self.mode == "cached" else 0)
        shard = max(self.chunk_tokens, self.shard_tokens // self.chunk_tokens * self.chunk_tokens)
        shards = math.ceil(self.stored_tokens / shard)
        return 1000 * (token_arrays + 2) + 700 + token_arrays * shards * (16 * (shard // self.chunk_tokens) + 4)

    def describe(self) -> str:
        if self.mode == "online":
            what = "online: q, A, α are computed during training, not stored"
        else:
            itemsize = np.dtype(STORAGE_DTYPES[self.dtype]).itemsize
            what = (f"{self.num_layers} layers x {self.num_q_heads} query heads x (q, A: 2 x {self.head_dim} "
                    f"values x {itemsize} B [{self.dtype}] + α: 4 B)")
        return (f"estimated {human_bytes(self.total)} for {self.n_tokens:,} query tokens of {self.n_pairs:,} pairs "
                f"({self.bytes_per_token():,} B per token: {what}; top-{self.top_k} teacher log-probs, ids)")


def human_bytes(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB", "TB", "PB"):
        if abs(n) < 1000 or unit == "PB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n:.2f} PB"


def check_budget(size: TargetsSize, max_bytes: int) -> None:
    """Refuse a run whose targets exceed ``max_bytes``, with the estimate and the three ways out."""
    if size.total <= max_bytes:
        return
    per_pair = size.total / max(size.n_pairs, 1)
    fit_pairs = int(max_bytes // per_pair) if per_pair else size.n_pairs
    ways = [f"fewer pairs (--set targets.max_pairs={fit_pairs:,} fits)".replace(",", "")
            if fit_pairs >= 1 else "fewer pairs (not even one pair fits)"]
    if size.mode == "cached" and size.dtype == "float32":
        half = replace(size, dtype="bfloat16").total
        ways.append(f"half-precision storage (--set targets.dtype=bfloat16 or float16: {human_bytes(half)})")
    if size.mode == "cached":
        online = replace(size, mode="online").total
        ways.append(f"online targets recomputed in every training step (--set targets.mode=online: "
                    f"{human_bytes(online)})")
    raise TargetsTooLarge(
        f"the targets would take {human_bytes(size.total)} ({size.n_tokens:,} query tokens x "
        f"{size.bytes_per_token():,} B), over targets.max_bytes = {human_bytes(max_bytes)}; "
        f"ways out: {'; '.join(ways)}; or raise targets.max_bytes")
