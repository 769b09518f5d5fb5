"""The baselines, one per file, by name. Adding a method is adding its file and one line here."""
from __future__ import annotations

from ..modules.builder import ModulePlan
from .attention_matching import AttentionMatching
from .attention_matching_kv import AttentionMatchingKV
from .evict import Evict
from .interface import Baseline, FitInputs, FittedBaseline
from .kvzip_baseline import KVzip
from .selection import KeyScore
from .truncate import Truncate

REGISTRY: dict[str, Baseline] = {b.name: b for b in (
    Truncate(),
    Evict(),
    AttentionMatching(),
    AttentionMatchingKV(),
    KVzip(),
)}
# fitted from the document KV and the targets alone (``fit_baseline``); the rest read the document
BASELINES: tuple[str, ...] = tuple(name for name, b in REGISTRY.items() if not b.reads_document)


def get_baseline(name: str) -> Baseline:
    if name not in REGISTRY:
        raise ValueError(f"unknown baseline {name!r}; choose one of {', '.join(REGISTRY)}")
    return REGISTRY[name]


def baseline_plan(name: str, plan: ModulePlan, bits: int | None = None) -> ModulePlan:
    """The quadrature plan of baseline ``name`` in the bytes of ``plan`` (any arch, same ρ), its pairs
    stored at ``bits`` (default the plan's): 4·P bytes per head buy ~7× more pairs at int4 than fp32."""
    return get_baseline(name).plan(plan, bits)


def fit_baseline(name: str, doc_kv, targets_url: str, plan: ModulePlan, seed: int = 0,
                 score: KeyScore = "mean", max_tokens: int | None = None, bits: int | None = None) -> FittedBaseline:
    """Fit baseline ``name`` on the document KV and the targets' training queries (seconds), stored
    at ``bits`` (default the plan's)."""
    baseline = get_baseline(name)
    if baseline.reads_document:
        raise ValueError(f"baseline {name!r} reads the document with the model: call "
                         f"REGISTRY[{name!r}].fit(plan, FitInputs(doc_kv, targets, base=…, layout=…, document=…, "
                         "spans=…, select=…))")
    return baseline.fit(plan, FitInputs(doc_kv, targets_url, seed=seed, bits=bits, score=score, max_tokens=max_tokens))
