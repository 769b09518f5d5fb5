"""Attention over vLLM's paged KV cache with a per-slot additive bias β: the document state's log-mass.

The NECTAR attention backend (``nectar.vllm.backend``) runs this in place of vLLM's CPU kernel, which
has no per-key bias. A document's state sits in a request's first m cache slots (the KV connector,
``nectar.vllm.connector``, writes its keys, values and β there); the request's own tokens follow with
β = 0. One softmax over [state slots; own tokens] with β added is exactly design.md's log-sum-exp merge
of the state's (A, a) with the request's causal attention (docs/deployment.md §15), and a β of −inf
pads the heads whose budget is below the layer's widest (ragged per-head budgets).

The cache layout is vLLM CPU's [num_blocks, hkv, 2 · block_size, d] view: per block and KV head the
block's keys, then its values, one row per slot (``write_slots``). Imports only torch: it runs inside
the vLLM server's environment and is tested against dense attention in this project's.
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


def _gather(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """cache [nb, hkv, bs, d], blocks [r, nblk] → [r, hkv, nblk · bs, d]: each request's slots in order."""
    g = cache[blocks]  # [r, nblk, hkv, bs, d]
    r, nblk, hkv, bs, d = g.shape
    return g.permute(0, 2, 1, 3, 4).reshape(r, hkv, nblk * bs, d)


def _gather_bias(bias: torch.Tensor, blocks: torch.Tensor, bs: int) -> torch.Tensor:
    """bias [nb · bs, hkv], blocks [r, nblk] → [r, hkv, nblk · bs]."""
    hkv = bias.shape[1]
    g = bias.view(-1, bs, hkv)[blocks]  # [r, nblk, bs, hkv]
    r, nblk = blocks.shape
    return g.permute(0, 3, 1, 2).reshape(r, hkv, nblk * bs)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, logit_bias: torch.Tensor, scale: float) -> torch.Tensor:
    """q [r, hkv, g·L, d], k/v [r, hkv, S, d], logit_bias [r, hkv, g·L | 1, S] (−inf: invisible) → [r, hkv, g·L, d]."""
    logits = torch.matmul(q, k.transpose(-1, -2)) * scale + logit_bias  # [r, hkv, g·L, S]
    probs = torch.softmax(logits, dim=-1)
    return torch.matmul(probs, v)


def paged_attention(query: torch.Tensor, kv_cache: torch.Tensor, bias: torch.Tensor, query_start_loc: torch.Tensor,
                    seq_lens: torch.Tensor, block_table: torch.Tensor, scale: float, out: torch.Tensor) -> torch.Tensor:
    """Causal attention of every request's new tokens over its cached slots, β added; written into out.

    query/out [T, H, d]; kv_cache [nb, hkv, bs, 2d]; bias [nb · bs, hkv]; query_start_loc [r + 1];
    seq_lens [r] (cached + new tokens); block_table [r, max blocks]. The new tokens of a request are
    its last L slots: token i sees slots j ≤ S − L + i. Decode rows (L = 1) run as one batch, longer
    ones (prefill chunks) one request at a time. Computed in float32."""
    keys, values = split_cache(kv_cache)
    hkv, bs = keys.shape[1], keys.shape[2]
    T, H, d = query.shape
    g = H // hkv
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    r = len(lens)
    decode = [i for i in range(r) if starts[i + 1] - starts[i] == 1]
    if decode:
        _decode(query, keys, values, bias, starts, lens, block_table, decode, scale, out, g, bs)
    for i in range(r):
        L = starts[i + 1] - starts[i]
        if L > 1:
            _prefill(query, keys, values, bias, starts[i], L, lens[i], block_table[i], scale, out, g, bs)
    return out


def _decode(query, keys, values, bias, starts, lens, block_table, rows, scale, out, g, bs) -> None:
    hkv, d = keys.shape[1], keys.shape[3]
    S = max(lens[i] for i in rows)
    nblk = -(-S // bs)
    idx = torch.tensor(rows, dtype=torch.long)
    blocks = block_table[idx, :nblk].long()  # [r, nblk]
    k = _gather(keys, blocks).float()  # [r, hkv, S', d]
    v = _gather(values, blocks).float()
    b = _gather_bias(bias, blocks, bs).float()  # [r, hkv, S']
    seq = torch.tensor([lens[i] for i in rows])
    visible = torch.arange(nblk * bs).unsqueeze(0) < seq.unsqueeze(1)  # [r, S']
    b = b.masked_fill(~visible.unsqueeze(1), NEG_INF).unsqueeze(2)  # [r, hkv, 1, S']
    v = v.masked_fill(~visible[:, None, :, None], 0.0)  # slots past the request: never read, even as NaN
    tok = torch.tensor([starts[i] for i in rows], dtype=torch.long)
    q = query[tok].float().view(len(rows), hkv, g, d)  # [r, hkv, g, d]
    o = _attend(q, k, v, b, scale)  # [r, hkv, g, d]
    out[tok] = o.reshape(len(rows), hkv * g, d).to(out.dtype)


def _prefill(query, keys, values, bias, start, L, S, table, scale, out, g, bs) -> None:
    hkv, d = keys.shape[1], keys.shape[3]
    nblk = -(-S // bs)
    blocks = table[:nblk].long().unsqueeze(0)  # [1, nblk]
    k = _gather(keys, blocks)[:, :, :S].float()  # [1, hkv, S, d]
    v = _gather(values, blocks)[:, :, :S].float()
    b = _gather_bias(bias, blocks, bs)[:, :, :S].float()  # [1, hkv, S]
    q = query[start:start + L].float().view(L, hkv, g, d).permute(1, 2, 0, 3).reshape(1, hkv, g * L, d)
    pos = torch.arange(S - L, S).repeat(g)  # [g·L] the absolute position of each query row
    causal = torch.arange(S).unsqueeze(0) <= pos.unsqueeze(1)  # [g·L, S]
    logit_bias = b.unsqueeze(2).masked_fill(~causal, NEG_INF)  # [1, hkv, g·L, S]
    o = _attend(q, k, v, logit_bias, scale)  # [1, hkv, g·L, d]
    out[start:start + L] = o.view(hkv, g, L, d).permute(2, 0, 1, 3).reshape(L, hkv * g, d).to(out.dtype)
