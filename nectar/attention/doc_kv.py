"""The document's KV cache: computed once per (model, document), persisted, reused everywhere.

``prefill_document`` runs the document through the model once (docs/design.md §3: never per pair);
``save_doc_kv`` / ``load_doc_kv`` persist it with the model and document it belongs to. The exact
document state over it is ``nectar.attention.exact.ExactDocState``.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import fsspec
import torch
from safetensors.torch import load as st_load

from ..cache_call import cache_kwargs
from ..integrity import write_stable_safetensors
from ..base_model import BaseLM
from ..storage import atomic_write


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


PREFILL_ACTIVATION_BYTES = 256 << 20  # the widest float32 activation of one prefill chunk (the MLP's)


def prefill_chunk(config) -> int:
    """Tokens per prefill forward: as many as keep the model's widest activation (its MLP
    intermediate, float32) near PREFILL_ACTIVATION_BYTES, at least 2,048. Fewer, larger chunks are
    faster: a chunk after the first attends to the cache through an explicit mask, which the CPU
    flash kernel computes in full (no causal skip) — SmolLM2-135M at 11,485 tokens took 46.0 s in
    chunks of 2,048, 41.8 s of 8,192, 36.4 s in one (its 1,536-wide MLP allows 43k), the KV the
    same to the bit (docs/benchmarks.md, "The first state's time")."""
    width = getattr(config, "intermediate_size", None) or 4 * config.hidden_size
    return max(2048, PREFILL_ACTIVATION_BYTES // (4 * width))


@torch.no_grad()
def prefill_document(base: BaseLM, context_ids, chunk_tokens: int | None = None,
                     start: DocKV | None = None) -> DocKV:
    """The KV cache of ``context_ids``: one forward over the document, in chunks of ``chunk_tokens``
    (bounds activation memory; default ``prefill_chunk``). ``start``: the KV of a prefix of
    ``context_ids`` already computed (a shorter cached prefix): only the tokens after it are run."""
    from transformers import DynamicCache

    chunk_tokens = chunk_tokens or prefill_chunk(base.model.config)
    ids = torch.as_tensor(list(context_ids), dtype=torch.long, device=base.device).unsqueeze(0)  # [1, n]
    done = 0
    if start is not None:
        data = [(k.unsqueeze(0), v.unsqueeze(0)) for k, v in zip(start.keys, start.values)]  # [1, hkv, P, d]
        cache, done = DynamicCache(ddp_cache_data=data, config=base.model.config), start.n
    else:
        cache = DynamicCache(config=base.model.config)
    for s in range(done, ids.shape[1], chunk_tokens):
        # logits_to_keep=1: the LM head over every document token would be thrown away.
        base.model(input_ids=ids[:, s:s + chunk_tokens], **cache_kwargs(base.model, cache), use_cache=True, logits_to_keep=1)
    keys = [layer.keys[0].contiguous() for layer in cache.layers]  # [hkv, n, d]
    values = [layer.values[0].contiguous() for layer in cache.layers]
    return DocKV(keys, values)


def save_doc_kv(doc_kv: DocKV, url: str, meta: dict[str, str]) -> None:
    """Streamed one layer at a time (a 64k-token Qwen3-1.7B KV is 7.5 GB: building the file in memory
    peaked at 4x that in host RAM); same KV, same bytes: its digest feeds cache keys."""
    tensors = {f"k.{i}": k for i, k in enumerate(doc_kv.keys)}
    tensors.update({f"v.{i}": v for i, v in enumerate(doc_kv.values)})
    metadata = {k: str(v) for k, v in meta.items()}
    atomic_write(url, lambda f: write_stable_safetensors(f, tensors, metadata))


def read_doc_kv_meta(url: str) -> dict[str, str]:
    fs, path = fsspec.core.url_to_fs(url)
    with fs.open(path, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        return json.loads(f.read(header_len)).get("__metadata__", {})


def load_doc_kv(url: str, base: BaseLM, expect: dict[str, str]) -> DocKV:
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
