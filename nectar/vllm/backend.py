"""The NECTAR attention backend for vLLM (CPU): the document state's keys, values AND β, ragged per head.

Registered by the plugin (``nectar.vllm.plugin``) in place of vLLM's ``CPU_ATTN`` when the server is
started for biased states. It keeps vLLM's paged cache, metadata builder and scheduler; only the
per-layer attention changes (``nectar.vllm.paged_attention``). Each layer keeps a β store beside its
paged cache (one float per slot and KV head): ordinary token writes set it to 0, the KV connector
writes a state's β with its keys and values (``write_state_slots``).

The documents' states are also held densely, once per server process (``DOCUMENTS``: per layer trimmed
to its widest head, so a narrow layer costs only its own pairs), and the connector marks the first cache
block of every state it writes (``BLOCKS``: block id → document; an ordinary write at a block's first
slot — the block changed hands — unmarks it). A request whose first block is marked takes the split
path: its own slots from m on through the paged cache, the state through one GEMM shared by every
query token on that document in the step, merged by log-sum-exp. Any other request takes the one-pass
path over all its slots with β added — the same numbers, the state re-read per request.

Decoder self-attention only (the served models are decoder LMs); anything else is refused at build.
Loaded inside the vLLM server's environment: imports torch and vLLM, never the rest of nectar.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

from vllm.logger import init_logger
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl

from .paged_attention import SlotPlan, merge, paged_attention, plan_slots, state_attention, write_slots

logger = init_logger(f"vllm.{__name__}")  # under "vllm": its handler prints it

_LAYER_INDEX = re.compile(r"layers\.(\d+)\.")


@dataclass
class DenseState:
    m: int  # the document's pseudo-tokens (the request's own tokens start at slot m)
    layers: tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], ...]  # per layer: keys, values [hkv, w, d], β [hkv, w]
    cast: dict = field(default_factory=dict)  # (layer, dtype) → keys, values in the server's dtype (made once)

    def layer(self, index: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Keys and values in ``dtype`` (the queries'), β in float32."""
        k, v, b = self.layers[index]
        if dtype == k.dtype:
            return k, v, b
        if (index, dtype) not in self.cast:
            self.cast[(index, dtype)] = (k.to(dtype).contiguous(), v.to(dtype).contiguous())
        return (*self.cast[(index, dtype)], b)


DOCUMENTS: dict[str, DenseState] = {}  # doc id → its state, this process
BLOCKS: dict[int, str] = {}  # cache block id → the document whose state starts there
_ANNOUNCED: set[str] = set()  # documents the split path has served (logged once each)


def register_document(doc: str, m: int, keys: list[torch.Tensor], values: list[torch.Tensor],
                      betas: list[torch.Tensor]) -> None:
    """Hold a document's state densely: per layer only up to its last pair that any head keeps (β > −inf)."""
    layers = []
    for k, v, b in zip(keys, values, betas):
        kept = torch.isfinite(b).any(0).nonzero()  # [≤ m, 1] slots some head keeps
        w = int(kept.max()) + 1 if kept.numel() else 1
        layers.append((k[:, :w].float().contiguous(), v[:, :w].float().contiguous(), b[:, :w].float().contiguous()))
    DOCUMENTS[doc] = DenseState(m, tuple(layers))


def mark_state_block(block: int, doc: str) -> None:
    BLOCKS[block] = doc


@dataclass(frozen=True)
class Step:
    """What every layer of one forward step shares: computed by the first layer, reused by the others."""
    plan: SlotPlan  # where each request's rows read their keys (from m on for a request on a document)
    documents: dict[str, torch.Tensor]  # doc → its requests' query rows (empty: the one-pass path for all)


_STEP: list = [None, None]  # [the metadata object the step was made for, its Step]: one entry, held so
# the object's id cannot be reused by a later step's metadata


