"""The targets stage: exact attention targets for every kept pair, written to sharded Zarr.

The document KV is prefilled once (and saved beside the targets for later stages); batches of pairs
then run query-only forwards with the exact document provider. Writes are buffered to whole shards;
``written_tokens`` in the group attributes records progress, so a killed run resumes from the last
completed shard instead of starting over. Before any of that, ``targets_size`` estimates the bytes
the group will take and ``check_budget`` refuses a run over ``targets.max_bytes``. With
``targets.mode: online`` only token ids, positions, masks and the teacher's top-K are written.
"""
from __future__ import annotations

import hashlib
import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from ..attention.doc_kv import DocKV
from ..attention.exact import ExactDocState
from ..layout import PromptLayout
from ..base_model import BaseLM
from ..schemas.artifacts import SPLIT_CODES, DatasetRow, TargetsHeader, TargetsPairRow
from ..schemas.config import TargetsConfig
from ..tables import write_table
from ..targets.capture import capture_packed
from ..targets.size import TargetsSize, check_budget
from ..targets.store import create_targets, drop_unfinished_writes, encode_values, open_targets, targets_zarr_url

Progress = Callable[[int, int], None]


class TargetsInputError(ValueError):
    pass


@dataclass
class PlannedPair:
    row: TargetsPairRow
    ids: list[int]


def plan_pairs(rows: list[DatasetRow], layout: PromptLayout, cfg: TargetsConfig) -> list[PlannedPair]:
    """Tokenize kept pairs of the configured splits, train first; truncate to max_query_tokens.
    With ``max_pairs``, a fixed pseudo-random subset (by the hash of the pair id: every split keeps
    about its share, and raising the cap only adds pairs)."""
    kept = [r for r in rows if r.kept and (r.split in cfg.splits or r.split == "recon")]  # recon: when asked for
    if cfg.max_pairs is not None and len(kept) > cfg.max_pairs:
        kept = sorted(kept, key=lambda r: hashlib.sha256(r.pair_id.encode()).hexdigest())[: cfg.max_pairs]
    tokens = {r.pair_id: layout.pair(r.instruction, r.response) for r in kept}
    # Train first; within a split by length (stable, reproducible order).
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
    base: BaseLM,
    layout: PromptLayout,
    doc_kv: DocKV,
    rows: list[DatasetRow],
    cfg: TargetsConfig,
    out_url: str,
    doc_sha256: str,
    backend: str = "auto",
    progress: Progress | None = None,
    planned: list[PlannedPair] | None = None,  # plan_pairs(rows, layout, cfg), when already made
) -> dict:
    planned = plan_pairs(rows, layout, cfg) if planned is None else planned
    if not planned:
        raise TargetsInputError("the dataset has no kept train/test pairs; nothing to cache (check verify)")
    check_budget(targets_size(planned, base, cfg), cfg.max_bytes)
    header = _header(base, layout, cfg, planned, doc_sha256)
    zurl = targets_zarr_url(out_url)
    g = _open_or_create(zurl, header, cfg)
    written = int(g.attrs.get("written_tokens", 0))
    offsets = np.array([p.row.start for p in planned] + [header.n_tokens], dtype=np.int64)
    batches = resume_batches(batch_plan(planned, cfg.batch_size, cfg.batch_tokens), written)
    first = batches[0][0].row.index if batches else len(planned)
    provider = ExactDocState(doc_kv, backend=backend)
    done = first
    shard = g["token_ids"].shards[0]  # the array's own shard (shard_tokens rounded to whole chunks)
    with _ShardWriter(g, shard, written, offsets[first], background=_spare_core(base.device)) as writer:
        for batch in batches:
            writer.add(_capture(base, provider, batch, layout.n, cfg.top_k, cfg.dtype, cfg.mode == "cached"))
            done += len(batch)
            if progress:
                progress(done, len(planned))
        writer.flush()
    g["pair_offsets"][:] = offsets
    g["pair_split"][:] = np.array([SPLIT_CODES[p.row.split] for p in planned], dtype=np.int8)
    g.attrs["nectar_targets"] = header.model_copy(update={"complete": True}).model_dump(mode="json")
    write_table(f"{out_url}/pairs.parquet", [p.row for p in planned], TargetsPairRow)
    return {"pairs": len(planned), "tokens": header.n_tokens, "truncated": sum(p.row.truncated for p in planned),
            **{f"pairs_{k}": v for k, v in header.split_pairs.items()}}


