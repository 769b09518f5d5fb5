"""The decode engine's local KV cache and the attention over it (docs/design.md §2, §12).

With a document provider only the question's and the answer's own tokens are cached ("local"); the
document's part of every attention layer comes from the provider as a state (A, a). ``LocalKV``
allocates once per batch, for every layer, float32 keys and values [b, hkv, g + capacity, d]:

    slots 0 … g-1    the document state as g *virtual keys*, one per query head of the KV head's
                     group: key 0, value A, and an additive mask entry a on that query head's row
                     (-inf on the others), so its logit is exactly a = lse(document);
    slots g …        the local tokens (left-padded rows: padding masked out).

Softmax over [a, local logits] with values [A, local values] is exactly merge((A, a), local), so in
decode (one query per row) the local attention state AND the merge are one
``F.scaled_dot_product_attention`` call per layer: no lse round trip, no merge kernels, no GQA copy
(the group's query heads are folded into the query axis of their KV head). The cache is float32
because the mask must have the query's dtype and a is a log-sum-exp: in bf16 it would be rounded to
1/16 at |a| ≈ 10 and the merge weights with it. It holds only question and answer tokens, so its
size is negligible next to the weights.

Prefill (several tokens per row) computes the local causal state with torch's fused kernel (its lse
included) and merges it with the document state (``merge_states``).

``static_shapes``: decode attends over the whole capacity with future slots masked, and the write
position lives in a device tensor — nothing depends on host values, so a CUDA graph can capture the
step. Otherwise the slot range is sliced by the host-known length (less work on a CPU).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .kernels import fused_state
from .state import AttnState, attention_state, expand_kv, merge_states

NEG_INF = float("-inf")


class LocalKV:
    def __init__(self, num_layers: int, batch: int, num_kv_heads: int, num_q_heads: int, head_dim: int,
                 capacity: int, device: torch.device, static_shapes: bool = False):
        g = num_q_heads // num_kv_heads
        self.g, self.capacity, self.static_shapes = g, capacity, static_shapes
        shape = (num_layers, batch, num_kv_heads, g + capacity, head_dim)
        self.k = torch.zeros(shape, dtype=torch.float32, device=device)  # [L, b, hkv, g + cap, d]
        self.v = torch.zeros(shape, dtype=torch.float32, device=device)
        # Additive decode mask [b, hkv, g, g + cap]: the virtual block is -inf off its diagonal (the
        # diagonal is each layer's a); local slots become 0 as real tokens fill them.
        self.bias = torch.full((batch, num_kv_heads, g, g + capacity), NEG_INF, device=device)
        self.length = 0  # local slots filled (the same for every row: prompts are left-padded)
        self.slot = torch.full((1,), g, dtype=torch.long, device=device)  # static_shapes: next slot
        self.prefill_mask: torch.Tensor | None = None  # [b, 1, m, m] bool when the prompts are padded

    @property
    def batch(self) -> int:
        return self.k.shape[1]

    def reset(self) -> None:
        """Empty (for reuse by another batch of the same shape): every slot masked, nothing written."""
        self.bias.fill_(NEG_INF)
        self.length = 0
        self.slot.fill_(self.g)
        self.prefill_mask = None

    def copy_rows(self, other: "LocalKV", rows: torch.Tensor) -> None:
        """Take rows ``rows`` of ``other`` (a larger batch of the same capacity) as this cache's rows."""
        self.k.copy_(other.k[:, rows])
        self.v.copy_(other.v[:, rows])
        self.bias.copy_(other.bias[rows])
        self.slot.copy_(other.slot)
        self.length = other.length

    # ----- bookkeeping around each forward (called by the engine) -----

    def begin_prefill(self, real: torch.Tensor) -> None:
        """real [b, m] bool: which prompt positions hold tokens (left padding is False)."""
        b, m = real.shape
        if m > self.capacity:
            raise ValueError(f"prompt of {m} tokens exceeds the local cache of {self.capacity}")
        self.bias[..., self.g:self.g + m] = torch.where(real, 0.0, NEG_INF)[:, None, None, :]
        self.prefill_mask = None
        if not bool(real.all()):
            causal = torch.ones(m, m, dtype=torch.bool, device=real.device).tril()  # [m, m]
            eye = torch.eye(m, dtype=torch.bool, device=real.device)
            # A padding query sees only itself: a row with no visible key would give NaN, and NaN
            # values times a zero weight would reach the real tokens through the next layer.
            self.prefill_mask = ((causal & real[:, None, :]) | eye)[:, None]  # [b, 1, m, m]

    def begin_decode_step(self) -> None:
        """The slot this step writes becomes visible (decode tokens are always real)."""
        if self.static_shapes:
            self.bias.index_fill_(-1, self.slot, 0.0)
        else:
            self.bias[..., self.g + self.length] = 0.0

    def end_forward(self, m: int) -> None:
        self.length += m
        self.slot += m

    # ----- attention (called by the attention function of every layer) -----

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float,
               doc: AttnState | None) -> torch.Tensor:
        """q [b, hq, m, d], new k/v [b, hkv, m, d] → attention output [b, m, hq, d] in q's dtype."""
        if q.shape[2] == 1:
            return self._decode(layer, q, k, v, scaling, doc)
        return self._prefill(layer, q, k, v, scaling, doc)

    def _prefill(self, layer, q, k, v, scaling, doc) -> torch.Tensor:
        m, start = q.shape[2], self.g + self.length
        if self.length:
            raise RuntimeError("multi-token forwards after the prompt are not supported by LocalKV")
        self.k[layer, :, :, start:start + m] = k
        self.v[layer, :, :, start:start + m] = v
        hq = q.shape[1]
        kk, vv = expand_kv(k, hq), expand_kv(v, hq)  # [b, hq, m, d]
        if self.prefill_mask is None:
            local = fused_state(q, kk, vv, scaling, causal=True)
        elif q.device.type == "cpu":
            local = fused_state(q, kk, vv, scaling, mask=self.prefill_mask)
        else:  # CUDA's flash kernel takes no mask: exact math (prefill only)
            local = attention_state(q, kk, vv, scaling, key_mask=self.prefill_mask)
        out = merge_states(doc, local).out  # [b, hq, m, d] float32
        return out.to(q.dtype).transpose(1, 2)

    def _decode(self, layer, q, k, v, scaling, doc) -> torch.Tensor:
        b, hq, _, d = q.shape
        hkv, g = k.shape[1], self.g
        if self.static_shapes:
            self.k[layer].index_copy_(2, self.slot, k.float())
            self.v[layer].index_copy_(2, self.slot, v.float())
            end = self.k.shape[3]
        else:
            s = g + self.length
            self.k[layer, :, :, s:s + 1] = k
            self.v[layer, :, :, s:s + 1] = v
            end = s + 1
        if doc is not None:  # the document state as the g virtual keys of each KV head
            self.v[layer, :, :, :g] = doc.out.reshape(b, hkv, g, d)
            self.bias[..., :g].diagonal(dim1=-2, dim2=-1).copy_(doc.lse.reshape(b, hkv, g))
        qf = q.reshape(b, hkv, g, d).float()  # one query per row: the group's heads share the KV head
        out = F.scaled_dot_product_attention(qf, self.k[layer, :, :, :end], self.v[layer, :, :, :end],
                                             attn_mask=self.bias[..., :end], scale=scaling)  # [b, hkv, g, d]
        return out.reshape(b, 1, hq, d).to(q.dtype)
