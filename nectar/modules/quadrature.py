"""The Quadrature family (paper §3.3; Cartridges): p learnable (W, Z) pairs per KV head.

    a(q) = LSE(s · W q + β),    A(q) = softmax(s · W q + β)ᵀ Z

i.e. attention over a small virtual KV cache. β is an optional per-pair log-mass bias (Attention
Matching's β, Zweiger et al. 2026): one stored key can then stand for many document keys, so a
compacted cache with biases is this same state form. Without β it is the paper's quadrature. The
score is closed-form from (W, β), so the paper sets λα = 0 for this family. W, Z start as p rows of
each head's document keys/values (or a closed-form fit, ``nectar.states``), so with p = n and
β = 0 the module *is* the document's exact attention state.
"""
from __future__ import annotations

import torch
from torch import nn


class LayerQuadrature(nn.Module):
    def __init__(self, num_heads: int, pairs: int, head_dim: int, scaling: float,
                 keys: torch.Tensor | None = None, values: torch.Tensor | None = None,
                 gen: torch.Generator | None = None, bias: bool = False):
        super().__init__()
        self.scaling = float(scaling)
        if keys is not None and values is not None:
            if keys.shape[1] < pairs:
                raise ValueError(f"quadrature init needs {pairs} document rows, the KV has {keys.shape[1]}")
            W = keys[:, :pairs].detach().float().clone()  # [H, p, d]
            Z = values[:, :pairs].detach().float().clone()
        else:  # shapes only (e.g. before load_state_dict or set_pairs)
            W = torch.randn(num_heads, pairs, head_dim, generator=gen) / head_dim ** 0.5
            Z = torch.zeros(num_heads, pairs, head_dim)
        self.W = nn.Parameter(W)  # [H, p, d]
        self.Z = nn.Parameter(Z)  # [H, p, d]
        # Registered only with a bias, so modules saved without one load unchanged.
        self.beta = nn.Parameter(torch.zeros(num_heads, pairs)) if bias else None  # [H, p]

    @torch.no_grad()
    def set_pairs(self, W: torch.Tensor, Z: torch.Tensor, beta: torch.Tensor | None = None) -> None:
        """Replace the pairs (W, Z [H, p, d], β [H, p]) with a fitted set of the same shapes."""
        self.W.copy_(W)
        self.Z.copy_(Z)
        if beta is not None:
            if self.beta is None:
                raise ValueError("this quadrature layer has no bias; build it with bias=True")
            self.beta.copy_(beta)

    def forward(self, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [N, H, d] (raw rotated queries) → (A [N, H, d], a [N, H]) in raw units."""
        logits = torch.bmm(q.transpose(0, 1), self.W.transpose(1, 2)) * self.scaling  # [H, N, p]
        if self.beta is not None:
            logits = logits + self.beta.unsqueeze(1)  # [H, N, p]
        a = torch.logsumexp(logits, dim=-1).transpose(0, 1)  # [N, H]
        A = torch.bmm(torch.softmax(logits, dim=-1), self.Z).transpose(0, 1)  # [N, H, d]
        return A, a
