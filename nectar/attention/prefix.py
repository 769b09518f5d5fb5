"""The document's KV cache: computed once per (model, document), persisted, reused everywhere.

``ExactDocState`` turns it into the exact document state for any batch of queries, so the
"full-context model" is the same NECTAR forward as the module-plugged one, with an exact provider
instead of a learned one — and no stage ever re-prefills the document per pair.
"""
from __future__ import annotations

from dataclasses import dataclass

import fsspec
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from ..models import BaseModel
from ..integrity import stable_safetensors
from ..storage import atomic_write
from .state import AttnState, attention_state


class DocKVMismatch(ValueError):
    """A cached document KV was made for another model or document."""


@dataclass
class DocKV:
    keys: list[torch.Tensor]  # per layer [hkv, n, d] (rotated keys, as the model caches them)
    values: list[torch.Tensor]  # per layer [hkv, n, d]

    @property
    def n(self) -> int:
        return self.keys[0].shape[1]

    def nbytes(self) -> int:
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size()
                   for k, v in zip(self.keys, self.values))


@torch.no_grad()
def prefill_document(base: BaseModel, context_ids, chunk_tokens: int = 2048) -> DocKV:
    """One forward over the document (in chunks of ``chunk_tokens`` to bound activation memory)."""
    from transformers import DynamicCache

    ids = torch.as_tensor(list(context_ids), dtype=torch.long, device=base.device).unsqueeze(0)  # [1, n]
    cache = DynamicCache(config=base.model.config)
    for start in range(0, ids.shape[1], chunk_tokens):
        # logits_to_keep=1: the LM head over every document token would be thrown away.
        base.model(input_ids=ids[:, start:start + chunk_tokens], past_key_values=cache, use_cache=True,
                   logits_to_keep=1)
    keys = [layer.keys[0].contiguous() for layer in cache.layers]  # [hkv, n, d]
    values = [layer.values[0].contiguous() for layer in cache.layers]
    return DocKV(keys, values)


def save_doc_kv(doc_kv: DocKV, url: str, meta: dict[str, str]) -> None:
    tensors = {f"k.{i}": k.cpu() for i, k in enumerate(doc_kv.keys)}
    tensors.update({f"v.{i}": v.cpu() for i, v in enumerate(doc_kv.values)})
    blob = st_save(tensors, metadata={k: str(v) for k, v in meta.items()})
    atomic_write(url, stable_safetensors(blob))  # same KV, same bytes: its digest feeds cache keys


def read_doc_kv_meta(url: str) -> dict[str, str]:

    fs, path = fsspec.core.url_to_fs(url)
    with fs.open(path, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        import json

        return json.loads(f.read(header_len)).get("__metadata__", {})


def load_doc_kv(url: str, base: BaseModel, expect: dict[str, str]) -> DocKV:
    """Load a cached document KV, refusing one made for another model or document."""
    meta = read_doc_kv_meta(url)
    for key, want in expect.items():
        if meta.get(key) != str(want):
            raise DocKVMismatch(
                f"{url}: cached document KV has {key}={meta.get(key)!r}, this run needs {want!r}; "
                "re-run the targets stage (--from targets) to rebuild it"
            )
    fs, path = fsspec.core.url_to_fs(url)
    with fs.open(path, "rb") as f:
        tensors = st_load(f.read())
    n_layers = len([k for k in tensors if k.startswith("k.")])
    keys = [tensors[f"k.{i}"].to(base.device, base.dtype) for i in range(n_layers)]
    values = [tensors[f"v.{i}"].to(base.device, base.dtype) for i in range(n_layers)]
    return DocKV(keys, values)


def flash_available(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


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
            st = _fused_state(qf, k.unsqueeze(0), v.unsqueeze(0), scaling)
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


HALF = (torch.float16, torch.bfloat16)


def choose_backend(backend: str, device: torch.device, dtype: torch.dtype) -> str:
    """The document-attention kernel for a model running in ``dtype`` on ``device``. flash-attn
    computes in float16/bfloat16 only: a float32 model never gets it silently (its states would be
    rounded to bf16): "auto" picks it for half-precision models only, and asking for it otherwise
    is an error that says what to use instead."""
    if backend == "auto":
        return "flash" if dtype in HALF and flash_available(device) else "fused"
    if backend == "flash" and device.type != "cuda":
        raise ValueError(f"attention backend 'flash' needs CUDA; use 'fused' or 'torch' on {device.type}")
    if backend == "flash" and dtype not in HALF:
        raise ValueError(f"attention backend 'flash' computes in float16/bfloat16, the model runs in {dtype}: "
                         "use model.attention_backend=fused or torch (exact), or model.dtype=bfloat16")
    return backend


def _fused_state(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float,
                 causal: bool = False) -> AttnState:
    """torch's fused flash kernel, which also returns the lse; q [b, h, M, d], k/v [b, h, n, d]
    (same head count). ``causal`` is top-left aligned, so only for M == n (no cached keys).
    The CUDA kernel computes in float16/bfloat16 only: float32 queries take the exact float32 path
    instead of being rounded."""
    if q.device.type == "cuda":
        if q.dtype not in HALF:
            return attention_state(q, k.to(q.dtype), v.to(q.dtype), scaling, causal_offset=0 if causal else None)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(
            q, k.to(q.dtype), v.to(q.dtype), 0.0, causal, False, scale=scaling)[:2]
    else:  # the CPU flash kernel agrees with the exact math to ~1e-6 in float32
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k.to(q.dtype), v.to(q.dtype), 0.0, causal, scale=scaling)
    return AttnState(out.float(), lse.float())  # [b, h, M, d], [b, h, M]
