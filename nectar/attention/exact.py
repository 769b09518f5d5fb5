"""The exact document state provider: (A, α) computed from the document's KV cache.

With it, the query-only forward IS the full-context model (docs/design.md §2, the oracle): the document
is prefilled once (``doc_kv.prefill_document``) and every batch of queries attends to that one copy.
"""
from __future__ import annotations

import torch

from .doc_kv import DocKV
from .kernels import choose_backend, fused_state
from .state import AttnState, attention_state


class ExactDocState:
    """Provider of the exact document state (A, α) from the document KV cache.

    Every query of the batch attends to the same document keys, so batch, GQA group and tokens are
    folded into one query axis per KV head: one matmul per key chunk, no KV copy per pair.
    """

    def __init__(self, doc_kv: DocKV, backend: str = "auto", chunk_size: int = 4096):
        self.doc_kv = doc_kv
        self.chunk_size = chunk_size
        device = doc_kv.keys[0].device
        # flash: the flash-attn package (CUDA); fused: torch's own flash kernel, which returns the lse
        # too (CUDA and CPU); torch: exact chunked float32 math, the reference the others are tested
        # against.
        self.backend = choose_backend(backend, device, doc_kv.keys[0].dtype)

    def __call__(self, layer: int, q: torch.Tensor, scaling: float) -> AttnState:
        if self.backend == "flash":
            return self._flash(layer, q, scaling)
        b, hq, m, d = q.shape
        k, v = self.doc_kv.keys[layer], self.doc_kv.values[layer]  # [hkv, n, d]
        hkv = k.shape[0]
        g = hq // hkv
        qf = q.reshape(b, hkv, g, m, d).permute(1, 2, 0, 3, 4).reshape(1, hkv, g * b * m, d)
        if self.backend == "fused":
            st = fused_state(qf, k.unsqueeze(0), v.unsqueeze(0), scaling)
        else:
            st = attention_state(qf, k.unsqueeze(0), v.unsqueeze(0), scaling, chunk_size=self.chunk_size)
        out = st.out.reshape(hkv, g, b, m, d).permute(2, 0, 1, 3, 4).reshape(b, hq, m, d)  # [b, hq, m, d]
        lse = st.lse.reshape(hkv, g, b, m).permute(2, 0, 1, 3).reshape(b, hq, m)  # [b, hq, m]
        return AttnState(out, lse)

    def _flash(self, layer: int, q: torch.Tensor, scaling: float) -> AttnState:
        from flash_attn import flash_attn_func

        b, hq, m, d = q.shape
        k, v = self.doc_kv.keys[layer], self.doc_kv.values[layer]  # [hkv, n, d]
        qf = q.permute(0, 2, 1, 3).reshape(1, b * m, hq, d)  # batch folded into the sequence axis
        kf = k.permute(1, 0, 2).unsqueeze(0)  # [1, n, hkv, d] (flash handles GQA natively)
        vf = v.permute(1, 0, 2).unsqueeze(0)
        dtype = qf.dtype  # half precision: choose_backend gives flash to no other model
        out, lse, _ = flash_attn_func(qf, kf.to(dtype), vf.to(dtype), softmax_scale=scaling,
                                      causal=False, return_attn_probs=True)
        out = out.reshape(b, m, hq, d).permute(0, 2, 1, 3).float()  # [b, hq, m, d]
        lse = lse.reshape(hq, b, m).permute(1, 0, 2).float()  # flash lse is [1, hq, b*m]
        return AttnState(out, lse)
