"""Planning and building a NECTAR module from flat arguments.

``plan_module`` turns the budget rules into a ``ModulePlan`` (plain ints per layer, serialisable
into the spec); ``build_module`` turns a plan into a ``NectarModule``; ``build_from_config`` is the
one place a ``ModuleConfig`` is unpacked into flat arguments.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal

import torch
from torch import nn

from ..schemas.config import ModuleConfig
from .budget import (MLPLayerShapes, SkipMLPShape, head_budget, layer_rhos, mlp_layer_shapes,
                     quadrature_pairs, quantized_param_budget)
from .mlp import LayerMLP
from .quadrature import LayerQuadrature


@dataclass(frozen=True)
class ModulePlan:
    """Everything needed to rebuild a module's parameter shapes (stored in ModuleSpec.module_config)."""

    arch: Literal["mlp", "quadrature"]
    num_layers: int
    num_kv_heads: int
    head_dim: int
    n_context: int
    scaling: float
    rho: float
    layer_rhos: tuple[float, ...]
    budgets: tuple[int, ...]  # parameter budget per (layer, KV head)
    depths: tuple[int, int, int] = (0, 4, 4)
    residual: bool = False
    layer_norm: bool = False
    score_fraction: float = 0.1
    normalize_targets: bool = True
    mlp_widths: tuple[tuple[int, int, int], ...] = ()  # per layer (w_b, w_s, w_t)
    quad_pairs: tuple[int, ...] = ()  # per layer p
    quad_bias: bool = False  # quadrature: a log-mass bias β per pair (p = P / (2d + 1))
    bits: int = 32  # parameters stored at 32 (float32) or 8/4/2 bits per value (nectar/quantization.py)
    quant_group: int = 64  # values per fp16 (scale, zero) along each parameter's last dim
    # quadrature with heads of different widths (nectar/states/recon_fit.py): the real pairs of every
    # (layer, KV head); quad_pairs[ℓ] is then the widest head and the others' slots are masked (β = −inf)
    quad_head_pairs: tuple[tuple[int, ...], ...] = ()
    quad_bias_stored: bool = True  # False: β only masks those slots (exact KV kept), it stores nothing

    def mlp_shapes(self, layer: int) -> MLPLayerShapes:
        d, (d_b, d_s, d_t) = self.head_dim, self.depths
        w_b, w_s, w_t = self.mlp_widths[layer]
        ln = self.layer_norm
        backbone = SkipMLPShape(d, d, w_b, d_b, None, ln)
        h = backbone.out_features
        return MLPLayerShapes(backbone, SkipMLPShape(h, d, w_s, d_s, 1, ln),
                              SkipMLPShape(h, d, w_t, d_t, d, ln))

    def head_params(self, layer: int) -> int:
        """Exact parameter count of one (layer, KV head)."""
        if self.arch == "quadrature":
            return self.quad_pairs[layer] * (2 * self.head_dim + (1 if self.quad_bias else 0))
        return self.mlp_shapes(layer).n_params()

    def stored_params(self) -> int:
        """Parameters the state really holds: every head's own pairs (masked slots hold nothing)."""
        if self.arch == "quadrature" and self.quad_head_pairs:
            per_pair = 2 * self.head_dim + (1 if self.quad_bias and self.quad_bias_stored else 0)
            return per_pair * sum(sum(heads) for heads in self.quad_head_pairs)
        return self.num_kv_heads * sum(self.head_params(layer) for layer in range(self.num_layers))

    def to_dict(self) -> dict[str, Any]:
        """As plain data; the storage precision only when not float32 (plans saved before it existed
        read back the same, and their train-stage fingerprints stay valid)."""
        out = asdict(self)
        if self.bits == 32 and self.quant_group == 64:
            del out["bits"], out["quant_group"]
        if not self.quad_head_pairs and self.quad_bias_stored:  # likewise the per-head widths
            del out["quad_head_pairs"], out["quad_bias_stored"]
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ModulePlan":
        tup = {k: tuple(tuple(x) if isinstance(x, list) else x for x in v) if isinstance(v, list) else v
               for k, v in data.items()}
        return cls(**tup)


def plan_module(
    arch: Literal["mlp", "quadrature"],
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    n_context: int,
    scaling: float,
    rho: float,
    layer_multipliers: tuple[float, ...] = (1.0, 2.0, 5.0, 2.0),
    score_fraction: float = 0.1,
    depths: tuple[int, int, int] = (0, 4, 4),
    residual: bool = False,
    layer_norm: bool = False,
    normalize_targets: bool = True,
    quad_bias: bool = False,
    bits: int = 32,
    quant_group: int = 64,
) -> ModulePlan:
    rhos = layer_rhos(num_layers, rho, tuple(layer_multipliers))
    budgets = tuple(head_budget(r, n_context, head_dim) for r in rhos)
    common = dict(arch=arch, num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim,
                  n_context=n_context, scaling=float(scaling), rho=rho, layer_rhos=tuple(rhos),
                  budgets=budgets, depths=tuple(depths), residual=residual, layer_norm=layer_norm,
                  score_fraction=score_fraction, normalize_targets=normalize_targets, bits=bits,
                  quant_group=quant_group)
    if arch == "quadrature":
        pairs = tuple(quadrature_pairs(b, head_dim, n_context, i, quad_bias, bits, quant_group)
                      for i, b in enumerate(budgets))
        return ModulePlan(**common, quad_pairs=pairs, quad_bias=quad_bias)
    if arch != "mlp":
        raise ValueError(f"unknown module arch {arch!r}; use 'mlp' or 'quadrature'")
    widths = []
    for i, b in enumerate(budgets):
        b = quantized_param_budget(b, bits, quant_group)  # more, lower-precision parameters in the same bytes
        s = mlp_layer_shapes(b, head_dim, tuple(depths), score_fraction, layer_norm, i)
        widths.append((s.backbone.width, s.score.width, s.target.width))
    return ModulePlan(**common, mlp_widths=tuple(widths))


