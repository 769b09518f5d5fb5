"""Attention states and their exact merge.

A state for a query over a set of keys is (out, lse): the softmax-weighted value and the log-sum-exp
of the logits. States over disjoint key sets merge exactly:

    merge((o1, l1), (o2, l2)) = (w·o1 + (1-w)·o2, logaddexp(l1, l2)),  w = exp(l1 - logaddexp(l1, l2))

For the document part, (out, lse) is the paper's (A, α) target and score.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

NEG_INF = float("-inf")


@dataclass
class AttnState:
    out: torch.Tensor  # [b, h, m, d] float32
    lse: torch.Tensor  # [b, h, m] float32; -inf where no key was visible

    def to(self, dtype: torch.dtype) -> "AttnState":
        return AttnState(self.out.to(dtype), self.lse.to(dtype))


def merge_states(a: AttnState | None, b: AttnState | None) -> AttnState:
    """Exact merge of two states over disjoint key sets (either may be None = no keys)."""
    if a is None:
        return b
    if b is None:
        return a
    lse = torch.logaddexp(a.lse, b.lse)  # [b, h, m]
    # a's weight exp(a.lse - lse) = sigmoid(a.lse - b.lse), b's is one minus it: one lerp, half the
    # element-wise kernels of two exp-weighted sums (this runs at every layer of every forward). A
    # side with lse = -inf (no visible keys) gets weight 0; both empty gives nan, mapped to 0.
    dtype = torch.promote_types(a.out.dtype, b.out.dtype)
    wa = torch.sigmoid(a.lse - b.lse).nan_to_num(0.0).unsqueeze(-1).to(dtype)  # [b, h, m, 1]
    return AttnState(torch.lerp(b.out.to(dtype), a.out.to(dtype), wa), lse)


def expand_kv(x: torch.Tensor, n_q_heads: int) -> torch.Tensor:
    """[b, hkv, n, d] → [b, hq, n, d]: query head h reads KV head h // (hq // hkv) (GQA)."""
    groups = n_q_heads // x.shape[1]
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def attention_state(
    q: torch.Tensor,  # [b, hq, m, d]
    k: torch.Tensor,  # [b, hkv, n, d]
    v: torch.Tensor,  # [b, hkv, n, d]
    scaling: float,
    causal_offset: int | None = None,
    key_mask: torch.Tensor | None = None,  # [b, n] bool (True = visible) or [b, 1|hq, m, n]
    chunk_size: int = 2048,
) -> AttnState:
    """Exact attention state of q over (k, v), computed in float32 and chunked over the keys.

    ``causal_offset``: query i (0-based within q) sees key j iff j <= i + causal_offset (for local
    attention over a pair's own tokens the offset is the number of earlier cached query tokens).
    Chunking over n keeps memory at O(m · chunk) per head, so a long document never materialises
    an [m, n] logit matrix; each chunk's state is merged exactly.
    """
    b, hq, m, d = q.shape
    n = k.shape[2]
    qf = q.float()
    state: AttnState | None = None
    for start in range(0, max(n, 1), chunk_size):
        stop = min(n, start + chunk_size)
        if stop <= start:
            break
        kc = expand_kv(k[:, :, start:stop].float(), hq)  # [b, hq, c, d]
        vc = expand_kv(v[:, :, start:stop].float(), hq)
        logits = torch.matmul(qf, kc.transpose(-1, -2)) * scaling  # [b, hq, m, c]
        visible = _visibility(b, hq, m, start, stop, causal_offset, key_mask, q.device)
        if visible is not None:
            logits = logits.masked_fill(~visible, NEG_INF)
        lse = torch.logsumexp(logits, dim=-1)  # [b, hq, m]
        probs = torch.exp(logits - lse.unsqueeze(-1)).nan_to_num(0.0)  # rows with no keys → 0
        state = merge_states(state, AttnState(torch.matmul(probs, vc), lse))
    if state is None:  # no keys at all
        return AttnState(torch.zeros_like(qf), torch.full((b, hq, m), NEG_INF, device=q.device))
    return state


def _visibility(b, hq, m, start, stop, causal_offset, key_mask, device):
    visible = None
    if causal_offset is not None:
        qi = torch.arange(m, device=device).unsqueeze(1)  # [m, 1]
        kj = torch.arange(start, stop, device=device).unsqueeze(0)  # [1, c]
        visible = (kj <= qi + causal_offset).view(1, 1, m, stop - start)
    if key_mask is not None:
        km = key_mask[:, None, None, start:stop] if key_mask.dim() == 2 else key_mask[..., start:stop]
        visible = km if visible is None else (visible & km)
    return visible
