"""Paired differences of recovered KL: each system against the best kvpress press at its budget, and each
refined state against the closed-form state it starts from (the paired bootstrap over pairs,
nectar/evaluation/bootstrap.py).
"""
from __future__ import annotations

from typing import Any

from ..evaluation.quality import recovered_differences
from .jobs import Job


def differences_vs_kvpress(jobs: list[Job], sums: dict, sel, quality, cfg) -> list[dict[str, Any]]:
    """Each system's recovered KL minus the best kvpress press's at the same budget, on every split:
    the paired bootstrap of the gap on the same pairs (nectar/evaluation/bootstrap.py). The reference
    is the press with the highest recovered KL on that split at that ρ; none without kvpress rows."""
    return to_best_press([(j.key, j.rho, j.system.kind == "kvpress") for j in jobs], sums, sel, quality, cfg)


def to_best_press(items: list[tuple[str, float | None, bool]], sums: dict, sel, quality,
                  cfg) -> list[dict[str, Any]]:
    """``items``: (key, ρ, is a press) of every scored state. Per split and ρ, each non-press state
    against the press with the highest recovered KL there (what both compares report)."""
    out = []
    for split, idx in sel.split_index().items():
        if not len(idx) or split not in quality:
            continue
        pairs = []
        for rho in sorted({r for _, r, _ in items if r is not None}):
            presses = [k for k, r, press in items if press and r == rho]
            if not presses:
                continue
            ref = max(presses, key=lambda k: quality[split][k].recovered_kl.value)
            pairs += [(k, ref) for k, r, press in items if r == rho and not press]
        out += paired(sums, idx, split, pairs, cfg)
    return out


def differences_vs_start(jobs: list[Job], sums: dict, sel, quality, cfg) -> list[dict[str, Any]]:
    """Each refined state's recovered KL minus that of the closed-form state it starts from
    (``System.refines``), at the same budget and on the same pairs, when both are in the compare:
    what the gradient steps add."""
    keys = {(j.system.name, j.rho): j.key for j in jobs}
    pairs = [(j.key, keys[(j.system.refines, j.rho)]) for j in jobs
             if j.system.refines and (j.system.refines, j.rho) in keys]
    return [d for split, idx in sel.split_index().items() if len(idx) and split in quality
            for d in paired(sums, idx, split, pairs, cfg)]


def paired(sums: dict, idx, split: str, pairs: list[tuple[str, str]], cfg) -> list[dict[str, Any]]:
    out = []
    if pairs:
        split_sums = {k: s.take(idx) for k, s in sums.items()}
        for (a, b), est in recovered_differences(split_sums, pairs, split, cfg.bootstrap_resamples,
                                                 cfg.seed).items():
            out.append({"split": split, "system": a, "reference": b, "n_pairs": est.n_pairs,
                        "delta_recovered_kl": est.value, "low": est.low, "high": est.high})
    return out