def targets_size(planned: list[PlannedPair], base: BaseLM, cfg: TargetsConfig) -> TargetsSize:
    """What the group for these pairs will take on disk (see nectar/targets/size.py)."""
    return TargetsSize(n_pairs=len(planned), n_tokens=sum(p.row.length for p in planned),
                       num_layers=base.num_layers, num_q_heads=base.num_q_heads, head_dim=base.head_dim,
                       top_k=cfg.top_k, dtype=cfg.dtype, mode=cfg.mode, chunk_tokens=cfg.chunk_tokens,
                       shard_tokens=cfg.shard_tokens)


def batch_plan(planned: list[PlannedPair], batch_size: int, batch_tokens: int) -> list[list[PlannedPair]]:
    """Consecutive batches of at most ``batch_size`` pairs and ``batch_tokens`` query tokens (a
    longer pair runs alone). Pairs are packed back to back, so a batch costs its real tokens only;
    the token cap bounds the forward's activations and recorded rows (~140 kB per token on
    SmolLM2-135M) whatever the pairs' lengths."""
    batches: list[list[PlannedPair]] = []
    cur: list[PlannedPair] = []
    tokens = 0
    for p in planned:
        if cur and (len(cur) >= batch_size or tokens + p.row.length > batch_tokens):
            batches.append(cur)
            cur, tokens = [], 0
        cur.append(p)
        tokens += p.row.length
    if cur:
        batches.append(cur)
    return batches


def resume_batches(batches: list[list[PlannedPair]], written: int) -> list[list[PlannedPair]]:
    """The batches still to run when tokens [0, written) are on disk: from the one holding the first
    unwritten token, whole. A resumed stage runs the uninterrupted plan's own batches (a batch's
    rows can differ in their last bits with its company: another packing is another matmul shape),
    so a resume writes the uninterrupted run's bytes; rows already on disk are recomputed, not
    rewritten (_ShardWriter.add skips them)."""
    for i, batch in enumerate(batches):
        end = batch[-1].row.start + batch[-1].row.length
        if end > written:
            return batches[i:]
    return []


def _header(base, layout, cfg, planned, doc_sha256) -> TargetsHeader:
    splits: dict[str, int] = {}
    for p in planned:
        splits[p.row.split] = splits.get(p.row.split, 0) + 1
    return TargetsHeader(
        model=base.name, model_hash=base.weights_hash, doc_sha256=doc_sha256, n_context=layout.n,
        num_layers=base.num_layers, num_q_heads=base.num_q_heads, num_kv_heads=base.num_kv_heads,
        head_dim=base.head_dim, scaling=base.scaling, top_k=cfg.top_k, topk_scope="kl_positions", dtype=cfg.dtype,
        n_pairs=len(planned), n_tokens=sum(p.row.length for p in planned), split_pairs=splits, mode=cfg.mode)


def _open_or_create(zurl: str, header: TargetsHeader, cfg: TargetsConfig):
    """Resume a group made for exactly this header; otherwise start a fresh one."""
    try:
        g, existing = open_targets(zurl, mode="r+")
        if existing.model_copy(update={"complete": False}) == header:
            drop_unfinished_writes(zurl)  # a killed run's half-written files: not part of the group
            return g
    except Exception:  # missing or unreadable: start over
        pass
    return create_targets(zurl, header, cfg.chunk_tokens, cfg.shard_tokens)


