"""The targets stage: exact attention targets for every kept pair, written to sharded Zarr.

The document KV is prefilled once (and saved beside the targets for later stages); batches of pairs
then run query-only forwards with the exact document provider. Writes are buffered to whole shards;
``written_tokens`` in the group attributes records progress, so a killed run resumes from the last
completed shard instead of starting over.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from ..attention.prefix import DocKV, ExactDocState
from ..layout import PromptLayout
from ..models import BaseModel
from ..schemas.artifacts import DatasetRow, TargetsHeader, TargetsPairRow
from ..schemas.config import TargetsConfig
from ..tables import write_table
from ..targets.capture import capture_batch
from ..targets.store import create_targets, open_targets

Progress = Callable[[int, int], None]


class TargetsInputError(ValueError):
    pass


@dataclass
class PlannedPair:
    row: TargetsPairRow
    ids: list[int]


def plan_pairs(rows: list[DatasetRow], layout: PromptLayout, cfg: TargetsConfig) -> list[PlannedPair]:
    """Tokenize kept pairs of the configured splits, train first; truncate to max_query_tokens."""
    kept = [r for r in rows if r.kept and r.split in cfg.splits]
    tokens = {r.pair_id: layout.pair(r.instruction, r.response) for r in kept}
    # Train first; within a split by length, so padded batches hold pairs of similar length.
    kept.sort(key=lambda r: (r.split != "train", len(tokens[r.pair_id].ids), r.pair_id))
    planned, start = [], 0
    for i, r in enumerate(kept):
        q = tokens[r.pair_id]
        ids = q.ids[: cfg.max_query_tokens]
        planned.append(PlannedPair(TargetsPairRow(
            index=i, pair_id=r.pair_id, task=r.task, split=r.split, challenge=r.challenge, start=start,
            length=len(ids), response_start=min(q.response_start, len(ids)),
            truncated=len(ids) < len(q.ids)), ids))
        start += len(ids)
    return planned


def build_targets(
    base: BaseModel,
    layout: PromptLayout,
    doc_kv: DocKV,
    rows: list[DatasetRow],
    cfg: TargetsConfig,
    out_url: str,
    doc_sha256: str,
    backend: str = "auto",
    progress: Progress | None = None,
) -> dict:
    planned = plan_pairs(rows, layout, cfg)
    if not planned:
        raise TargetsInputError("the dataset has no kept train/test pairs; nothing to cache (check verify)")
    header = _header(base, layout, cfg, planned, doc_sha256)
    zurl = f"{out_url}/targets.zarr"
    g = _open_or_create(zurl, header, cfg)
    written = int(g.attrs.get("written_tokens", 0))
    offsets = np.array([p.row.start for p in planned] + [header.n_tokens], dtype=np.int64)
    first = int(np.searchsorted(offsets[1:], written, side="right"))  # first pair not fully written
    writer = _ShardWriter(g, header.n_tokens, cfg.shard_tokens, written, offsets[first])
    provider = ExactDocState(doc_kv, backend=backend)
    for lo in range(first, len(planned), cfg.batch_size):
        batch = planned[lo: lo + cfg.batch_size]
        writer.add(_capture(base, provider, batch, layout.n, cfg.top_k))
        if progress:
            progress(min(lo + cfg.batch_size, len(planned)), len(planned))
    writer.flush(final=True)
    g["pair_offsets"][:] = offsets
    g["pair_split"][:] = np.array([0 if p.row.split == "train" else 1 for p in planned], dtype=np.int8)
    g.attrs["nectar_targets"] = header.model_copy(update={"complete": True}).model_dump(mode="json")
    write_table(f"{out_url}/pairs.parquet", [p.row for p in planned], TargetsPairRow)
    return {"pairs": len(planned), "tokens": header.n_tokens, "truncated": sum(p.row.truncated for p in planned),
            **{f"pairs_{k}": v for k, v in header.split_pairs.items()}}


def _header(base, layout, cfg, planned, doc_sha256) -> TargetsHeader:
    splits: dict[str, int] = {}
    for p in planned:
        splits[p.row.split] = splits.get(p.row.split, 0) + 1
    return TargetsHeader(
        model=base.name, model_hash=base.weights_hash, doc_sha256=doc_sha256, n_context=layout.n,
        num_layers=base.num_layers, num_q_heads=base.num_q_heads, num_kv_heads=base.num_kv_heads,
        head_dim=base.head_dim, scaling=base.scaling, top_k=cfg.top_k, dtype=cfg.dtype,
        n_pairs=len(planned), n_tokens=sum(p.row.length for p in planned), split_pairs=splits)


def _open_or_create(zurl: str, header: TargetsHeader, cfg: TargetsConfig):
    """Resume a group made for exactly this header; otherwise start a fresh one."""
    try:
        g, existing = open_targets(zurl, mode="r+")
        if existing.model_copy(update={"complete": False}) == header:
            return g
    except Exception:  # missing or unreadable: start over
        pass
    return create_targets(zurl, header, cfg.chunk_tokens, cfg.shard_tokens)


def _capture(base, provider, batch: list[PlannedPair], n: int, top_k: int) -> dict[str, np.ndarray]:
    """Run one padded batch and return token-major rows for its real tokens, concatenated."""
    m = max(len(p.ids) for p in batch)
    ids = torch.zeros((len(batch), m), dtype=torch.long, device=base.device)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(batch):
        ids[i, : len(p.ids)] = torch.as_tensor(p.ids)
        mask[i, : len(p.ids)] = 1
    cap = capture_batch(base, provider, ids, mask, n, top_k)
    parts: dict[str, list[np.ndarray]] = {k: [] for k in
                                          ("q", "alpha", "A", "topk_ids", "topk_logprobs", "token_ids",
                                           "positions", "response_mask")}
    for i, p in enumerate(batch):
        k = len(p.ids)
        parts["q"].append(cap.q[i, :k].cpu().numpy())
        parts["alpha"].append(cap.alpha[i, :k].cpu().numpy())
        parts["A"].append(cap.A[i, :k].cpu().numpy())
        parts["topk_ids"].append(cap.topk_ids[i, :k].cpu().numpy())
        parts["topk_logprobs"].append(cap.topk_logprobs[i, :k].cpu().numpy())
        parts["token_ids"].append(np.asarray(p.ids, dtype=np.int32))
        parts["positions"].append(np.arange(n, n + k, dtype=np.int32))
        parts["response_mask"].append(np.arange(k) >= p.row.response_start)
    return {key: np.concatenate(v) for key, v in parts.items()}


class _ShardWriter:
    """Buffers token rows and writes whole shards; records progress after each write."""

    def __init__(self, g, total: int, shard: int, written: int, buffer_start: int):
        self.g, self.total, self.shard = g, total, shard
        self.written = written  # tokens [0, written) are on disk
        self.buf_start = int(buffer_start)  # token index of the buffer's first row
        self.buf: dict[str, list[np.ndarray]] = {}

    def add(self, rows: dict[str, np.ndarray]) -> None:
        for k, v in rows.items():
            self.buf.setdefault(k, []).append(v)
        self.flush(final=False)

    def flush(self, final: bool) -> None:
        if not self.buf:
            return
        data = {k: np.concatenate(v) for k, v in self.buf.items()}
        end = self.buf_start + len(data["token_ids"])
        stop = end if final else (end // self.shard) * self.shard  # write up to a shard boundary
        if stop <= self.written:
            return
        lo = self.written - self.buf_start  # rows before `written` were already on disk (resume)
        hi = stop - self.buf_start
        for k, v in data.items():
            arr = self.g[k]
            arr[self.written:stop] = v[lo:hi].astype(arr.dtype, copy=False)
        self.written = stop
        self.g.attrs["written_tokens"] = stop
        self.buf = {k: [v[hi:]] for k, v in data.items()}
        self.buf_start = stop
