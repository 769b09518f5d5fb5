"""Document-state methods: what can live in the bytes of a module of budget ρ (docs/design.md §11),
the product's own (``recon_fit``) and the methods it is compared with. One file per method, each one
``@dataclass(frozen=True)`` whose fields are its settings (interface.py); registry.py names them.

Each is an exact-attention state over p stored (key, value) pairs per (layer, KV head) — optionally
with a log-mass bias β per pair — which is exactly a quadrature module (``nectar.modules.quadrature``):
a(q) = LSE(s·Wq + β), A(q) = softmax(s·Wq + β)ᵀZ. So every state is a ``NectarModule`` and runs
wherever a trained module runs (evaluate, ``nectar ask``, generation, the server), and its bytes are
counted the same way (every saved tensor).

  recon_fit           the product's method (formerly ``kvzip``): keys scored by reconstructing the
                      document (max over its spans; KVzip's context reconstruction), one budget across
                      all layers and KV heads, sinks kept, then β and values fitted in closed form
                      (recon_fit.py over reconstruction.py; its fields switch each step)
  recon_mixed         recon_fit's keys with each (layer, KV head)'s pairs at int2 / int4 / int8 (the rest
                      evicted), chosen across the state by distortion removed per byte (recon_mixed.py;
                      stored as one module per precision: scored, not yet servable from one file)
  truncate            the exact KV of the first ⌊ρ·n⌋ context tokens in every layer: the document cut
                      to fit the budget, keeping its START (the chat template's header — the attention
                      sink — and the first part of the text)
  evict               per (layer, KV head), the exact KV of the p_ℓ document tokens that receive the
                      most attention mass from the training queries (offline H2O/SnapKV-style eviction)
  attention_matching  those same keys with a fitted log-mass bias β (NNLS) and least-squares values
                      (Zweiger et al. 2026); p_ℓ = P_ℓ / (2d + 1) so the biases fit in the budget
  attention_matching_kv  the β-free refit: keys selected as for evict, least-squares values with no
                      bias, and the SAME p in every layer (the plan's total over 2d per head and layer):
                      plain KV of m = p pseudo-tokens, which vLLM serves (nectar.vllm.state)
  kvpress:<press>     an adapter family: kvpress's presses (its KVzip, SnapKV, …), fitted and scored
                      in kvpress's own venv (kvpress_press.py over nectar/kvpress/)

p_ℓ follows the module plan's per-layer budgets P_ℓ (layer multipliers included), so a method's state
and a module of the same ρ store the same number of parameters (up to one pair of rounding per head);
``truncate`` keeps the same number of tokens in every layer (a cut document is the same in each).

Shared mechanics: selection.py (attention mass per key), matching_fit.py (Attention Matching's closed
form), train_queries.py (the training queries a method reads), frozen_init.py (layouts in a plan's
bytes, the per-head selection loop), reconstruction.py (recon_fit's capture, allocation, build).
"""
from __future__ import annotations

from .interface import FitInputs, FittedState, StateMethod
from .recon_fit import ReconFit, fit_recon
from .registry import (FROM_TARGETS, METHODS, fit_method, from_targets, get_method, init_method, method_plan,
                       register, unregister)
from .train_queries import MAX_FIT_TOKENS, QueryTargets, training_queries

__all__ = ["FROM_TARGETS", "MAX_FIT_TOKENS", "METHODS", "FitInputs", "FittedState", "QueryTargets", "ReconFit",
           "StateMethod", "fit_method", "fit_recon", "from_targets", "get_method", "init_method", "method_plan",
           "register", "training_queries", "unregister"]
