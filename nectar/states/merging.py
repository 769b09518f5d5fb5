"""Merging evicted keys into kept ones (issue 38's lever; ``select.fit_by: merge``, and the prior recon_fit's
least squares can be ridged toward, ``select.fit_prior: merged``): each evicted key of a (layer, KV head) joins
the kept key it is most similar to (cosine of the keys: keys that point alike are attended alike, so one key
with a larger mass stands in for both), and per kept key i

    M_i = Σ_q m_q(k_i) + Σ_{j→i} Σ_q m_q(k_j)      (m_q(k) = exp(s·q·k − α_q), α_q the query's log-sum-exp
                                                     over the whole document)
    β_i = log(M_i / Σ_q m_q(k̂_i))                   (k̂_i: the key as stored)
    v_i = (Σ over i and the keys merged into it of the key's mass × its value) / M_i

so the state holds the document's total attention mass over the fit queries and its mass-weighted sum of
values. No least squares: where the fit solves β and values jointly for the fit queries' outputs — and, with
hundreds of keys a head, follows those queries closely — merging keeps two totals, which held up better on
held-out probes at 5 % of the bytes on every document measured, about even at 1 %, and 10 points worse at 0.5 %
where keys are scarce (docs/quality.md, "Merging evicted keys instead of fitting").
"""
from __future__ import annotations

import torch

from .selection import attention_probs

QUERY_BLOCK = 2048  # fit queries a block when summing masses: [block, n] at a time, not [T·g, n]


def key_masses(q: torch.Tensor, alpha: torch.Tensor, keys: torch.Tensor, scaling: float) -> torch.Tensor:
    """q [N, d], alpha [N], keys [n, d] → each key's attention mass summed over the queries [n] (float64)."""
    total = torch.zeros(keys.shape[0], dtype=torch.float64)
    for qb, ab in zip(q.split(QUERY_BLOCK), alpha.split(QUERY_BLOCK)):
        total += attention_probs(qb, ab, keys, scaling).sum(0, dtype=torch.float64)
    return total


def nearest_kept(keys: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """keys [n, d], kept [c] indices → for every key the position (0..c-1) of its most similar kept key by
    cosine [n]; a kept key is its own."""
    unit = torch.nn.functional.normalize(keys.float(), dim=-1)  # [n, d]
    owner = (unit @ unit[kept].T).argmax(1)  # [n]
    owner[kept] = torch.arange(kept.numel())
    return owner


def merge_head(q: torch.Tensor, alpha: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, kept: torch.Tensor,
               stored_keys: torch.Tensor, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One (layer, KV head): q [N, d], alpha [N] (fit queries), the document's keys and values [n, d], the kept
    indices [c] and the kept keys as stored [c, d] → (β [c], values [c, d]) of the merged state."""
    mass = key_masses(q, alpha, keys, scaling)  # [n]
    owner = nearest_kept(keys, kept)  # [n] → 0..c-1
    c = kept.numel()
    merged = torch.zeros(c, dtype=torch.float64).index_add_(0, owner, mass)  # [c] M_i
    weighted = torch.zeros(c, values.shape[1], dtype=torch.float64).index_add_(
        0, owner, mass.unsqueeze(1) * values.double())  # [c, d] Σ M_j v_j
    held = key_masses(q, alpha, stored_keys, scaling)  # [c] the stored keys' own mass
    tiny = torch.finfo(torch.float64).tiny
    beta = (merged.clamp_min(tiny) / held.clamp_min(tiny)).log()
    # a kept key no query reaches (mass 0 to float precision) keeps its own value
    Z = torch.where(merged.unsqueeze(1) > tiny, weighted / merged.clamp_min(tiny).unsqueeze(1), values[kept].double())
    return beta.float(), Z.float()
