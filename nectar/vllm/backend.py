"""The NECTAR attention backend for vLLM (CPU): the document state's keys, values AND β, ragged per head.

Registered by the plugin (``nectar.vllm.plugin``) in place of vLLM's ``CPU_ATTN`` when the server is
started for biased states. It keeps vLLM's paged cache, metadata builder and scheduler; only the
per-layer attention changes: ``nectar.vllm.paged_attention`` — one softmax over a request's cache
slots with a per-slot log-mass β added, which for a request whose first m slots hold a document's
state is design.md's LSE merge of the state with the request's own causal attention. Each layer keeps
a β store beside its paged cache (one float per slot and KV head): ordinary token writes set it to 0,
the KV connector writes a state's β with its keys and values (``write_state_slots``).

Decoder self-attention only (the served models are decoder LMs); anything else is refused at build.
Loaded inside the vLLM server's environment: imports torch and vLLM, never the rest of nectar.
"""
from __future__ import annotations

import torch

from vllm.logger import init_logger
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl

from .paged_attention import paged_attention, write_slots

logger = init_logger(f"vllm.{__name__}")  # under "vllm": its handler prints it


class NectarAttentionImpl(CPUAttentionBackendImpl):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.attn_type != AttentionType.DECODER or self.alibi_slopes is not None or self.sliding_window != -1 \
                or self.logits_soft_cap or self.sinks is not None or self.is_fp8_kv_cache:
            raise NotImplementedError(
                "the NECTAR attention backend serves decoder self-attention without ALiBi, sliding window, "
                "soft cap, sinks or an fp8 KV cache; serve this model without --nectar-attention (β-free refit)")
        self._bias: torch.Tensor | None = None  # [num_blocks · block_size, hkv] the layer's β store

    def bias_store(self, kv_cache: torch.Tensor) -> torch.Tensor:
        nb, hkv, bs, _ = kv_cache.shape
        if self._bias is None or self._bias.shape[0] != nb * bs:
            self._bias = torch.zeros(nb * bs, hkv, dtype=torch.float32, device=kv_cache.device)
        return self._bias

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        write_slots(kv_cache, self.bias_store(kv_cache), key, value, slot_mapping)

    def write_state_slots(self, kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          beta: torch.Tensor, slots: torch.Tensor) -> None:
        """The connector's write: a document state's key/value [t, hkv, d] and β [t, hkv] into ``slots``."""
        write_slots(kv_cache, self.bias_store(kv_cache), key, value, slots, beta)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("fused output quantization is not supported by the NECTAR backend")
        if attn_metadata is None:  # profiling / warm-up run
            return output
        t = attn_metadata.num_actual_tokens
        hq, d = self.num_heads, self.head_size
        out = output[:t].view(t, hq, d)
        paged_attention(query[:t].view(t, hq, d), kv_cache, self.bias_store(kv_cache), attn_metadata.query_start_loc,
                        attn_metadata.seq_lens, attn_metadata.block_table, self.scale, out)
        return output


class NectarAttentionBackend(CPUAttentionBackend):
    """vLLM's CPU backend with the NECTAR impl: same cache shape, builder and metadata."""

    @staticmethod
    def get_impl_cls() -> type[NectarAttentionImpl]:
        return NectarAttentionImpl
