"""evict: per (layer, KV head), the exact KV of the p_ℓ document tokens that receive the most
attention mass from the training queries (offline H2O/SnapKV-style eviction; selection.py scores
the keys), p_ℓ from the layer's budget P_ℓ. Reads the document KV and the training queries."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..modules.builder import ModulePlan, NectarModule
from .frozen_init import FrozenInit, HeadSelection, pairs_per_layer, plan_bits, quadrature_plan, select_per_head
from .interface import FitInputs
from .selection import KeyScore


@dataclass(frozen=True)
class Evict(FrozenInit):
    score: KeyScore = "mean"  # how a key's attention mass is aggregated over the queries

    name = "evict"
    READS = frozenset({"doc_kv", "train_queries"})

    def plan(self, plan: ModulePlan, bits: int | None = None) -> ModulePlan:
        bits = plan_bits(plan, bits)
        return quadrature_plan(plan, pairs_per_layer(plan, False, bits), False, bits)

    def init_pairs(self, module: NectarModule, plan: ModulePlan, inputs: FitInputs) -> None:
        select_per_head(module, plan, inputs.doc_kv, self.queries(inputs), self.score, _kept)


def _kept(sel: HeadSelection, plan: ModulePlan) -> tuple[torch.Tensor, torch.Tensor, None]:
    return sel.keys[sel.idx], sel.values[sel.idx], None
