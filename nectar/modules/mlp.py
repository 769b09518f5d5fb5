"""The MLP family (paper §3.3, App. A.3): every KV head of a layer in one module.

Each of the backbone, score head and target head is an input-re-injecting MLP

    h_0 = SiLU(U_0 x + b_0),   h_{k+1} = SiLU(V_k q + U_k h_k + b_k),   y = W h_{D-1} + c

with every weight stacked over the H KV heads of the layer ([H, in, out]) and applied with one
batched matmul per matrix: no Python loop over heads. The output layer is affine (scores and targets are
signed). Outputs are in the *normalised* target space; ``NectarModule.predict`` maps them back.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .budget import MLPLayerShapes, SkipMLPShape


def _init_linear(num_heads: int, fan_in: int, fan_out: int, gen: torch.Generator,
                 gain: float = 1.0) -> nn.Parameter:
    std = gain / math.sqrt(fan_in)
    return nn.Parameter(torch.randn(num_heads, fan_in, fan_out, generator=gen) * std)  # [H, in, out]


class LayerMLP(nn.Module):
    """Score and target networks of all KV heads of one layer (parameters are [H, …] tensors)."""

    def __init__(self, num_heads: int, shapes: MLPLayerShapes, residual: bool, gen: torch.Generator):
        super().__init__()
        self.num_heads = num_heads
        self.shapes = shapes  # frozen dataclass of ints: the architecture, not a config
        self.residual = residual
        for prefix, shape in (("backbone", shapes.backbone), ("score", shapes.score),
                              ("target", shapes.target)):
            self._make(prefix, shape, gen)

    def _make(self, prefix: str, s: SkipMLPShape, gen: torch.Generator) -> None:
        H = self.num_heads
        if s.depth > 0:
            self.register_parameter(f"{prefix}_U0", _init_linear(H, s.in_dim, s.width, gen))
            self.register_parameter(f"{prefix}_b0", nn.Parameter(torch.zeros(H, s.width)))
            for k in range(1, s.depth):
                # q and h_k feed one pre-activation: scale both by the joint fan-in.
                fan = s.q_dim + s.width
                self.register_parameter(f"{prefix}_V{k}", _init_linear(H, s.q_dim, s.width, gen,
                                                                        math.sqrt(s.q_dim / fan)))
                self.register_parameter(f"{prefix}_U{k}", _init_linear(H, s.width, s.width, gen,
                                                                        math.sqrt(s.width / fan)))
                self.register_parameter(f"{prefix}_b{k}", nn.Parameter(torch.zeros(H, s.width)))
            if s.layer_norm:
                for k in range(s.depth):
                    self.register_parameter(f"{prefix}_ln{k}_g", nn.Parameter(torch.ones(H, s.width)))
                    self.register_parameter(f"{prefix}_ln{k}_b", nn.Parameter(torch.zeros(H, s.width)))
        if s.out_dim is not None:
            fan = s.width if s.depth > 0 else s.in_dim
            # Zero output layer: an untrained head predicts the (normalised) target mean.
            self.register_parameter(f"{prefix}_Wout", nn.Parameter(torch.zeros(H, fan, s.out_dim)))
            self.register_parameter(f"{prefix}_bout", nn.Parameter(torch.zeros(H, s.out_dim)))

    def _run(self, prefix: str, s: SkipMLPShape, x: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """x [H, N, in], q [H, N, d] → [H, N, out_features] (head-major: one bmm per matrix)."""
        p = self._parameters
        h = x
        for k in range(s.depth):
            if k == 0:
                pre = torch.baddbmm(p[f"{prefix}_b0"].unsqueeze(1), x, p[f"{prefix}_U0"])  # [H, N, w]
            else:
                pre = torch.baddbmm(p[f"{prefix}_b{k}"].unsqueeze(1), q, p[f"{prefix}_V{k}"])
                pre = torch.baddbmm(pre, h, p[f"{prefix}_U{k}"])  # + U_k h_k
            if s.layer_norm:
                pre = (F.layer_norm(pre, (s.width,)) * p[f"{prefix}_ln{k}_g"].unsqueeze(1)
                       + p[f"{prefix}_ln{k}_b"].unsqueeze(1))
            act = F.silu(pre)  # [H, N, w]
            h = h + act if (self.residual and k > 0) else act
        if s.out_dim is None:
            return h
        return torch.baddbmm(p[f"{prefix}_bout"].unsqueeze(1), h, p[f"{prefix}_Wout"])  # [H, N, out]

    def forward(self, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [N, H, d] (normalised) → (A [N, H, d], a [N, H]) in normalised target units."""
        s = self.shapes
        qh = q.transpose(0, 1)  # [H, N, d]
        h = self._run("backbone", s.backbone, qh, qh)  # [H, N, w_b] (or q itself when D_b = 0)
        a = self._run("score", s.score, h, qh).squeeze(-1).transpose(0, 1)  # [N, H]
        A = self._run("target", s.target, h, qh).transpose(0, 1)  # [N, H, d]
        return A, a
