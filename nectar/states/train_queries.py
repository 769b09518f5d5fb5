"""The training queries a method reads (``train_queries``): the targets' train split (q, α, A), a seeded
sample of at most MAX_FIT_TOKENS query tokens."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..targets.reader import TargetsData
from ..targets.store import targets_zarr_url

MAX_FIT_TOKENS = 2048  # training query tokens for selection and fitting (seeded sample above; 1k-4k: same fit)


@dataclass
class QueryTargets:
    """Training query tokens' captured targets: q [T, L, Hq, d], alpha [T, L, Hq], A [T, L, Hq, d]."""

    q: torch.Tensor
    alpha: torch.Tensor
    A: torch.Tensor


def training_queries(targets, seed: int = 0, max_tokens: int | None = None) -> QueryTargets:
    """The train split's (q, α, A) rows from the targets (a URL or an open ``TargetsData``; a seeded
    sample of at most ``max_tokens``)."""
    data = targets if isinstance(targets, TargetsData) else TargetsData(targets_zarr_url(targets))
    tokens = data.tokens("train")
    if len(tokens) == 0:
        raise ValueError(f"{data.url}: the targets have no training queries to select or fit keys with")
    max_tokens = max_tokens or MAX_FIT_TOKENS
    if len(tokens) > max_tokens:
        tokens = np.sort(np.random.default_rng(seed).choice(tokens, max_tokens, replace=False))
    rows = data.rows(tokens)
    finite = (rows.q.flatten(1).isfinite().all(1) & rows.A.flatten(1).isfinite().all(1)
              & rows.alpha.flatten(1).isfinite().all(1))  # [T]
    return QueryTargets(rows.q[finite], rows.alpha[finite], rows.A[finite])
