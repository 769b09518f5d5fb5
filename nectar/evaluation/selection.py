"""Which cached pairs are evaluated: every held-out pair of each split, and the seeded samples that
are generated (judged answers, greedy agreement).

The pairs are the ones the targets stage cached (targets/pairs.parquet and the token rows of
targets.zarr), so every stage and ``nectar compare`` score exactly the same token sequences.
"""
from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from ..schemas.artifacts import TargetsPairRow
from ..schemas.config import EvaluateConfig
from .teacher import EvalPair


class EvaluateInputError(ValueError):
    pass


@dataclass
class Selection:
    """The evaluated pairs: one EvalPair per pair (with every split it belongs to).

    ``per_split`` holds every pair of a split (teacher-forced metrics are cheap: all of them count);
    ``judged`` the seeded sample of up to ``max_samples`` per configured split that is generated with
    sampling and judged; ``agreement`` the seeded sample of up to ``agreement_max_samples`` per split
    whose greedy continuations are compared with the full-context model's.
    """

    pairs: list[EvalPair]
    rows: dict[str, TargetsPairRow]
    per_split: dict[str, list[str]] = field(default_factory=dict)  # split → pair ids
    judged: dict[str, list[str]] = field(default_factory=dict)
    agreement: dict[str, list[str]] = field(default_factory=dict)

    def split_index(self) -> dict[str, np.ndarray]:
        """split → positions in ``pairs`` of the split's pairs."""
        pos = {p.pair_id: i for i, p in enumerate(self.pairs)}
        return {split: np.array([pos[pid] for pid in ids], dtype=np.int64) for split, ids in self.per_split.items()}


def split_pools(target_rows: Sequence[TargetsPairRow]) -> dict[str, list[TargetsPairRow]]:
    """Held-out pools: ``test``, ``challenge`` (the test pairs least like training, App. E) and every
    other non-train split the targets hold (e.g. ``probes``: held-out document probes)."""
    pools: dict[str, list[TargetsPairRow]] = {
        "test": [r for r in target_rows if r.split == "test"],
        "challenge": [r for r in target_rows if r.split == "test" and r.challenge],
    }
    for split in sorted({r.split for r in target_rows} - {"train", "test", "recon"}):  # recon: training queries
        pools[split] = [r for r in target_rows if r.split == split]
    return pools


def evaluated_splits(target_rows: Sequence[TargetsPairRow], cfg: EvaluateConfig) -> list[str]:
    """The configured splits, then any further held-out split the targets hold (e.g. ``probes``)."""
    extra = [s for s in split_pools(target_rows) if s not in ("test", "challenge") and s not in cfg.splits]
    return [*cfg.splits, *extra]


def _sample(pool: list[TargetsPairRow], k: int, seed: int) -> list[str]:
    pool = sorted(pool, key=lambda r: r.pair_id)
    picked = pool if len(pool) <= k else random.Random(seed).sample(pool, k)
    return sorted(r.pair_id for r in picked)


def select_pairs(target_rows: Sequence[TargetsPairRow], token_ids: np.ndarray, cfg: EvaluateConfig,
                 splits: Sequence[str] | None = None) -> Selection:
    """Every pair with response tokens of each split, and the seeded judged / agreement samples."""
    pools = split_pools(target_rows)
    splits = list(cfg.splits if splits is None else splits)
    scorable = {r.pair_id for r in target_rows if r.response_start < r.length}  # a truncated pair may have none
    per_split: dict[str, list[str]] = {}
    judged: dict[str, list[str]] = {}
    agreement: dict[str, list[str]] = {}
    for split in splits:
        if split not in pools:
            raise EvaluateInputError(f"evaluate.splits has {split!r}; the splits are {sorted(pools)}")
        pool = [r for r in pools[split] if r.pair_id in scorable]
        per_split[split] = sorted(r.pair_id for r in pool)
        judged[split] = _sample(pool, cfg.max_samples, cfg.seed) if split in cfg.splits else []
        agreement[split] = _sample(pool, cfg.agreement_max_samples, cfg.seed)
    rows = {r.pair_id: r for r in target_rows}
    members: dict[str, list[str]] = {}
    for split, ids in per_split.items():
        for pid in ids:
            members.setdefault(pid, []).append(split)
    pairs = []
    for pid in sorted(members):
        r = rows[pid]
        ids = token_ids[r.start: r.start + r.length]
        pairs.append(EvalPair(pid, r.task, tuple(members[pid]), tuple(int(t) for t in ids),
                              r.response_start, r.start))
    return Selection(pairs, rows, per_split, judged, agreement)


def with_subset(sel: Selection, split: str, name: str, pair_ids: set[str], cfg: EvaluateConfig) -> Selection:
    """``sel`` plus a split ``name``: the pairs of ``split`` in ``pair_ids`` (e.g. probes on text that
    reconstruction left out), scored and bootstrapped like any split."""
    ids = [pid for pid in sel.per_split.get(split, []) if pid in pair_ids]
    if not ids:
        return sel
    pairs = [dataclasses.replace(p, splits=(*p.splits, name)) if p.pair_id in pair_ids and split in p.splits else p
             for p in sel.pairs]
    pool = [sel.rows[pid] for pid in ids]
    return Selection(pairs, sel.rows, {**sel.per_split, name: ids}, {**sel.judged, name: []},
                     {**sel.agreement, name: _sample(pool, cfg.agreement_max_samples, cfg.seed)})