class NectarModule(nn.Module):
    """Score and target networks for every (layer, KV head), plus target normalisation.

    ``predict(layer, q)`` takes raw rotated queries and returns (A, a) in the original units: the
    MLP family works in normalised space (per-head statistics of the training targets, stored as
    buffers and saved with the weights); the quadrature family is closed-form in raw units.
    """

    def __init__(self, layers: list[nn.Module], num_kv_heads: int, head_dim: int, scaling: float,
                 closed_form: bool, bits: int = 32, quant_group: int = 64,
                 head_pairs: tuple[tuple[int, ...], ...] = (), bias_stored: bool = True):
        super().__init__()
        self.bits, self.quant_group = bits, quant_group  # storage precision of the parameters (modules/stored.py)
        # quadrature heads of different widths (ModulePlan.quad_head_pairs): each head's real pairs; the
        # slots past them are masked (β = −inf) and neither stored nor counted (modules/stored.py)
        self.head_pairs, self.bias_stored = tuple(tuple(h) for h in head_pairs), bias_stored
        self.layers = nn.ModuleList(layers)
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scaling = float(scaling)
        self.closed_form = closed_form
        L, H, d = len(layers), num_kv_heads, head_dim
        self.register_buffer("q_mean", torch.zeros(L, H, d))
        self.register_buffer("q_std", torch.ones(L, H))
        self.register_buffer("alpha_mean", torch.zeros(L, H))
        self.register_buffer("alpha_std", torch.ones(L, H))
        self.register_buffer("A_mean", torch.zeros(L, H, d))
        self.register_buffer("A_std", torch.ones(L, H))

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def set_normalization(self, stats: dict[str, torch.Tensor]) -> None:
        for name, value in stats.items():
            buf = getattr(self, name)
            if buf.shape != value.shape:
                raise ValueError(f"normalisation {name}: shape {tuple(value.shape)}, expected {tuple(buf.shape)}")
            buf.copy_(value)

    def predict(self, layer: int, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [N, H, d] → (A [N, H, d], a [N, H]) for KV heads H of ``layer``, original units."""
        net = self.layers[layer]
        if self.closed_form:
            return net(q)
        qn = (q - self.q_mean[layer]) / self.q_std[layer].unsqueeze(-1)  # [N, H, d]
        A_n, a_n = net(qn)
        A = A_n * self.A_std[layer].unsqueeze(-1) + self.A_mean[layer]  # [N, H, d]
        a = a_n * self.alpha_std[layer] + self.alpha_mean[layer]  # [N, H]
        return A, a

    def n_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


def build_module(plan: ModulePlan, doc_keys: list[torch.Tensor] | None = None,
                 doc_values: list[torch.Tensor] | None = None, seed: int = 0) -> NectarModule:
    """Instantiate a plan. Quadrature needs the document KV (per layer [Hkv, n, d]) to initialise
    from, unless the weights are about to be loaded from a file."""
    gen = torch.Generator().manual_seed(seed)
    layers: list[nn.Module] = []
    for i in range(plan.num_layers):
        if plan.arch == "quadrature":
            k = doc_keys[i].cpu() if doc_keys is not None else None
            v = doc_values[i].cpu() if doc_values is not None else None
            layers.append(LayerQuadrature(plan.num_kv_heads, plan.quad_pairs[i], plan.head_dim,
                                          plan.scaling, k, v, gen, bias=plan.quad_bias))
        else:
            layers.append(LayerMLP(plan.num_kv_heads, plan.mlp_shapes(i), plan.residual, gen))
    return NectarModule(layers, plan.num_kv_heads, plan.head_dim, plan.scaling,
                        closed_form=plan.arch == "quadrature", bits=plan.bits, quant_group=plan.quant_group,
                        head_pairs=plan.quad_head_pairs, bias_stored=plan.quad_bias_stored)


def plan_from_config(cfg: ModuleConfig, num_layers: int, num_kv_heads: int, head_dim: int,
                     n_context: int, scaling: float) -> ModulePlan:
    """Unpack a ModuleConfig into ``plan_module``'s flat arguments."""
    return plan_module(cfg.arch, num_layers, num_kv_heads, head_dim, n_context, scaling, cfg.rho,
                       tuple(cfg.layer_multipliers), cfg.score_fraction, tuple(cfg.depths),
                       cfg.residual, cfg.layer_norm, cfg.normalize_targets, cfg.bias, cfg.bits,
                       cfg.quant_group)
