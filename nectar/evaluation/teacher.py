"""Teacher-forced evaluation of the three models, and the per-head App. C errors from the targets.

Every model is the same base model with a different document provider (nectar.attention.forward):
``module`` (the trained module), ``full`` (ExactDocState over the document's cached KV, never
re-prefilled) and ``none`` (no document). The query tokens are the ones the targets stage cached,
so every stage scores exactly the same token sequences.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

import numpy as np
import torch

from ..attention.forward import query_logits
from ..models import BaseModel
from .metrics import HeadErrors, TokenSums, layer_head_errors, response_targets, token_sums

MODELS = ("module", "full", "none")


@dataclass(frozen=True)
class EvalPair:
    """One held-out pair as cached by the targets stage (token rows start … start+len(ids))."""

    pair_id: str
    task: str
    splits: tuple[str, ...]  # every evaluation split this pair belongs to ("test", "challenge")
    ids: tuple[int, ...]
    response_start: int
    start: int = 0  # first token row in the targets zarr


def _pad(pairs: list[EvalPair], device: torch.device):
    m = max(len(p.ids) for p in pairs)
    ids = torch.zeros((len(pairs), m), dtype=torch.long, device=device)  # [b, m]
    mask = torch.zeros_like(ids)
    for i, p in enumerate(pairs):
        ids[i, : len(p.ids)] = torch.as_tensor(p.ids, device=device)
        mask[i, : len(p.ids)] = 1
    starts = torch.tensor([p.response_start for p in pairs], device=device)
    lengths = torch.tensor([len(p.ids) for p in pairs], device=device)
    return ids, mask, starts, lengths


@torch.no_grad()
def teacher_forced_sums(
    base: BaseModel,
    providers: dict[str, Callable | None],
    pairs: Iterable[EvalPair],
    n: int,
    batch_size: int = 4,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, dict[str, TokenSums]]:
    """{split: {model: TokenSums}} over the response tokens of ``pairs``.

    ``providers`` maps model name → provider and must hold "full" (the reference for KL).
    """
    if "full" not in providers:
        raise ValueError("providers must include 'full' (the KL reference)")
    pairs = list(pairs)
    if not pairs:
        raise ValueError("no pairs to evaluate")
    out: dict[str, dict[str, TokenSums]] = {}
    for lo in range(0, len(pairs), batch_size):
        batch = pairs[lo: lo + batch_size]
        ids, mask, starts, lengths = _pad(batch, base.device)
        targets, scored = response_targets(ids, starts, lengths)  # [b, m], [b, m]
        logits = {name: query_logits(base, p, ids, n, mask) for name, p in providers.items()}  # [b, m, V]
        for i, pair in enumerate(batch):
            row = slice(i, i + 1)
            for name, lg in logits.items():
                s = token_sums(lg[row], logits["full"][row], targets[row], scored[row])
                for split in pair.splits:
                    cell = out.setdefault(split, {})
                    cell[name] = cell.get(name, TokenSums()).add(s)
        del logits
        if progress:
            progress(min(lo + batch_size, len(pairs)), len(pairs))
    return out


@torch.no_grad()
def head_errors(
    provider: Callable,
    q: np.ndarray,  # [T, L, Hq, d]
    alpha: np.ndarray,  # [T, L, Hq]
    A: np.ndarray,  # [T, L, Hq, d]
    scaling: float,
    device: torch.device | str = "cpu",
    token_batch: int = 1024,
) -> HeadErrors:
    """Per-(layer, query head) score/target errors of ``provider`` on cached queries.

    The provider sees the cached rotated queries exactly as the attention layer would, one layer at
    a time, as a batch of one sequence of T tokens: q [1, Hq, T, d] → (A_θ, a_θ).
    """
    T, L, H, _ = q.shape
    errors = HeadErrors.zeros(L, H)
    for lo in range(0, T, token_batch):
        hi = min(T, lo + token_batch)
        qb = torch.from_numpy(np.ascontiguousarray(q[lo:hi])).float().to(device)  # [t, L, Hq, d]
        ab = torch.from_numpy(np.ascontiguousarray(alpha[lo:hi])).float().to(device)  # [t, L, Hq]
        Ab = torch.from_numpy(np.ascontiguousarray(A[lo:hi])).float().to(device)  # [t, L, Hq, d]
        for layer in range(L):
            q_l = qb[:, layer].transpose(0, 1).unsqueeze(0)  # [1, Hq, t, d]
            state = provider(layer, q_l, scaling)
            pred_A = state.out[0].transpose(0, 1).float().cpu()  # [t, Hq, d]
            pred_alpha = state.lse[0].transpose(0, 1).float().cpu()  # [t, Hq]
            errors.add_layer(layer, layer_head_errors(qb[:, layer].cpu(), ab[:, layer].cpu(),
                                                      Ab[:, layer].cpu(), pred_alpha, pred_A))
        errors.n += hi - lo
    return errors
