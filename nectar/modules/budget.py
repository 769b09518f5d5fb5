"""Parameter budgets (docs/design.md §6, paper App. A.4 "Capacity allocation").

ρ is a fraction of one KV head's document cache, 2·n·d entries, so a module at ρ has
ρ·2·n·d parameters per (layer, KV head). Layers are split into contiguous groups with multipliers
(default 1, 2, 5, 2), normalised so the mean ρ over layers stays the configured ρ.

MLP widths are solved from the budget: for a fixed depth the parameter count is a quadratic in
the width w, so w is the largest integer whose network still fits (the exact count is reported).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..quantization import quantized_nbytes, storage_bits


class BudgetError(ValueError):
    """A budget too small for the requested architecture (names the budget and the minimum)."""


def layer_groups(num_layers: int, num_groups: int) -> list[int]:
    """Group index of each layer: contiguous groups whose sizes differ by at most one."""
    base, extra = divmod(num_layers, num_groups)
    groups: list[int] = []
    for g in range(num_groups):
        groups += [g] * (base + (1 if g < extra else 0))
    return groups


def layer_rhos(num_layers: int, rho: float, multipliers: tuple[float, ...]) -> list[float]:
    """Per-layer ρ_ℓ = ρ · mult(group(ℓ)) / mean(mult over layers), so mean_ℓ ρ_ℓ = ρ."""
    if not multipliers or any(m <= 0 for m in multipliers):
        raise BudgetError(f"layer_multipliers must be positive, got {multipliers}")
    raw = [multipliers[g] for g in layer_groups(num_layers, len(multipliers))]
    scale = rho * num_layers / sum(raw)
    return [r * scale for r in raw]


def head_budget(rho_layer: float, n_context: int, head_dim: int) -> int:
    """Parameters one (layer, KV head) may use: ρ_ℓ · 2·n·d (floored)."""
    return int(math.floor(rho_layer * 2 * n_context * head_dim))


@dataclass(frozen=True)
class SkipMLPShape:
    """One input-re-injecting MLP (paper eq. mlp-backbone), the same for every head of a layer.

    depth = number of hidden layers (h_0 … h_{depth-1}); out_dim None = no output layer (backbone);
    depth 0 with an output = a single affine map of the input.
    """

    in_dim: int
    q_dim: int
    width: int
    depth: int
    out_dim: int | None
    layer_norm: bool = False

    @property
    def out_features(self) -> int:
        if self.out_dim is not None:
            return self.out_dim
        return self.width if self.depth > 0 else self.in_dim

    def n_params(self) -> int:
        return skip_mlp_params(self.in_dim, self.q_dim, self.width, self.depth, self.out_dim,
                               self.layer_norm)


def skip_mlp_params(in_dim: int, q_dim: int, width: int, depth: int, out_dim: int | None,
                    layer_norm: bool) -> int:
    if depth == 0:
        return 0 if out_dim is None else in_dim * out_dim + out_dim
    p = in_dim * width + width  # U_0, b_0
    p += (depth - 1) * (q_dim * width + width * width + width)  # V_k, U_k, b_k
    if layer_norm:
        p += depth * 2 * width  # gain and bias per hidden layer
    if out_dim is not None:
        p += width * out_dim + out_dim  # affine output layer
    return p


def solve_width(budget: int, in_dim: int, q_dim: int, depth: int, out_dim: int | None,
                layer_norm: bool, what: str) -> int:
    """Largest width w ≥ 1 whose network has at most ``budget`` parameters."""
    if depth == 0:
        return 0
    # params(w) = a·w² + b·w + c with a = depth-1 (hidden-to-hidden maps).
    a = depth - 1
    b = in_dim + 1 + (depth - 1) * (q_dim + 1) + (2 * depth if layer_norm else 0) + (out_dim or 0)
    c = (out_dim or 0) - budget
    w = -c / b if a == 0 else (-b + math.sqrt(b * b - 4 * a * c)) / (2 * a)
    w = max(1, int(math.floor(w)) + 1)
    # Float rounding: step down until it fits (exact integer check).
    while w > 1 and skip_mlp_params(in_dim, q_dim, w, depth, out_dim, layer_norm) > budget:
        w -= 1
    need = skip_mlp_params(in_dim, q_dim, 1, depth, out_dim, layer_norm)
    if need > budget:
        raise BudgetError(
            f"{what}: a depth-{depth} network needs at least {need} parameters per head (width 1) "
            f"but the budget is {budget}; raise train.module.rho, lower the depth, or use a "
            "longer document"
        )
    return w


@dataclass(frozen=True)
class MLPLayerShapes:
    backbone: SkipMLPShape
    score: SkipMLPShape
    target: SkipMLPShape

    def n_params(self) -> int:
        return self.backbone.n_params() + self.score.n_params() + self.target.n_params()


def quantized_param_budget(budget: int, bits: int, group: int = 64) -> int:
    """Parameters that fit the bytes of ``budget`` float32 parameters at ``bits`` per value plus an fp16
    scale and zero per ``group`` values (the MLP's weight rows are ≥ ``group`` wide at useful budgets;
    the exact stored bytes are counted from the tensors, ``NectarModule.stored_nbytes``)."""
    if bits == 32:
        return budget
    return int(4 * budget // (bits / 8 + 4 / group))


def mlp_layer_shapes(budget: int, head_dim: int, depths: tuple[int, int, int], score_fraction: float,
                     layer_norm: bool, layer: int) -> MLPLayerShapes:
    """Split a head's budget into backbone / score / target and solve each width.

    The backbone (if any) takes the share D_b / (D_b + D_s + D_t); the rest is split
    score_fraction : 1 - score_fraction between the score and target heads (paper App. D: 10/90).
    """
    d_b, d_s, d_t = depths
    if min(depths) < 0:
        raise BudgetError(f"module depths must be ≥ 0, got {depths}")
    if not 0.0 < score_fraction < 1.0:
        raise BudgetError(f"score_fraction must be in (0, 1), got {score_fraction}")
    backbone_budget = budget * d_b // max(1, d_b + d_s + d_t)
    w_b = solve_width(backbone_budget, head_dim, head_dim, d_b, None, layer_norm,
                      f"layer {layer} backbone") if d_b else 0
    backbone = SkipMLPShape(head_dim, head_dim, w_b, d_b, None, layer_norm)
    rest = budget - backbone.n_params()
    h_dim = backbone.out_features
    score_budget = int(rest * score_fraction)
    w_s = solve_width(score_budget, h_dim, head_dim, d_s, 1, layer_norm, f"layer {layer} score head")
    w_t = solve_width(rest - score_budget, h_dim, head_dim, d_t, head_dim, layer_norm,
                      f"layer {layer} target head")
    shapes = MLPLayerShapes(backbone, SkipMLPShape(h_dim, head_dim, w_s, d_s, 1, layer_norm),
                            SkipMLPShape(h_dim, head_dim, w_t, d_t, head_dim, layer_norm))
    if shapes.n_params() > budget:  # depth-0 heads are affine and can't shrink
        raise BudgetError(f"layer {layer}: the smallest ({d_b}, {d_s}, {d_t}) module has "
                          f"{shapes.n_params()} parameters per head, over the budget of {budget}")
    return shapes


def quadrature_head_bytes(pairs: int, head_dim: int, bias: bool, bits: int, group: int) -> int:
    """Stored bytes of one head's p pairs: W and Z [p, d] (quantized along d), β [p] if any."""
    wz = 2 * quantized_nbytes((pairs, head_dim), storage_bits((pairs, head_dim), bits, group), group)
    return wz + (quantized_nbytes((pairs,), storage_bits((pairs,), bits, group), group) if bias else 0)


