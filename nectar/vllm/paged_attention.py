"""Attention over vLLM's paged KV cache with a per-slot additive bias β, and over a document's dense state.

The NECTAR attention backend (``nectar.vllm.backend``) runs these in place of vLLM's CPU kernel, which
has no per-key bias. A document's state sits in a request's first m cache slots (the KV connector,
``nectar.vllm.connector``, writes its keys, values and β there); the request's own tokens follow with
β = 0. Two exact ways to attend, the same numbers:

  one pass   one softmax over all of a request's slots with β added (``paged_attention`` from slot 0): the
             fallback, for a request whose state the backend cannot name
  split      the request's own slots m … S−1 (``paged_attention`` from slot m) and the document's state
             held densely once per server (``state_attention``: one GEMM for every query token of every
             request on that document, the state read once per step instead of once per request), merged
             by log-sum-exp (``merge``: design.md's merge, docs/deployment.md §15)

A β of −inf pads heads whose budget is below the layer's widest (ragged per-head budgets). The cache
layout is vLLM CPU's [num_blocks, hkv, 2 · block_size, d] view: per block and KV head the block's keys,
then its values, one row per slot (``write_slots``). Where each request reads is planned once per
step (``plan_slots``: the cache rows to copy and the causal mask) and reused by every layer; a layer
copies its rows with one ``index_select`` straight into the flash kernel's layout. Imports only torch: it runs inside the vLLM
server's environment and is tested against dense attention in this project's.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

NEG_INF = float("-inf")


def split_cache(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[nb, hkv, bs, 2d] (vLLM's allocation) → key and value views [nb, hkv, bs, d] of the same memory."""
    nb, hkv, bs, _ = kv_cache.shape
    keys, values = kv_cache.view(nb, hkv, 2 * bs, -1).chunk(2, dim=2)
    return keys, values


def write_slots(kv_cache: torch.Tensor, bias: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                slots: torch.Tensor, beta: torch.Tensor | None = None) -> None:
    """Write key/value [t, hkv, d] (and β [t, hkv], else 0) into ``slots`` [t]; slots < 0 (padding) skipped.

    bias [nb · bs, hkv] is the layer's β store: every write to a slot sets its β, so a block that
    vLLM hands from one request to another never keeps a stale one."""
    keys, values = split_cache(kv_cache)
    bs = keys.shape[2]
    t = slots.shape[0]
    keep = slots >= 0
    slots, key, value = slots[keep], key[:t][keep], value[:t][keep]
    block, offset = slots // bs, slots % bs
    keys[block, :, offset] = key.to(keys.dtype)  # [t, hkv, d]
    values[block, :, offset] = value.to(values.dtype)
    bias[slots] = 0.0 if beta is None else beta[:t][keep].to(bias.dtype)


@dataclass(frozen=True)
class Span:
    """Where a group of query rows reads its keys: built once per step, used by every layer.

    rows     [r·Q] the query rows (tokens) of the group, request-major
    kv_rows  [2, r, hkv, L] rows of the cache viewed as [nb · hkv · 2bs, d]: keys, then values
    slots    [r, L] the slots (for the β store)
    mask     [r, 1, Q·g, L] float32: 0 where visible, −inf elsewhere (padding, the future)
    """
    rows: torch.Tensor
    kv_rows: torch.Tensor
    slots: torch.Tensor
    mask: torch.Tensor
    queries: int  # Q: query tokens per request (1 for decode rows)


@dataclass(frozen=True)
class SlotPlan:
    """A step's spans for a cache of hkv KV heads, blocks of bs slots and g query heads per KV head."""
    spans: tuple[Span, ...]
    hkv: int
    bs: int
    g: int


def _span(table: torch.Tensor, first: torch.Tensor, stop: torch.Tensor, rows: torch.Tensor, queries: int,
          hkv: int, bs: int, g: int) -> Span:
    """Requests reading slots first[r] … stop[r]−1 (block table rows [r, max blocks]), the last ``queries``
    of them new: key/value rows, slots and the causal mask, the span padded to its longest request."""
    L = int((stop - first).max())
    j = first.unsqueeze(1) + torch.arange(L).unsqueeze(0)  # [r, L] slot index within the request
    visible = j < stop.unsqueeze(1)
    j = torch.where(visible, j, first.unsqueeze(1))  # padding reads a real slot, then is masked
    blk = table.long().gather(1, j // bs)  # [r, L]
    off = j % bs
    head = torch.arange(hkv).view(1, hkv, 1)
    key_rows = (blk.unsqueeze(1) * hkv + head) * (2 * bs) + off.unsqueeze(1)  # [r, hkv, L]
    pos = stop.unsqueeze(1) - queries + torch.arange(queries).unsqueeze(0)  # [r, Q] each new token's slot
    seen = visible.unsqueeze(1) & (j.unsqueeze(1) <= pos.unsqueeze(2))  # [r, Q, L] causal
    mask = torch.zeros(seen.shape).masked_fill_(~seen, NEG_INF)
    mask = mask.unsqueeze(1).expand(-1, g, -1, -1).reshape(-1, 1, g * queries, L)  # rows ordered (g, Q)
    return Span(rows, torch.stack([key_rows, key_rows + bs]), blk * bs + off, mask, queries)


def plan_slots(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor, hkv: int,
               bs: int, g: int, key_start: torch.Tensor | None = None) -> SlotPlan:
    """Decode rows (one new token) as one batch; each longer request (a prefill chunk) on its own."""
    starts = query_start_loc.long()
    lens = starts[1:] - starts[:-1]  # [r] new tokens per request
    seq = seq_lens.long()
    first = torch.zeros_like(seq) if key_start is None else key_start.long()
    spans = []
    decode = torch.nonzero(lens == 1).flatten()
    if decode.numel():
        spans.append(_span(block_table[decode], first[decode], seq[decode], starts[decode], 1, hkv, bs, g))
    for r in torch.nonzero(lens > 1).flatten().tolist():
        rows = torch.arange(int(starts[r]), int(starts[r + 1]))
        spans.append(_span(block_table[r:r + 1], first[r:r + 1], seq[r:r + 1], rows, int(lens[r]), hkv, bs, g))
    return SlotPlan(tuple(spans), hkv, bs, g)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, logit_bias: torch.Tensor,
            scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q [r, hkv, Q, d], k/v [r, hkv, S, d], logit_bias [r, hkv | 1, Q | 1, S] float32 (−inf: invisible; every
    row sees at least one key) → out [r, hkv, Q, d], lse [r, hkv, Q] (float32). One call of torch's CPU flash
    kernel, which takes the bias as an additive mask (kept in float32: a bf16 mask would round β) and returns
    the log-sum-exp; the matmuls in q's dtype: float32 agrees with the plain softmax to ~1e-6, bf16 (a bf16
    server) to ~1e-2, 8× faster than the unfused math."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k.to(q.dtype), v.to(q.dtype), 0.0, False, attn_mask=logit_bias.float(), scale=scale)[:2]
    return out.float(), lse.float()


