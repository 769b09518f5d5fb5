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
  kvzip               keys scored by reconstructing the document (max over its spans), one budget
                      across all layers and KV heads, sinks kept, optionally with the fitted β and
                      values (``fit_kvzip``, kvzip_baseline.py over kvzip.py; SelectionConfig switches each)
  attention_matching_kv  the β-free refit: keys selected as for evict, least-squares values with no
                      bias, and the SAME p in every layer (the plan's total over 2d per head and layer):
                      plain KV of m = p pseudo-tokens, which vLLM serves (nectar.serving.vllm_state)

p_ℓ follows the module plan's per-layer budgets P_ℓ (layer multipliers included), so a baseline and
a module of the same ρ store the same number of parameters (up to one pair of rounding per head);
``truncate`` keeps the same number of tokens in every layer (a cut document is the same in each).

Each method is one file behind one interface (interface.py: ``Baseline.plan``, ``Baseline.fit``,
``FittedBaseline.nbytes``); registry.py lists them. Adding a method is adding a file and a line there.
"""
from __future__ import annotations

from .init import MAX_FIT_TOKENS, QueryTargets, init_quadrature, training_queries
from .interface import Baseline, FitInputs, FittedBaseline
from .kvzip_baseline import fit_kvzip
from .registry import BASELINES, REGISTRY, baseline_plan, fit_baseline, get_baseline

__all__ = ["BASELINES", "MAX_FIT_TOKENS", "REGISTRY", "Baseline", "FitInputs", "FittedBaseline",
           "QueryTargets", "baseline_plan", "fit_baseline", "fit_kvzip", "get_baseline", "init_quadrature",
           "training_queries"]
