"""Methods whose state is a closed-form initialiser of the module plan's layout, frozen: their plan
follows the module plan alone, their fit reads the targets' training queries (or nothing), and the
same code starts a trained module (``train.module.init``; the ``matching`` regime trains on from one).

Pairs per layer come from the plan's per-layer budgets P_ℓ (layer multipliers included), so a
method's state and a module of the same ρ store the same number of parameters, up to one pair of
rounding per head; ``quadrature_plan`` writes that layout as a quadrature ModulePlan.
``select_per_head`` is the loop the query-reading methods share: per (layer, KV head), the training
queries' attention over the document keys and the p top keys; each method fits its pairs from them.
"""
from __future__ import annotations

import dataclasses
from abc import abstractmethod
from dataclasses import dataclass
from typing import Callable

import torch

from ..modules.budget import pairs_in_bytes
from ..modules.builder import ModulePlan, NectarModule, build_module
from ..modules.provider import grouped_targets
from ..modules.stored import quantize_module_
from ..quantization import fake_quantize
from .interface import FitInputs, FittedState, StateMethod
from .selection import KeyScore, attention_probs, key_scores, top_keys
from .train_queries import MAX_FIT_TOKENS, QueryTargets, training_queries


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


def stored_rows(plan: ModulePlan) -> Callable[[torch.Tensor], torch.Tensor]:
    """Rows as ``plan`` stores them (quantized along the last dim at its bits)."""
    return lambda x: fake_quantize(x, plan.bits, plan.quant_group)


@dataclass(frozen=True)
class HeadSelection:
    """One (layer, KV head): its document KV, the training queries' attention and the p top keys."""

    keys: torch.Tensor  # [n, d]
    values: torch.Tensor  # [n, d]
    idx: torch.Tensor  # [p] the top keys, in document order
    probs: torch.Tensor  # [T·g, n] the queries' attention over the document keys
    q: torch.Tensor  # [T·g, d]
    alpha: torch.Tensor  # [T·g]
    A: torch.Tensor  # [T·g, d]


# one head's pairs from its selection: (W [p, d], Z [p, d], β [p] or None)
HeadFit = Callable[[HeadSelection, ModulePlan], tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]


@torch.no_grad()
def select_per_head(module: NectarModule, plan: ModulePlan, doc_kv, data: QueryTargets, score: KeyScore,
                    fit_head: HeadFit) -> None:
    """Set every quadrature layer's (W, Z, β) from ``fit_head`` on each (layer, KV head)'s selection."""
    hkv = plan.num_kv_heads
    for layer, net in enumerate(module.layers):
        keys = doc_kv.keys[layer].detach().float().cpu()  # [Hkv, n, d]
        values = doc_kv.values[layer].detach().float().cpu()
        p = plan.quad_pairs[layer]
        q, alpha, A = grouped_targets(data, layer, hkv)  # [T·g, Hkv, d], [T·g, Hkv], [T·g, Hkv, d]
        W, Z, B = [], [], []
        for h in range(hkv):
            probs = attention_probs(q[:, h], alpha[:, h], keys[h], plan.scaling)  # [T·g, n]
            idx = top_keys(key_scores(probs, score), p)  # [p]
            Wh, Zh, Bh = fit_head(HeadSelection(keys[h], values[h], idx, probs, q[:, h], alpha[:, h], A[:, h]), plan)
            W.append(Wh), Z.append(Zh), B.append(torch.zeros(p) if Bh is None else Bh)
        net.set_pairs(torch.stack(W), torch.stack(Z), torch.stack(B) if plan.quad_bias else None)


class FrozenInit(StateMethod):
    """A method whose state is its ``init_pairs`` on its own plan, stored quantized at its bits."""

    def fit(self, plan: ModulePlan, inputs: FitInputs) -> FittedState:
        qplan = self.plan(plan, inputs.bits)
        module = build_module(qplan)
        self.init_pairs(module, qplan, inputs)
        return FittedState(self.name, quantize_module_(module).eval(), qplan)

    def init(self, plan: ModulePlan, module: NectarModule, inputs: FitInputs) -> tuple[ModulePlan, NectarModule]:
        if plan.arch != "quadrature":
            raise ValueError(f"init {self.name!r} is for quadrature modules, not {plan.arch!r}")
        self.init_pairs(module, plan, inputs)
        return plan, module

    def queries(self, inputs: FitInputs) -> QueryTargets:
        """The training queries it reads (``train_queries``)."""
        if inputs.targets is None:
            raise ValueError(f"init {self.name!r} needs the training queries' targets")
        return training_queries(inputs.targets, inputs.seed, inputs.max_tokens or MAX_FIT_TOKENS)

    @abstractmethod
    def init_pairs(self, module: NectarModule, plan: ModulePlan, inputs: FitInputs) -> None:
        """Set every layer's (W, Z, β) of ``module`` (a quadrature module of ``plan``)."""
