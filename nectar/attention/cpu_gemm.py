"""The base model's linear layers through oneDNN while the decode engine runs on a CPU.

On the 2-core AMD EPYC machines this project runs on, MKL's float32 GEMM with a few rows is slow:
the LM head (49,152 × 576) takes 5× as long for 8 rows as for 1, where the weights it reads — the
whole cost of one row — are the same (docs/benchmarks.md "Serving"). oneDNN's linear kernel has no
such cliff, while MKL stays the faster one for a single row. So inside the engine a linear layer
with more than one row goes to oneDNN, one row to MKL (``F.linear``). Outside the engine (targets,
teacher-forced evaluation, training) nothing changes. The two kernels differ by float rounding only
(~1e-4 relative); greedy tokens of a row may therefore depend on the batch it decodes in, as they
already may through MKL's own row-count-dependent kernels.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

_LINEAR = getattr(getattr(torch.ops, "mkldnn", None), "_linear_pointwise", None)


def onednn_available() -> bool:
    """oneDNN's linear kernel is in this torch build."""
    return _LINEAR is not None and torch.backends.mkldnn.is_available()


def _dispatching_forward(linear: nn.Linear):
    weight, bias = linear.weight, linear.bias  # [out, in], [out] | None

    def forward(x: torch.Tensor) -> torch.Tensor:  # x [..., in]
        if x.dtype == torch.float32 and x.device.type == "cpu" and not x.requires_grad and x.numel() > x.shape[-1]:
            return _LINEAR(x, weight, bias, "none", [], "")  # [..., out]
        return F.linear(x, weight, bias)

    return forward


@contextmanager
def onednn_linears(model: nn.Module, enabled: bool = True) -> Iterator[int]:
    """Route ``model``'s float32 CPU linear layers with more than one row to oneDNN while inside;
    yields how many layers were routed (0 when disabled, not on a CPU, or without oneDNN)."""
    params = next(model.parameters(), None)
    if (not enabled or not onednn_available() or params is None or params.device.type != "cpu"
            or params.dtype != torch.float32):
        yield 0
        return
    linears = [m for m in model.modules() if isinstance(m, nn.Linear) and "forward" not in vars(m)]
    for m in linears:
        m.forward = _dispatching_forward(m)  # an instance attribute shadows nn.Linear.forward
    try:
        yield len(linears)
    finally:
        for m in linears:
            del m.forward
