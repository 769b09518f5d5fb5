"""Which keys a head keeps, chosen together for the fit they allow (``select.key_choice: greedy``).

The allocation (reconstruction.py ``allocate``) keeps each head's top-scored keys: each key on its own
merits, the most attention any reconstruction query gives it. Neighbouring tokens are often read by the
same queries, so at a small budget several kept keys can carry the same attention pattern while a pattern
no top key carries is lost — and the fit (β and values, matching_fit.py) can only mix the patterns the
kept keys have. Here a head keeps as many keys as the allocation gave it, but picks them from a pool of
its ``pool`` × that many best-scored keys by orthogonal least squares (greedy forward selection, as in
simultaneous orthogonal matching pursuit): each step adds the key whose attention over the fit queries
(a column of P = exp(s·q·k − α), [N, C]) explains most of what the chosen keys' columns leave of the fit's
targets Y = [1 | A] — the document mass (what β fits) and the attention output (what the values fit),
each column scaled to unit norm. The anchors (sinks) in the pool are chosen first.

Cost per head: P [N, C] once (N: at most ``MAX_ROWS`` of the fit queries), then per chosen key one
product Pᵀv [C] and a rank-one update of the correlations [C, d + 1]: N·C per key, where recomputing
Pᵀ·residual each step would be N·C·(d + 1). On one core, N = 2,048: 0.05 s a head keeping 50 keys,
1.3 s one keeping 500.
"""
from __future__ import annotations

import torch

from ..modules.provider import grouped_targets
from .reconstruction import run_per_head
from .selection import attention_probs

POOL = 4  # candidates per kept key: the head's pool × kept best-scored keys
# a head keeping more keys keeps its top-scored ones: the greedy steps are one per key (a Python loop),
# and a wide head is where keys are not scarce. (Sparing also the heads keeping over an eighth of the
# document cost 1.8 of the 10.2 points gained at 0.5 % on the default document, and saved ~20 s at 5 %.)
MAX_GREEDY_KEYS = 512
# key_choice "auto": greedy when the state keeps at most this share of the document's (layer, KV head, token)
# entries. Scarce keys are where choosing them together pays: on the document panel greedy gained at 0.5 % of
# the float32 bytes at int4 (3.5 % of the entries kept) on every document, was mixed at 1 % (6.9 %) and level
# from 2 % (docs/quality.md, "Keys chosen together for the fit")
GREEDY_SHARE = 0.05
# the selection reads every k-th fit query, at most this many: enough rows to tell the keys' attention
# patterns apart (the fit itself still reads them all); float32, where float64 took ~3× as long
MAX_ROWS = 2048


def chooses_greedy(key_choice: str, kept: list[list[torch.Tensor]], n: int) -> bool:
    """Whether ``key_choice`` rechooses the allocation's ``kept`` [L][Hkv] keys of an ``n``-token document
    greedily: always ("greedy"), never ("top"), or when they are at most GREEDY_SHARE of its entries ("auto")."""
    if key_choice != "auto":
        return key_choice == "greedy"
    return scarce(kept, n)


def kept_share(kept: list[list[torch.Tensor]], n: int) -> float:
    """The share of an ``n``-token document's (layer, KV head, token) entries the ``kept`` [L][Hkv] keys are."""
    return sum(idx.numel() for heads in kept for idx in heads) / max(1, n * sum(len(heads) for heads in kept))


def scarce(kept: list[list[torch.Tensor]], n: int) -> bool:
    """Whether the ``kept`` [L][Hkv] keys are at most GREEDY_SHARE of an ``n``-token document's entries: where
    ``auto`` chooses keys greedily (key_choice) and fits β and values by least squares (fit_by)."""
    return scarce_counts([[idx.numel() for idx in heads] for heads in kept], n)


def scarce_counts(pairs: list[list[int]] | tuple, n: int) -> bool:
    """``scarce`` from the kept count of each (layer, KV head) (a plan's ``quad_head_pairs`` [L][Hkv]): where
    ``auto`` also refines a fitted state end to end (RefineConfig.when, nectar/states/recon_refine.py)."""
    return sum(sum(heads) for heads in pairs) <= GREEDY_SHARE * n * sum(len(heads) for heads in pairs)


