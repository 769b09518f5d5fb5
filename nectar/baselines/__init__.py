"""Equal-bytes baselines: what else could live in the bytes of a module of budget ρ (docs/design.md §11).

Each is an exact-attention state over p stored (key, value) pairs per (layer, KV head) — optionally
with a log-mass bias β per pair — which is exactly a quadrature module (``nectar.modules.quadrature``):
a(q) = LSE(s·Wq + β), A(q) = softmax(s·Wq + β)ᵀZ. So every baseline is a ``NectarModule`` and runs
wherever a trained module runs (evaluate, ``nectar ask``, generation, the server), and its bytes are
counted the same way (every saved tensor).

  truncate            the exact KV of the first ⌊ρ·n⌋ context tokens in every layer: the document cut
                      to fit the budget, keeping its START (the chat template's header — the attention
                      sink — and the first part of the text)
  evict               per (layer, KV head), the exact KV of the p_ℓ document tokens that receive the
                      most attention mass from the training queries (offline H2O/SnapKV-style eviction)
  attention_matching  those same keys with a fitted log-mass bias β (NNLS) and least-squares values
                      (Zweiger et al. 2026); p_ℓ = P_ℓ / (2d + 1) so the biases fit in the budget
  attention_matching_kv  the β-free refit: keys selected as for evict, least-squares values with no
                      bias, and the SAME p in every layer (the plan's total over 2d per head and layer):
                      plain KV of m = p pseudo-tokens, which vLLM serves (nectar.serving.vllm_state)

p_ℓ follows the module plan's per-layer budgets P_ℓ (layer multipliers included), so a baseline and
a module of the same ρ store the same number of parameters (up to one pair of rounding per head);
``truncate`` keeps the same number of tokens in every layer (a cut document is the same in each).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

import torch

from ..attention.state import AttnState
from ..modules.builder import ModulePlan, NectarModule, build_module
from ..modules.provider import ModuleDocState
from .init import MAX_FIT_TOKENS, QueryTargets, init_quadrature, training_queries  # noqa: F401
from .selection import KeyScore

BaselineName = Literal["truncate", "evict", "attention_matching", "attention_matching_kv"]
BASELINES: tuple[str, ...] = ("truncate", "evict", "attention_matching", "attention_matching_kv")


@dataclass
class FittedBaseline:
    """A fitted baseline: callable as a document-state provider, with the bytes it stores."""

    name: str
    module: NectarModule
    plan: ModulePlan

    def __post_init__(self) -> None:
        self._provider = ModuleDocState(self.module)

    def __call__(self, layer: int, q: torch.Tensor, scaling: float) -> AttnState:
        return self._provider(layer, q, scaling)

    @property
    def nbytes(self) -> int:
        return self.module.nbytes()


def baseline_plan(name: str, plan: ModulePlan) -> ModulePlan:
    """The quadrature plan of baseline ``name`` in the budget of ``plan`` (any arch, same ρ)."""
    if name not in BASELINES:
        raise ValueError(f"unknown baseline {name!r}; choose one of {', '.join(BASELINES)}")
    d, n = plan.head_dim, plan.n_context
    if name == "truncate":
        p = max(1, min(n, round(plan.rho * n)))  # same tokens in every layer
        pairs = (p,) * plan.num_layers
    elif name == "attention_matching_kv":  # plain KV: one count for every layer, the plan's total bytes
        p = max(1, min(n, sum(plan.budgets) // (2 * d * plan.num_layers)))
        pairs = (p,) * plan.num_layers
    else:
        per_pair = 2 * d + (1 if name == "attention_matching" else 0)
        pairs = tuple(max(1, min(n, b // per_pair)) for b in plan.budgets)
    return dataclasses.replace(plan, arch="quadrature", quad_pairs=pairs, mlp_widths=(),
                               quad_bias=name == "attention_matching")


def fit_baseline(name: str, doc_kv, targets_url: str, plan: ModulePlan, seed: int = 0,
                 score: KeyScore = "mean", max_tokens: int | None = None) -> FittedBaseline:
    """Fit baseline ``name`` on the document KV and the targets' training queries (seconds)."""
    qplan = baseline_plan(name, plan)
    module = build_module(qplan)
    init = {"truncate": "first", "evict": "evict", "attention_matching": "attention_matching",
            "attention_matching_kv": "attention_matching_kv"}[name]
    data = None if init == "first" else training_queries(targets_url, seed, max_tokens or MAX_FIT_TOKENS)
    init_quadrature(module, qplan, init, doc_kv, data, score)
    return FittedBaseline(name, module.eval(), qplan)