def ragged_beta_bits(bits: int) -> int:
    """Storage bits of the β of a state whose heads differ in width (recon_fit's selection): float32 at
    32, bf16 below. β is one value a pair against 2d for (W, Z), so bf16 costs ~2 % of an int4 pair,
    while an int4 step over a log-mass range of ~30 (β down to log 1e-12) would scale masses by e."""
    return 32 if bits == 32 else 16


def ragged_pair_bytes(head_dim: int, bias_stored: bool, bits: int = 32, group: int = 64) -> int:
    """Stored bytes of one real pair of a state whose heads differ in width: its W and Z rows (each
    quantized along d on its own) and, when stored, its β (``ragged_beta_bits``). Exact: such a state
    stores every layer's real rows back to back (modules/stored.py), so its bytes are pairs × this."""
    row = quantized_nbytes((1, head_dim), storage_bits((1, head_dim), bits, group), group)
    return 2 * row + (ragged_beta_bits(bits) // 8 if bias_stored else 0)


def pairs_in_bytes(nbytes: float, head_dim: int, bias: bool, bits: int = 32, group: int = 64) -> int:
    """Most pairs (W, Z[, β]) of one head whose stored bytes fit ``nbytes`` (0 if not even one)."""
    per_pair = quadrature_head_bytes(1, head_dim, False, bits, group) + (bits / 8 if bias else 0)
    p = int(nbytes // per_pair)
    while p > 0 and quadrature_head_bytes(p, head_dim, bias, bits, group) > nbytes:
        p -= 1
    return p


def quadrature_pairs(budget: int, head_dim: int, n_context: int, layer: int, bias: bool = False,
                     bits: int = 32, group: int = 64) -> int:
    """p = P / (2d) pairs (W, Z) per head, or P / (2d + 1) with a log-mass bias β per pair; at least
    1 and at most n (they start as document rows). ``budget`` P counts float32 parameters, i.e. 4·P
    bytes: at ``bits`` < 32 p is the most pairs whose quantized bytes (codes, scales, zeros) fit 4·P."""
    per_pair = 2 * head_dim + (1 if bias else 0)
    p = pairs_in_bytes(4 * budget, head_dim, bias, bits, group)
    if p < 1:
        raise BudgetError(f"layer {layer}: a quadrature head needs at least {per_pair} parameters "
                          f"(one (W, Z) pair) but the budget is {budget}; raise train.module.rho")
    if p > n_context:
        raise BudgetError(f"layer {layer}: budget gives p={p} quadrature pairs, more than the "
                          f"document's n={n_context} tokens they are initialised from; lower rho "
                          "(per-layer rho above 1 exceeds the KV cache itself)")
    return p
