"""Baselines that are a closed-form initialiser frozen (init.py: ``init_quadrature``): their layout
follows the module plan alone, and their fit reads the targets' training queries (or nothing).

Pairs per layer come from the plan's per-layer budgets P_ℓ (layer multipliers included), so a
baseline and a module of the same ρ store the same number of parameters, up to one pair of rounding
per head; ``quadrature_plan`` writes that layout as a quadrature ModulePlan.
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar

from ..modules.budget import pairs_in_bytes
from ..modules.builder import ModulePlan, build_module
from ..modules.stored import quantize_module_
from .init import MAX_FIT_TOKENS, init_quadrature, training_queries
from .interface import Baseline, FitInputs, FittedBaseline


def plan_bits(plan: ModulePlan, bits: int | None) -> int:
    return plan.bits if bits is None else bits


def pairs_per_layer(plan: ModulePlan, bias: bool, bits: int) -> tuple[int, ...]:
    """Pairs each layer's budget P_ℓ buys per head (4·P_ℓ bytes), at least 1 and at most n."""
    d, n, g = plan.head_dim, plan.n_context, plan.quant_group
    return tuple(max(1, min(n, pairs_in_bytes(4 * b, d, bias, bits, g))) for b in plan.budgets)


def same_pairs_in_every_layer(plan: ModulePlan, head_bytes: float, bits: int) -> ModulePlan:
    """Plain KV (no β) with the same count in every layer: the pairs ``head_bytes`` buy per head."""
    d, n = plan.head_dim, plan.n_context
    p = max(1, min(n, pairs_in_bytes(head_bytes, d, False, bits, plan.quant_group)))
    return quadrature_plan(plan, (p,) * plan.num_layers, False, bits)


def quadrature_plan(plan: ModulePlan, pairs: tuple[int, ...], bias: bool, bits: int) -> ModulePlan:
    """``plan`` as a quadrature module of ``pairs`` pairs per layer (with β when ``bias``) at ``bits``."""
    return dataclasses.replace(plan, arch="quadrature", quad_pairs=pairs, mlp_widths=(), quad_bias=bias, bits=bits)


class FrozenInit(Baseline):
    """A baseline whose state is ``init_quadrature(init)`` on its plan, stored quantized at its bits."""

    init: ClassVar[str]  # init_quadrature's name: first, evict, attention_matching, attention_matching_kv

    def fit(self, plan: ModulePlan, inputs: FitInputs) -> FittedBaseline:
        qplan = self.plan(plan, inputs.bits)
        module = build_module(qplan)
        data = None if self.init == "first" else training_queries(inputs.targets, inputs.seed,
                                                                    inputs.max_tokens or MAX_FIT_TOKENS)
        init_quadrature(module, qplan, self.init, inputs.doc_kv, data, inputs.score)
        return FittedBaseline(self.name, quantize_module_(module).eval(), qplan)