def greedy_kept(kept: list[list[torch.Tensor]], scores: torch.Tensor, queries, doc_kv, scaling: float,
                anchors: torch.Tensor, pool: int = POOL) -> list[list[torch.Tensor]]:
    """``kept`` [L][Hkv] (ascending key indices) with each head's keys rechosen, as many as before, by
    ``choose_keys`` from its pool of best-scored keys (``scores`` [L, Hkv, n]; a head keeping over
    ``MAX_GREEDY_KEYS`` keeps its own); ``queries``: the fit's
    (q [T, L, Hq, d], alpha [T, L, Hq], A [T, L, Hq, d]); ``anchors`` [n] bool: kept whenever pooled."""
    tasks = []  # (layer, head, pool [C], q [N, d], α [N], pool keys [C, d], A [N, d], forced [C], count)
    out = [list(heads) for heads in kept]
    for layer, heads in enumerate(kept):
        hkv = len(heads)
        q, alpha, A = grouped_targets(queries, layer, hkv)  # [T·g, Hkv, d], [T·g, Hkv], [T·g, Hkv, d]
        keys = doc_kv.keys[layer].detach().float().cpu()  # [Hkv, n, d]
        for h, idx in enumerate(heads):
            c = idx.numel()
            if c == 0 or c > MAX_GREEDY_KEYS:
                continue
            s = scores[layer, h].float().clone()
            s[anchors] = float("inf")  # the anchors are always in the pool
            cand = torch.topk(s, min(pool * c, s.numel())).indices.sort().values  # [C]
            tasks.append((layer, h, cand, q[:, h], alpha[:, h], keys[h, cand], A[:, h], anchors[cand], c))

    def choose(t):
        layer, h, cand, q, alpha, keys, A, forced, c = t
        every = -(-q.shape[0] // MAX_ROWS)  # choose_keys reads at most MAX_ROWS queries: form only those
        q, alpha, A = q[::every], alpha[::every], A[::every]
        P = attention_probs(q, alpha, keys, scaling)  # [N', C] the pool's attention over the fit queries
        return cand[choose_keys(P, A, c, forced)].sort().values

    # one head per core, as the fit runs them (reconstruction.run_per_head)
    for t, idx in zip(tasks, run_per_head(choose, tasks, cost=lambda t: t[-1] * t[2].numel())):
        out[t[0]][t[1]] = idx
    return out


def choose_keys(P: torch.Tensor, A: torch.Tensor, c: int, forced: torch.Tensor) -> torch.Tensor:
    """``c`` column indices of P [N, C] chosen greedily (orthogonal least squares) to span the targets
    [1 | A] (A [N, d]; each column scaled to unit norm); the ``forced`` [C] bool columns first → [c]."""
    every = -(-P.shape[0] // MAX_ROWS)
    P, A = P[::every].float().contiguous(), A[::every].float()  # [N', C], [N', d]: every few queries
    N, C = P.shape
    Y = torch.cat([torch.ones(N, 1), A], 1)  # [N, d + 1]
    Y = Y / Y.norm(dim=0).clamp_min(1e-30)
    corr = P.T @ Y  # [C, d + 1] each column's correlation with what is left of Y
    left = (P * P).sum(0)  # [C] each column's squared norm outside the chosen columns' span
    floor = 1e-6 * float(left.max().clamp_min(1e-30))  # a column (almost) inside the span adds nothing
    Q = torch.empty(N, c)  # the chosen columns, orthonormalised
    taken = torch.zeros(C, dtype=torch.bool)
    order = forced.nonzero().squeeze(1).tolist()[:c]
    chosen = []
    for k in range(min(c, C)):
        if k < len(order):
            j = order[k]
        else:
            gain = (corr * corr).sum(1) / left.clamp_min(floor)  # [C] share of Y each column would explain
            gain[taken | (left <= floor)] = -1.0
            j = int(gain.argmax())
            if gain[j] < 0:  # every remaining column lies in the span: any adds nothing, take the first
                j = int((~taken).nonzero()[0])
        v = P[:, j] - Q[:, :k] @ (Q[:, :k].T @ P[:, j])  # [N] its part outside the span
        v = v - Q[:, :k] @ (Q[:, :k].T @ v)  # twice: Gram–Schmidt loses orthogonality once
        norm = v.norm()
        Q[:, k] = v / norm if norm > 0 else v
        v = Q[:, k]
        proj = P.T @ v  # [C]
        # the residual loses its part along v: R ← R − v(vᵀY) (v ⟂ the span, so vᵀR = vᵀY)
        corr -= proj.unsqueeze(1) * (v @ Y).unsqueeze(0)
        left -= proj * proj
        taken[j] = True
        chosen.append(j)
    return torch.tensor(chosen, dtype=torch.long)