def paged_attention(query: torch.Tensor, kv_cache: torch.Tensor, bias: torch.Tensor | None,
                    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_table: torch.Tensor, scale: float,
                    out: torch.Tensor, key_start: torch.Tensor | None = None,
                    plan: SlotPlan | None = None) -> torch.Tensor:
    """Causal attention of every request's new tokens over its cached slots key_start … S−1, β added (bias
    None: every slot's β is 0 — a request's own tokens); the output is written into out, the log-sum-exp
    returned.

    query/out [T, H, d]; kv_cache [nb, hkv, bs, 2d]; bias [nb · bs, hkv]; query_start_loc [r + 1];
    seq_lens [r] (cached + new tokens); block_table [r, max blocks]; key_start [r] (default 0). The new
    tokens of a request are its last L slots: token i sees slots j ≤ S − L + i. plan: the step's
    ``plan_slots`` of these arguments (made here when absent; the backend makes it once per step for all
    layers). The matmuls run in the cache's dtype; returns lse [T, H] float32."""
    nb, hkv, bs, _ = kv_cache.shape
    T, H, d = query.shape
    g = H // hkv
    if plan is None:
        plan = plan_slots(query_start_loc, seq_lens, block_table, hkv, bs, g, key_start)
    if (plan.hkv, plan.bs, plan.g) != (hkv, bs, g):
        raise ValueError(f"a step plan for hkv, bs, g = {plan.hkv, plan.bs, plan.g} used on a cache of {hkv, bs, g}")
    flat = kv_cache.view(-1, d)  # [nb · hkv · 2bs, d]: vLLM's allocation is contiguous
    lse_out = torch.empty(T, H, dtype=torch.float32)
    for span in plan.spans:
        r, L, Q = span.slots.shape[0], span.slots.shape[1], span.queries
        kv = flat.index_select(0, span.kv_rows.flatten()).view(2, r, hkv, L, d)  # one copy, flash's layout
        logit_bias = span.mask
        if bias is not None:
            b = bias.index_select(0, span.slots.flatten()).view(r, L, hkv).permute(0, 2, 1).unsqueeze(2)
            logit_bias = logit_bias + b  # [r, hkv, Q·g, L]
        q = query[span.rows].to(kv.dtype).view(r, Q, hkv, g, d).permute(0, 2, 3, 1, 4).reshape(r, hkv, g * Q, d)
        o, lse = _attend(q, kv[0], kv[1], logit_bias, scale)  # [r, hkv, g·Q, d], [r, hkv, g·Q]
        out[span.rows] = o.view(r, hkv, g, Q, d).permute(0, 3, 1, 2, 4).reshape(r * Q, H, d).to(out.dtype)
        lse_out[span.rows] = lse.view(r, hkv, g, Q).permute(0, 3, 1, 2).reshape(r * Q, H)
    return lse_out


def state_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, beta: torch.Tensor,
                    scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Every query row [T, H, d] over one document's state (keys/values [hkv, w, d], β [hkv, w]) in one GEMM
    per KV head → out [T, H, d], lse [T, H] (float32); the matmuls in the keys' dtype."""
    T, H, d = query.shape
    hkv = keys.shape[0]
    g = H // hkv
    q = query.to(keys.dtype).reshape(T, hkv, g, d).permute(1, 0, 2, 3).reshape(hkv, T * g, d)  # [hkv, T·g, d]
    o, lse = _attend(q.unsqueeze(0), keys.unsqueeze(0), values.unsqueeze(0), beta.view(1, hkv, 1, -1), scale)
    out = o[0].view(hkv, T, g, d).permute(1, 0, 2, 3).reshape(T, H, d)
    return out, lse[0].view(hkv, T, g).permute(1, 0, 2).reshape(T, H)


def merge(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
          lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two attention states over disjoint key sets ([T, H, d], [T, H]) → the state over their union."""
    lse = torch.logaddexp(lse_a, lse_b)
    wa = torch.exp(lse_a - lse).nan_to_num(0.0).unsqueeze(-1)  # [T, H, 1]
    wb = torch.exp(lse_b - lse).nan_to_num(0.0).unsqueeze(-1)
    return out_a.float() * wa + out_b.float() * wb, lse
