"""Which document keys matter: attention mass per key from the training queries.

For one (layer, KV head), the captured targets give every training query q (rotated, as the model
saw it) and α(q), the log-sum-exp of its logits over the document keys. The share of q's document
attention that key j receives is then exp(s·q·k_j − α(q)) — the same probabilities the full-context
model used, without re-running it. Keys are ranked by that share summed (``mean``) or maximised
(``max``, Attention Matching's default) over the queries (offline H2O/SnapKV-style eviction).
"""
from __future__ import annotations

from typing import Literal

import torch

KeyScore = Literal["mean", "max"]


def attention_probs(q: torch.Tensor, alpha: torch.Tensor, keys: torch.Tensor, scaling: float,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """q [N, d], alpha [N], keys [n, d] → each query's attention over the document keys [N, n] (rows sum
    to 1), written into ``out`` [N, n] when given (a caller's reused block)."""
    # one product that scales and subtracts α as it writes (the same result as q·kᵀ, ·s, −α in turn,
    # measured bit for bit), then exp in place: no more [N, n] buffers than the result (a long
    # document's head: 6,144 fit queries × 11k kept keys, 280 MB)
    logits = torch.addmm(alpha.float().neg().unsqueeze(1), q.float(), keys.float().T, alpha=scaling, out=out)
    return logits.exp_()  # [N, n] float32: ranks and fits need no more


def key_scores(probs: torch.Tensor, how: KeyScore = "mean") -> torch.Tensor:
    """[N, n] attention probabilities → one importance score per key [n]."""
    if how == "mean":
        return probs.mean(0)
    if how == "max":
        return probs.max(0).values
    raise ValueError(f"unknown key score {how!r}; use 'mean' or 'max'")


def top_keys(scores: torch.Tensor, p: int) -> torch.Tensor:
    """Indices of the ``p`` highest-scoring keys, in document order [p]."""
    if not 1 <= p <= scores.shape[0]:
        raise ValueError(f"cannot keep {p} of {scores.shape[0]} keys")
    return torch.topk(scores, p).indices.sort().values
