"""torch's fused attention kernels that also return the log-sum-exp, behind device checks.

An attention *state* needs the lse as well as the output (DESIGN.md §2); ``F.scaled_dot_product_attention``
returns only the output, so these call the aten kernels underneath it directly: the flash kernel on
CUDA (bf16/fp16) and torch's CPU flash kernel (any float dtype, optional mask).
"""
from __future__ import annotations

import torch

from .state import AttnState


def flash_available(device: torch.device) -> bool:
    """The flash-attn package (CUDA only) is importable."""
    if device.type != "cuda":
        return False
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


def fused_state(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float,
                causal: bool = False, mask: torch.Tensor | None = None) -> AttnState:
    """(out, lse) of q [b, h, M, d] over k/v [b, h, n, d] (same head count) in one kernel.

    ``causal`` is top-left aligned, so only for M == n (no cached keys). ``mask`` (bool, True = visible,
    broadcastable to [b, h, M, n]) is supported on CPU only; CUDA's flash kernel takes none.
    """
    if q.device.type == "cuda":
        if mask is not None:
            raise ValueError("fused_state: the CUDA flash kernel takes no mask; use attention_state")
        dtype = q.dtype if q.dtype in (torch.float16, torch.bfloat16) else torch.bfloat16
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(
            q.to(dtype), k.to(dtype), v.to(dtype), 0.0, causal, False, scale=scaling)[:2]
    else:  # the CPU flash kernel agrees with the exact math to ~1e-6 in float32
        if mask is not None and mask.dtype == torch.bool:  # it takes an additive mask in q's dtype
            mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, float("-inf"))
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k.to(q.dtype), v.to(q.dtype), 0.0, causal, attn_mask=mask, scale=scaling)
    return AttnState(out.float(), lse.float())  # [b, h, M, d], [b, h, M]
