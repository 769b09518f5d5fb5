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
then its values, one row per slot (``write_slots``). Imports only torch: it runs inside the vLLM
server's environment and is tested against dense attention in this project's.
"""
from __future__ import annotations

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


def _gather(keys, values, bias, table: torch.Tensor, first: torch.Tensor, stop: torch.Tensor):
    """Slots first[r] … stop[r]−1 of each request (block table rows [r, max blocks]) →
    k, v [r, L, hkv, d], b [r, L, hkv], visible [r, L] (L = the longest span; shorter ones padded)."""
    bs = keys.shape[2]
    L = int((stop - first).max())
    j = first.unsqueeze(1) + torch.arange(L).unsqueeze(0)  # [r, L] slot index within the request
    visible = j < stop.unsqueeze(1)
    j = torch.where(visible, j, first.unsqueeze(1))  # padding reads a real slot, then is masked
    blk = table.long().gather(1, j // bs)  # [r, L]
    off = j % bs
    b = bias.view(-1, bs, bias.shape[1])[blk, off]  # [r, L, hkv]
    return keys[blk, :, off], values[blk, :, off], b, visible  # advanced indices first: [r, L, hkv, d]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, logit_bias: torch.Tensor,
            scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q [r, hkv, Q, d], k/v [r, hkv, S, d], logit_bias [r, hkv, Q | 1, S] (−inf: invisible; every row sees
    at least one key) → out [r, hkv, Q, d], lse [r, hkv, Q] (float32). One call of torch's CPU flash kernel,
    which takes the bias as an additive mask and returns the log-sum-exp, in q's dtype: float32 agrees with
    the plain softmax to ~1e-6; bf16 (a bf16 server's state) to ~2e-3, 8× faster than the unfused math."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k.to(q.dtype), v.to(q.dtype), 0.0, False, attn_mask=logit_bias.to(q.dtype), scale=scale)[:2]
    return out.float(), lse.float()


def paged_attention(query: torch.Tensor, kv_cache: torch.Tensor, bias: torch.Tensor, query_start_loc: torch.Tensor,
                    seq_lens: torch.Tensor, block_table: torch.Tensor, scale: float, out: torch.Tensor,
                    key_start: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of every request's new tokens over its cached slots key_start … S−1, β added; the
    output is written into out, the log-sum-exp returned.

    query/out [T, H, d]; kv_cache [nb, hkv, bs, 2d]; bias [nb · bs, hkv]; query_start_loc [r + 1];
    seq_lens [r] (cached + new tokens); block_table [r, max blocks]; key_start [r] (default 0). The new
    tokens of a request are its last L slots: token i sees slots j ≤ S − L + i. Decode rows (L = 1) run
    as one batch, longer ones (prefill chunks) one request at a time. Float32; returns lse [T, H]."""
    keys, values = split_cache(kv_cache)
    hkv, d = keys.shape[1], keys.shape[3]
    T, H, _ = query.shape
    g = H // hkv
    starts = query_start_loc.long()
    lens = (starts[1:] - starts[:-1])  # [r] new tokens per request
    seq = seq_lens.long()
    first = torch.zeros_like(seq) if key_start is None else key_start.long()
    lse_out = torch.empty(T, H, dtype=torch.float32)
    rows = torch.nonzero(lens == 1).flatten()
    if rows.numel():
        k, v, b, visible = _gather(keys, values, bias, block_table[rows], first[rows], seq[rows])
        bias_rows = b.float().masked_fill(~visible.unsqueeze(-1), NEG_INF).permute(0, 2, 1).unsqueeze(2)  # [r,hkv,1,L]
        tok = starts[rows]
        q = query[tok].float().view(-1, hkv, g, d)  # [r, hkv, g, d]
        o, lse = _attend(q, k.float().transpose(1, 2), v.float().transpose(1, 2), bias_rows, scale)
        out[tok] = o.reshape(-1, H, d).to(out.dtype)
        lse_out[tok] = lse.reshape(-1, H)
    for r in torch.nonzero(lens > 1).flatten().tolist():
        s0, L, S = int(starts[r]), int(lens[r]), int(seq[r])
        k, v, b, _ = _gather(keys, values, bias, block_table[r:r + 1], first[r:r + 1], seq[r:r + 1])
        span = S - int(first[r])
        q = query[s0:s0 + L].float().view(L, hkv, g, d).permute(1, 2, 0, 3).reshape(1, hkv, g * L, d)
        pos = torch.arange(S - L, S).repeat(g)  # [g·L] absolute position of each query row
        causal = torch.arange(int(first[r]), S).unsqueeze(0) <= pos.unsqueeze(1)  # [g·L, span]
        logit_bias = b[:, :span].float().permute(0, 2, 1).unsqueeze(2).masked_fill(~causal, NEG_INF)
        o, lse = _attend(q, k[:, :span].float().transpose(1, 2), v[:, :span].float().transpose(1, 2), logit_bias,
                         scale)  # [1, hkv, g·L, d]
        out[s0:s0 + L] = o.view(hkv, g, L, d).permute(2, 0, 1, 3).reshape(L, H, d).to(out.dtype)
        lse_out[s0:s0 + L] = lse.view(hkv, g, L).permute(2, 0, 1).reshape(L, H)
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
