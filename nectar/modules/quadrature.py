"""The Quadrature family (paper §3.3; Cartridges): p learnable (W, Z) pairs per KV head.

    a(q) = LSE(s · W q),    A(q) = softmax(s · W q)ᵀ Z

i.e. attention over a small virtual KV cache. The score is closed-form from W, so the paper sets
λα = 0 for this family. W, Z start as the first p rows of each head's document keys/values, so
with p = n the module *is* the document's exact attention state.
"""
from __future__ import annotations

import torch
from torch import nn


class LayerQuadrature(nn.Module):
    def __init__(self, num_heads: int, pairs: int, head_dim: int, scaling: float,
                 keys: torch.Tensor | None = None, values: torch.Tensor | None = None,
                 gen: torch.Generator | None = None):
        super().__init__()
        self.scaling = float(scaling)
        if keys is not None and values is not None:
            if keys.shape[1] < pairs:
                raise ValueError(f"quadrature init needs {pairs} document rows, the KV has {keys.shape[1]}")
            W = keys[:, :pairs].detach().float().clone()  # [H, p, d]
            Z = values[:, :pairs].detach().float().clone()
        else:  # shapes only (e.g. before load_state_dict)
            W = torch.randn(num_heads, pairs, head_dim, generator=gen) / head_dim ** 0.5
            Z = torch.zeros(num_heads, pairs, head_dim)
        self.W = nn.Parameter(W)  # [H, p, d]
        self.Z = nn.Parameter(Z)  # [H, p, d]

    def forward(self, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [N, H, d] (raw rotated queries) → (A [N, H, d], a [N, H]) in raw units."""
        logits = torch.bmm(q.transpose(0, 1), self.W.transpose(1, 2)) * self.scaling  # [H, N, p]
        a = torch.logsumexp(logits, dim=-1).transpose(0, 1)  # [N, H]
        A = torch.bmm(torch.softmax(logits, dim=-1), self.Z).transpose(0, 1)  # [N, H, d]
        return A, a
