"""attention_matching_kv: the β-free refit — keys selected as for evict, least-squares values with no
bias, and the SAME p in every layer (the plan's total over 2d per head and layer): plain KV of
m = p pseudo-tokens, which vLLM serves (nectar.vllm.state). Reads the document KV and the
training queries."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..modules.builder import ModulePlan, NectarModule
from .attention_matching import kept_mass
from .frozen_init import FrozenInit, HeadSelection, plan_bits, same_pairs_in_every_layer, select_per_head, stored_rows
from .interface import FitInputs
from .matching_fit import fit_values
from .selection import KeyScore


@dataclass(frozen=True)
class AttentionMatchingKV(FrozenInit):
    score: KeyScore = "mean"  # how a key's attention mass is aggregated over the queries

    name = "attention_matching_kv"
    READS = frozenset({"doc_kv", "train_queries"})

    def plan(self, plan: ModulePlan, bits: int | None = None) -> ModulePlan:
        head_bytes = 4 * sum(plan.budgets) // plan.num_layers
        return same_pairs_in_every_layer(plan, head_bytes, plan_bits(plan, bits))

    def init_pairs(self, module: NectarModule, plan: ModulePlan, inputs: FitInputs) -> None:
        select_per_head(module, plan, inputs.doc_kv, self.queries(inputs), self.score, _values_only)


def _values_only(sel: HeadSelection, plan: ModulePlan) -> tuple[torch.Tensor, torch.Tensor, None]:
    """β = 0 (plain KV, what vLLM serves): only the values are refit."""
    Wh, mass = kept_mass(sel, plan)
    p = sel.idx.numel()
    return Wh, stored_rows(plan)(fit_values(mass, torch.zeros(p), sel.A, sel.values[sel.idx]).float()), None
