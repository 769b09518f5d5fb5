"""The NECTAR attention function, registered through transformers' ``AttentionInterface``.

While ``nectar_attention(model, provider, recorder)`` is active, every attention layer of ``model``
computes, for the tokens it is given (query tokens at positions n…, plus any local cache):

    local = exact causal state over the pair's own tokens                  (AttnState)
    doc   = provider(layer, q, scaling)   — exact (capture/oracle) or a module (blend)
    out   = merge(doc, local)

No modeling code is forked: any model whose attention goes through the interface (Llama, Qwen2,
Qwen3, Mistral, …) works, with its own scaling, rotated (post-RoPE, post q/k-norm) queries and GQA.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Callable, Iterator, Protocol

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from .kernels import fused_state
from .state import AttnState, attention_state, expand_kv, merge_states

IMPL_NAME = "nectar"
# The decode engine's implementation: the same function, but registered without a mask function, so
# transformers builds no mask at all (the engine's LocalKV holds its own masks on the device, and
# the mask preparation would read tensors back to the host every step).
ENGINE_IMPL_NAME = "nectar_engine"


class DocStateProvider(Protocol):
    def __call__(self, layer: int, q: torch.Tensor, scaling: float) -> AttnState | None:
        """q: [b, hq, m, d] rotated queries → the document state per query head, or None."""


# (layer, q [b, hq, m, d], document state, local state): the local state's lse lets a recorder weigh
# the document against the query's own tokens (KVzip's scores are shares of the whole softmax).
Recorder = Callable[[int, torch.Tensor, AttnState | None, AttnState | None], None]


class _Active:
    """Per-model state of an active context (looked up by the attention module's config)."""

    def __init__(self, provider: DocStateProvider | None, recorder: Recorder | None,
                 segments: tuple[tuple[int, int], ...] | None, local_kv=None):
        self.provider = provider
        self.recorder = recorder
        self.segments = segments
        self.local_kv = local_kv  # the decode engine's batch (attends through its local_cache.LocalKV)


_ACTIVE: dict[int, _Active] = {}
_LOCK = threading.Lock()


def nectar_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # [b, hq, m, d]
    key: torch.Tensor,  # [b, hkv, k_len, d] (local tokens only: earlier cached + current)
    value: torch.Tensor,  # [b, hkv, k_len, d]
    attention_mask: torch.Tensor | None,  # bool [b, 1, m, k_len] (True = attend) or None (causal)
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    active = _ACTIVE.get(id(module.config))
    if active is None:
        raise RuntimeError("nectar attention called outside nectar_attention(...) context")
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    if active.local_kv is not None:  # the decode engine: its own cache and masks (local_cache.py)
        doc = active.provider(module.layer_idx, query, scaling) if active.provider is not None else None
        return active.local_kv.attend(module.layer_idx, query, key, value, scaling, doc), None
    if attention_mask is not None and attention_mask.dtype != torch.bool:
        attention_mask = attention_mask > -1  # additive float mask → visibility
    if active.segments is not None:
        local = _packed_local_state(query, key, value, active.segments, scaling)
    else:
        local = _local_state(query, key, value, attention_mask, scaling)
    doc = active.provider(module.layer_idx, query, scaling) if active.provider is not None else None
    if active.recorder is not None:
        active.recorder(module.layer_idx, query, doc, local)
    merged = merge_states(doc, local)
    return merged.out.to(query.dtype).transpose(1, 2).contiguous(), None  # [b, m, hq, d]


def _local_state(query, key, value, attention_mask, scaling) -> AttnState:
    """The exact causal state over the tokens this forward sees (GQA via repeated KV heads)."""
    m, k_len = query.shape[2], key.shape[2]
    if attention_mask is None and m == k_len and m > 1:
        # Plain causal attention over a fresh block (teacher forcing, capture, prefill of a prompt):
        # torch's fused kernel returns the lse too.
        try:
            hq = query.shape[1]
            return fused_state(query, expand_kv(key, hq), expand_kv(value, hq), scaling, causal=True)
        except RuntimeError:
            pass  # kernel unavailable for this dtype/device: exact math below
    return attention_state(query, key, value, scaling,
                           causal_offset=(k_len - m) if attention_mask is None else None,
                           key_mask=attention_mask)


def _packed_local_state(query, key, value, segments, scaling) -> AttnState:
    """Several sequences packed along one row (no padding): each attends causally to itself only.

    query [1, hq, T, d], key/value [1, hkv, T, d]; ``segments`` are the (start, stop) token ranges
    that tile [0, T). One fused causal call per segment, so the cost is the sum of the segments'
    own triangles, not a T x T mask.
    """
    b, hq, t, _ = query.shape
    if b != 1 or key.shape[2] != t or segments[0][0] != 0 or segments[-1][1] != t:
        raise ValueError(f"packed attention needs one row of T={t} fresh tokens tiled by the segments "
                         f"(got batch {b}, {key.shape[2]} keys, segments {segments[0]}…{segments[-1]})")
    key, value = expand_kv(key, hq), expand_kv(value, hq)  # [1, hq, T, d]
    parts = [_local_state(query[:, :, s:e], key[:, :, s:e], value[:, :, s:e], None, scaling)
             for s, e in segments]
    if len(parts) == 1:
        return parts[0]
    return AttnState(torch.cat([p.out for p in parts], dim=2), torch.cat([p.lse for p in parts], dim=2))


AttentionInterface.register(IMPL_NAME, nectar_attention_forward)
AttentionInterface.register(ENGINE_IMPL_NAME, nectar_attention_forward)
# Same mask semantics as sdpa: a bool mask, or None when plain causal attention suffices.
AttentionMaskInterface.register(IMPL_NAME, sdpa_mask)


@contextlib.contextmanager
def nectar_attention(
    model: torch.nn.Module,
    provider: DocStateProvider | None,
    recorder: Recorder | None = None,
    segments: list[tuple[int, int]] | None = None,
    local_kv=None,
) -> Iterator[None]:
    """Install the NECTAR attention on ``model`` for the duration of the block (removed in finally).

    ``segments``: the forwards inside the block take one packed row of several query sequences, the
    (start, stop) ranges given here, each attending only to itself locally (see ``_packed_local_state``).
    ``local_kv``: the decode engine's batch, any object with ``attend(layer, q, k, v, scaling, doc)``
    over its local cache (``local_cache.LocalKV``); the model is then called with ``use_cache=False``
    and no attention mask, and every layer attends through it.
    """
    # Attention layers may hold a sub-config (multimodal wrappers); key by each layer's config.
    config_ids = {id(mod.config) for mod in model.modules() if hasattr(mod, "layer_idx") and hasattr(mod, "config")}
    config_ids.add(id(model.config))
    with _LOCK:
        if config_ids & _ACTIVE.keys():
            raise RuntimeError("nectar_attention is already active on this model")
        for cid in config_ids:
            _ACTIVE[cid] = _Active(provider, recorder, tuple(segments) if segments is not None else None,
                                   local_kv)
    previous = model.config._attn_implementation
    try:
        model.set_attn_implementation(ENGINE_IMPL_NAME if local_kv is not None else IMPL_NAME)
        yield
    finally:
        model.set_attn_implementation(previous)
        with _LOCK:
            for cid in config_ids:
                _ACTIVE.pop(cid, None)