def _capture(base, provider, batch: list[PlannedPair], n: int, top_k: int, dtype: str = "float32",
             record: bool = True) -> dict[str, np.ndarray]:
    """Run one packed batch; return its token-major rows (pairs back to back, as stored: q and A in
    the storage dtype; without q, α, A when not ``record``)."""
    kl_rows = np.zeros(sum(len(p.ids) for p in batch), dtype=bool)
    start = 0
    for p in batch:
        # the teacher's top-K at t is read only where t+1 is a response token (the KL loss)
        kl_rows[start + max(p.row.response_start - 1, 0): start + len(p.ids) - 1] = True
        start += len(p.ids)
    cap = capture_packed(base, provider, [p.ids for p in batch], n, top_k,
                         logit_rows=torch.from_numpy(kl_rows).to(base.device), record=record)
    values = {"q": encode_values(cap.q, dtype), "alpha": encode_values(cap.alpha, "float32"),
              "A": encode_values(cap.A, dtype)} if record else {}
    return {
        **values,
        "topk_ids": cap.topk_ids.cpu().numpy(), "topk_logprobs": cap.topk_logprobs.cpu().numpy(),
        "token_ids": np.concatenate([np.asarray(p.ids, dtype=np.int32) for p in batch]),
        "positions": np.concatenate([np.arange(n, n + len(p.ids), dtype=np.int32) for p in batch]),
        "response_mask": np.concatenate([np.arange(len(p.ids)) >= p.row.response_start for p in batch]),
    }


def _spare_core(device: torch.device) -> bool:
    """Whether shard writes can overlap the capture: on a GPU, or when torch leaves a CPU core free.
    Zarr's encoding and file writes are CPU work; on a machine whose cores all run torch's threads
    they preempt those threads and the capture slows by more than the writes take (2 cores:
    9.8 s with a background writer vs 8.2 s writing in between batches, for 5.5 s of capture)."""
    return device.type == "cuda" or (os.cpu_count() or 1) > torch.get_num_threads()


class _ShardWriter:
    """Copies token rows into shard-sized buffers and writes whole shards, on a background thread
    when ``background`` (else in between batches); records progress (``written_tokens``) after each
    shard is on disk.

    With the thread, two buffer sets alternate, so the next batches' rows are captured while the
    previous shard is written; inline, one set is reused. Preallocated buffers also avoid
    concatenating lists of batches (repeated copies and fresh page faults for every shard). Use as a
    context manager: leaving it waits for the writes.
    """

    def __init__(self, g, shard: int, written: int, buffer_start: int, background: bool = True):
        self.g, self.shard = g, shard
        self.written = written  # tokens [0, written) are on disk or queued; a multiple of shard until the end
        self.pos = int(buffer_start)  # token index of the next row add() receives
        self.sets: list[dict[str, np.ndarray]] = [{}, {}]
        self.pending: list[Future | None] = [None, None]
        self.current = 0
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="targets-writer") if background else None

    def __enter__(self) -> "_ShardWriter":
        return self

    def __exit__(self, *exc) -> None:
        try:
            for fut in self.pending:
                if fut is not None:
                    fut.result()  # re-raises a failed write
        finally:
            if self.pool is not None:
                self.pool.shutdown(wait=True)

    def add(self, rows: dict[str, np.ndarray]) -> None:
        k = len(rows["token_ids"])
        src = max(0, self.written - self.pos)  # rows before `written` are already on disk (resume)
        while src < k:
            fill = self.pos + src - self.written  # rows already in the buffer
            take = min(k - src, self.shard - fill)
            for name, v in rows.items():
                self._buffer(name, v)[fill: fill + take] = v[src: src + take]
            src += take
            if fill + take == self.shard:
                self._submit(self.shard)
        self.pos += k

    def flush(self) -> None:
        if self.pos > self.written:
            self._submit(self.pos - self.written)

    def _buffer(self, name: str, like: np.ndarray) -> np.ndarray:
        bufs = self.sets[self.current]
        if name not in bufs:
            bufs[name] = np.empty((self.shard, *like.shape[1:]), dtype=self.g[name].dtype)
        return bufs[name]

    def _submit(self, rows: int) -> None:
        start, bufs = self.written, self.sets[self.current]
        self.written = start + rows
        if self.pool is None:  # written now: the same buffers take the next shard
            self._write(bufs, start, rows)
            return
        self.pending[self.current] = self.pool.submit(self._write, bufs, start, rows)
        self.current = 1 - self.current
        if self.pending[self.current] is not None:  # the other set must be on disk before reuse
            self.pending[self.current].result()
            self.pending[self.current] = None

    def _write(self, bufs: dict[str, np.ndarray], start: int, rows: int) -> None:
        for name, b in bufs.items():
            self.g[name][start: start + rows] = b[:rows]
        self.g.attrs["written_tokens"] = start + rows
