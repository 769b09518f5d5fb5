"""Teacher-forced evaluation of document providers, and the per-head App. C errors from the targets.

Every model is the same base model with a different document provider (nectar.attention.forward):
``module`` (the trained module), ``full`` (ExactDocState over the document's cached KV, never
re-prefilled), ``none`` (no document) — or any number of systems at once (``nectar compare``). The
query tokens are the ones the targets stage cached, so every stage scores exactly the same token
sequences. Sums are kept per pair: the intervals resample pairs (nectar.evaluation.bootstrap).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

import numpy as np
import torch

from ..attention.forward import query_logits
from ..base_model import BaseLM
from .metrics import HeadErrors, TokenSums, layer_head_errors, response_targets, scored_sums

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


@dataclass
class PairSums:
    """Per-pair sums over the scored (response) tokens of one model; arrays [P] in pair order.

    Intervals resample pairs (nectar.evaluation.bootstrap), so the per-pair sums are what is kept.
    """

    correct: np.ndarray
    nll: np.ndarray
    kl: np.ndarray
    n: np.ndarray

    @classmethod
    def zeros(cls, n_pairs: int) -> "PairSums":
        return cls(*(np.zeros(n_pairs) for _ in range(4)))

    def take(self, idx) -> "PairSums":
        """The sums of the pairs at ``idx`` (e.g. one split's pairs)."""
        idx = np.asarray(idx, dtype=np.int64)
        return PairSums(self.correct[idx], self.nll[idx], self.kl[idx], self.n[idx])

    def total(self) -> TokenSums:
        return TokenSums(float(self.correct.sum()), float(self.nll.sum()), float(self.kl.sum()),
                         int(self.n.sum()))


@torch.no_grad()
def teacher_forced_pair_sums(
    base: BaseLM,
    providers: dict[str, Callable | None],
    pairs: Iterable[EvalPair],
    n: int,
    batch_size: int = 4,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, PairSums]:
    """{model: PairSums} over the response tokens of ``pairs`` (arrays in the order of ``pairs``).

    ``providers`` maps model name → provider and must hold "full" (the reference for KL). Each batch
    runs the full-context forward once and keeps its log-probs; every other provider (any number:
    the comparison evaluates a dozen systems in one pass) is then scored against them, one forward
    each, so the full and no-document passes are shared by every system. Pairs are batched by length
    (less padding); the results are put back in the given order.
    """
    if "full" not in providers:
        raise ValueError("providers must include 'full' (the KL reference)")
    pairs = list(pairs)
    if not pairs:
        raise ValueError("no pairs to evaluate")
    order = sorted(range(len(pairs)), key=lambda i: len(pairs[i].ids))
    out = {name: PairSums.zeros(len(pairs)) for name in providers}
    names = ["full", *(k for k in providers if k != "full")]  # the reference first
    done = 0
    for lo in range(0, len(order), batch_size):
        idx = order[lo: lo + batch_size]
        batch = [pairs[i] for i in idx]
        ids, mask, starts, lengths = _pad(batch, base.device)
        targets, scored = response_targets(ids, starts, lengths)  # [b, m], [b, m]
        rows = scored.nonzero()[:, 0]  # [k]: the batch row of each scored position
        tgt = targets[scored]  # [k]
        lp_full = p_full = None
        for name in names:
            logits = query_logits(base, providers[name], ids, n, mask)[scored]  # [k, V]
            if lp_full is None:
                lp_full = torch.log_softmax(logits.float(), dim=-1)  # [k, V]
                p_full = lp_full.exp()
            sums = scored_sums(logits, lp_full, tgt, rows, len(batch), p_full)
            del logits
            dest = out[name]
            for arr, s in zip((dest.correct, dest.nll, dest.kl, dest.n), sums):
                arr[idx] = s.cpu().numpy()
        done += len(batch)
        if progress:
            progress(done, len(pairs))
    return out


def split_totals(sums: dict[str, PairSums], pairs: list[EvalPair]) -> dict[str, dict[str, TokenSums]]:
    """{split: {model: TokenSums}}: the per-pair sums added up over each split's pairs."""
    members: dict[str, list[int]] = {}
    for i, p in enumerate(pairs):
        for split in p.splits:
            members.setdefault(split, []).append(i)
    return {split: {name: s.take(idx).total() for name, s in sums.items()} for split, idx in members.items()}


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
