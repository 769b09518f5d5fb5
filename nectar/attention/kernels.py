"""torch's fused attention kernels that also return the log-sum-exp, behind device checks.

An attention *state* needs the lse as well as the output (docs/design.md §2); ``F.scaled_dot_product_attention``
returns only the output, so these call the aten kernels underneath it directly: the flash kernel on
CUDA (bf16/fp16) and torch's CPU flash kernel (any float dtype, optional mask).
"""
from __future__ import annotations

import torch

from .state import AttnState, attention_state


def flash_available(device: torch.device) -> bool:
    """The flash-attn package (CUDA only) is importable."""
    if device.type != "cuda":
        return False
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


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


def fused_state(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float,
                causal: bool = False, mask: torch.Tensor | None = None) -> AttnState:
    """(out, lse) of q [b, h, M, d] over k/v [b, h, n, d] (same head count) in one kernel.

    ``causal`` is top-left aligned, so only for M == n (no cached keys). ``mask`` (bool, True = visible,
    broadcastable to [b, h, M, n]) is supported on CPU only; CUDA's flash kernel takes none.
    """
    if q.device.type == "cuda":
        if mask is not None:
            raise ValueError("fused_state: the CUDA flash kernel takes no mask; use attention_state")
        if q.dtype not in HALF:  # the CUDA kernel computes in 16 bits: float32 takes the exact path
            return attention_state(q, k.to(q.dtype), v.to(q.dtype), scaling, causal_offset=0 if causal else None)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(
            q, k.to(q.dtype), v.to(q.dtype), 0.0, causal, False, scale=scaling)[:2]
    else:  # the CPU flash kernel agrees with the exact math to ~1e-6 in float32
        if mask is not None and mask.dtype == torch.bool:  # it takes an additive mask in q's dtype
            mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, float("-inf"))
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k.to(q.dtype), v.to(q.dtype), 0.0, causal, attn_mask=mask, scale=scaling)
    return AttnState(out.float(), lse.float())  # [b, h, M, d], [b, h, M]