def _step(meta, hkv: int, bs: int, g: int) -> Step:
    """The step's plan, made once per metadata object (vLLM builds one per step for all layers)."""
    if _STEP[0] is meta and (_STEP[1].plan.hkv, _STEP[1].plan.bs, _STEP[1].plan.g) == (hkv, bs, g):
        return _STEP[1]
    r = meta.seq_lens.shape[0]
    docs = [BLOCKS.get(b) for b in meta.block_table[:r, 0].tolist()] if BLOCKS else [None] * r
    if not any(docs):
        step = Step(plan_slots(meta.query_start_loc, meta.seq_lens, meta.block_table, hkv, bs, g), {})
    else:
        first = torch.tensor([DOCUMENTS[doc].m if doc else 0 for doc in docs])
        starts = meta.query_start_loc.tolist()
        documents = {}
        for doc in dict.fromkeys(filter(None, docs)):
            if doc not in _ANNOUNCED:
                _ANNOUNCED.add(doc)
                logger.info("nectar: document %s attended by the split path (its state once per step)", doc)
            documents[doc] = torch.cat([torch.arange(starts[i], starts[i + 1]) for i, dd in enumerate(docs) if dd == doc])
        plan = plan_slots(meta.query_start_loc, meta.seq_lens, meta.block_table, hkv, bs, g, key_start=first)
        step = Step(plan, documents)
    _STEP[:] = [meta, step]
    return step


class NectarAttentionImpl(CPUAttentionBackendImpl):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.attn_type != AttentionType.DECODER or self.alibi_slopes is not None or self.sliding_window != -1 \
                or self.logits_soft_cap or self.sinks is not None or self.is_fp8_kv_cache:
            raise NotImplementedError(
                "the NECTAR attention backend serves decoder self-attention without ALiBi, sliding window, "
                "soft cap, sinks or an fp8 KV cache; serve this model's β-free refit instead")
        self._bias: torch.Tensor | None = None  # [num_blocks · block_size, hkv] the layer's β store
        self._index: int | None = None  # the layer's index in the model (its state's layer)

    def bias_store(self, kv_cache: torch.Tensor) -> torch.Tensor:
        nb, hkv, bs, _ = kv_cache.shape
        if self._bias is None or self._bias.shape[0] != nb * bs:
            self._bias = torch.zeros(nb * bs, hkv, dtype=torch.float32, device=kv_cache.device)
        return self._bias

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        write_slots(kv_cache, self.bias_store(kv_cache), key, value, slot_mapping)
        if BLOCKS:
            bs = kv_cache.shape[2]
            for block in (slot_mapping[(slot_mapping >= 0) & (slot_mapping % bs == 0)] // bs).tolist():
                BLOCKS.pop(block, None)  # a new owner's first token: no state starts here any more

    def write_state_slots(self, kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          beta: torch.Tensor, slots: torch.Tensor) -> None:
        """The connector's write: a document state's key/value [t, hkv, d] and β [t, hkv] into ``slots``
        (the connector marks the state's first block after writing every layer)."""
        write_slots(kv_cache, self.bias_store(kv_cache), key, value, slots, beta)
        if BLOCKS:
            bs = kv_cache.shape[2]
            for block in (slots[slots % bs == 0] // bs).tolist():
                BLOCKS.pop(block, None)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("fused output quantization is not supported by the NECTAR backend")
        if attn_metadata is None:  # profiling / warm-up run
            return output
        if self._index is None:
            self._index = int(_LAYER_INDEX.search(layer.layer_name).group(1))
        t = attn_metadata.num_actual_tokens
        hq, d = self.num_heads, self.head_size
        q = query[:t].reshape(t, hq, d)
        out = output[:t].view(t, hq, d)
        bias = self.bias_store(kv_cache)
        step = _step(attn_metadata, kv_cache.shape[1], kv_cache.shape[2], hq // kv_cache.shape[1])
        meta = attn_metadata
        if not step.documents:
            paged_attention(q, kv_cache, bias, meta.query_start_loc, meta.seq_lens, meta.block_table, self.scale, out,
                            plan=step.plan)
            return output
        own = torch.empty(t, hq, d, dtype=torch.float32)
        # own slots from m on: ordinary writes, β = 0, so the β store is not read (bias None)
        lse = paged_attention(q, kv_cache, None, meta.query_start_loc, meta.seq_lens, meta.block_table, self.scale,
                              own, plan=step.plan)
        for doc, rows in step.documents.items():
            k, v, b = DOCUMENTS[doc].layer(self._index, q.dtype)
            st_out, st_lse = state_attention(q[rows], k, v, b, self.scale)  # [T_doc, H, d], [T_doc, H]
            own[rows], _ = merge(own[rows], lse[rows], st_out, st_lse)
        out.copy_(own.to(out.dtype))
        return output


class NectarAttentionBackend(CPUAttentionBackend):
    """vLLM's CPU backend with the NECTAR impl: same cache shape, builder and metadata."""

    @staticmethod
    def get_impl_cls() -> type[NectarAttentionImpl]:
        return NectarAttentionImpl
