"""The module as a document-state provider for ``nectar.attention`` (docs/design.md §2, "Blend").

The attention core asks ``provider(layer, q [b, hq, m, d], scaling)`` for the document's state per
query head; a module predicts it per KV head, so query heads are grouped by the KV head they
read (GQA: query head h reads KV head h // g) and folded into the module's token axis.
"""
from __future__ import annotations

import math

import torch

from ..attention.state import AttnState
from .builder import NectarModule
from .fused import FusedModule, fuse_module


def _check_fit(m, layer: int, q: torch.Tensor, scaling: float) -> tuple[int, int, int, int, int, int]:
    """Refuse queries of another model (scaling, heads, head dim); (b, hq, m, d, hkv, group) of q."""
    if not math.isclose(scaling, m.scaling, rel_tol=1e-5):
        raise ValueError(f"layer {layer}: attention scaling {scaling} differs from the module's "
                         f"{m.scaling}; the module was trained for another model")
    b, hq, t, d = q.shape
    hkv = m.num_kv_heads
    if hq % hkv or d != m.head_dim:
        raise ValueError(f"queries [b, {hq}, m, {d}] don't fit a module with {hkv} KV heads of "
                         f"dim {m.head_dim}")
    return b, hq, t, d, hkv, hq // hkv


class ModuleDocState:
    """Provider: (A_θ(q), a_θ(q)) in place of the document's (A, α). Differentiable."""

    def __init__(self, module: NectarModule):
        self.module = module

    def __call__(self, layer: int, q: torch.Tensor, scaling: float) -> AttnState:
        m = self.module
        b, hq, t, d, hkv, g = _check_fit(m, layer, q, scaling)
        param = next(m.parameters())
        qf = q.to(param.dtype).reshape(b, hkv, g, t, d).permute(0, 2, 3, 1, 4).reshape(b * g * t, hkv, d)
        A, a = m.predict(layer, qf)  # [b·g·t, hkv, d], [b·g·t, hkv]
        out = A.reshape(b, g, t, hkv, d).permute(0, 3, 1, 2, 4).reshape(b, hq, t, d)  # [b, hq, m, d]
        lse = a.reshape(b, g, t, hkv).permute(0, 3, 1, 2).reshape(b, hq, t)  # [b, hq, m]
        return AttnState(out.float(), lse.float())


class FusedModuleDocState:
    """Provider for inference: the module's fused form (``fused.py``), queries taken head-major.

    q [b, hq, m, d] is regrouped to [hkv, b·g·m, d] (query head h reads KV head h // g), a view when
    b = m = 1 as in single-request decoding. Not differentiable: a snapshot of the weights."""

    def __init__(self, module: NectarModule | FusedModule, dtype: torch.dtype | None = None,
                 keep_dequantized: bool = True):
        self.module = module if isinstance(module, FusedModule) else fuse_module(
            module, dtype, keep_dequantized=keep_dequantized)

    def __call__(self, layer: int, q: torch.Tensor, scaling: float) -> AttnState:
        m = self.module
        b, hq, t, d, hkv, g = _check_fit(m, layer, q, scaling)
        qh = q.reshape(b, hkv, g * t, d).transpose(0, 1).reshape(hkv, b * g * t, d)  # [hkv, b·g·m, d]
        A, a = m.predict(layer, qh)  # [hkv, b·g·m, d], [hkv, b·g·m]
        out = A.reshape(hkv, b, g * t, d).transpose(0, 1).reshape(b, hq, t, d)  # [b, hq, m, d]
        lse = a.reshape(hkv, b, g * t).transpose(0, 1).reshape(b, hq, t)  # [b, hq, m]
        return AttnState(out.float(), lse)


def inference_provider(module: NectarModule, dtype: torch.dtype | None = None,
                       keep_dequantized: bool = True) -> FusedModuleDocState:
    """The provider to decode with: the fused module (weights in ``dtype``, default the module's; a
    quantized module's floats kept beside its codes unless ``keep_dequantized`` is False)."""
    return FusedModuleDocState(module, dtype, keep_dequantized)


def group_queries(q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """Targets layout → module layout: q [T, Hq, d] → [T·g, Hkv, d] (query head h → KV head h // g)."""
    T, hq, d = q.shape
    g = hq // num_kv_heads
    return q.reshape(T, num_kv_heads, g, d).permute(0, 2, 1, 3).reshape(T * g, num_kv_heads, d)


def grouped_targets(data, layer: int, num_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One layer of captured targets (``data``: q [T, L, Hq, d], alpha [T, L, Hq], A [T, L, Hq, d]) in the
    module layout, float32: q [T·g, Hkv, d], α [T·g, Hkv], A [T·g, Hkv, d]."""
    q = group_queries(data.q[:, layer].float(), num_kv_heads)
    alpha = group_queries(data.alpha[:, layer].float().unsqueeze(-1), num_kv_heads).squeeze(-1)
    return q, alpha, group_queries(data.A[:, layer].float(), num_kv_heads)


def ungroup(x: torch.Tensor, num_q_heads: int) -> torch.Tensor:
    """Inverse of ``group_queries`` for [T·g, Hkv, …] → [T, Hq, …]."""
    hkv = x.shape[1]
    g = num_q_heads // hkv
    T = x.shape[0] // g
    rest = x.shape[2:]
    return x.reshape(T, g, hkv, *rest).transpose(1, 2).reshape(T, num_q_heads, *rest)
