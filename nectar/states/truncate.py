"""truncate: the exact KV of the first ⌊ρ·n⌋ context tokens in every layer — the document cut to fit
the budget, keeping its START (the chat template's header — the attention sink — and the first part
of the text). The same tokens in every layer (a cut document is the same in each), so the count is
the mean per-head bytes 4·ρ·2nd of the float32 KV, not the per-layer budgets. Reads the document KV
alone. (A trained module's ``init: first`` starts from the same rows: nectar/modules/builder.py.)"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..modules.builder import ModulePlan, NectarModule
from .frozen_init import FrozenInit, plan_bits, same_pairs_in_every_layer
from .interface import FitInputs


@dataclass(frozen=True)
class Truncate(FrozenInit):
    name = "truncate"

    def plan(self, plan: ModulePlan, bits: int | None = None) -> ModulePlan:
        head_bytes = 4 * plan.rho * plan.n_context * 2 * plan.head_dim * (1 + 1e-9)
        return same_pairs_in_every_layer(plan, head_bytes, plan_bits(plan, bits))

    @torch.no_grad()
    def init_pairs(self, module: NectarModule, plan: ModulePlan, inputs: FitInputs) -> None:
        hkv = plan.num_kv_heads
        for layer, net in enumerate(module.layers):
            keys = inputs.doc_kv.keys[layer].detach().float().cpu()  # [Hkv, n, d]
            values = inputs.doc_kv.values[layer].detach().float().cpu()
            p = plan.quad_pairs[layer]
            net.set_pairs(keys[:, :p], values[:, :p], torch.zeros(hkv, p) if plan.quad_bias else None)
