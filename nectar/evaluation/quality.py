"""Quality of document providers against the full-context model, with paired bootstrap intervals.

For one split: per-pair teacher-forced sums of every system (``teacher.teacher_forced_pair_sums``)
and, optionally, per-pair generation agreement (``agreement.py``) become, per system,

  token_acc, cross_entropy, kl_to_full     ratios of sums over the split's response tokens
  recovered_kl = 1 − KL_system / KL_none   the share of the document's effect the system keeps
                                           (0 = no document, 1 = the full document)
  agreement_exact / _rouge_l / _cosine     means over the prompts whose continuations were compared

each with a 95 % interval from ONE paired bootstrap over the split's pairs (every system and every
metric sees the same resampled pairs). ``columns()`` flattens them into the names the evaluate
metrics table and the comparison table share.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .agreement import AgreementScores
from .bootstrap import DEFAULT_RESAMPLES, NAN_ESTIMATE, Estimate, PairedBootstrap
from .teacher import PairSums

# metric name → the column prefix of its interval (the names: kl_ci_low, not kl_to_full_ci_low)
INTERVAL_PREFIX = {"token_acc": "token_acc", "cross_entropy": "cross_entropy", "kl_to_full": "kl",
                   "recovered_kl": "recovered_kl", "agreement_exact": "agreement_exact",
                   "agreement_rouge_l": "agreement_rouge_l", "agreement_cosine": "agreement_cosine"}


@dataclass(frozen=True)
class SystemQuality:
    n_pairs: int
    n_tokens: int
    token_acc: Estimate
    cross_entropy: Estimate
    kl_to_full: Estimate
    recovered_kl: Estimate
    agreement_exact: Estimate = NAN_ESTIMATE
    agreement_rouge_l: Estimate = NAN_ESTIMATE
    agreement_cosine: Estimate = NAN_ESTIMATE
    n_agreement: int = 0

    def columns(self) -> dict[str, float | int | None]:
        """Flat columns: ``<metric>`` and ``<prefix>_ci_low/_ci_high``; None where undefined."""
        out: dict[str, float | int | None] = {"n_pairs": self.n_pairs, "n_tokens": self.n_tokens,
                                              "n_agreement": self.n_agreement}
        for metric, prefix in INTERVAL_PREFIX.items():
            est: Estimate = getattr(self, metric)
            out[metric] = _finite(est.value)
            out[f"{prefix}_ci_low"] = _finite(est.low)
            out[f"{prefix}_ci_high"] = _finite(est.high)
        return out


def _finite(x: float) -> float | None:
    return None if x is None or math.isnan(x) else float(x)


def split_quality(
    sums: dict[str, PairSums],
    agreement: dict[str, AgreementScores] | None = None,
    split: str = "",
    resamples: int = DEFAULT_RESAMPLES,
    seed: int = 0,
    confidence: float = 0.95,
) -> dict[str, SystemQuality]:
    """{system: SystemQuality} for one split. ``sums`` holds every system's per-pair sums over the
    split's pairs (same pairs, same order) and must include ``none`` for ``recovered_kl``;
    ``agreement`` holds per-prompt scores over a (possibly smaller) sample of the split's pairs."""
    if not sums:
        return {}
    n_pairs = len(next(iter(sums.values())).n)
    boot = PairedBootstrap(n_pairs, resamples, seed, confidence, key=split)
    agree_boot = None
    if agreement:
        n_agree = len(next(iter(agreement.values())).rouge_l)
        agree_boot = PairedBootstrap(n_agree, resamples, seed, confidence, key=f"{split}/agreement")
    none = sums.get("none")
    out = {}
    for name, s in sums.items():
        if len(s.n) != n_pairs:
            raise ValueError(f"system {name!r} has sums for {len(s.n)} pairs, the others {n_pairs}")
        fields = dict(n_pairs=n_pairs, n_tokens=int(s.n.sum()), token_acc=boot.ratio(s.correct, s.n),
                      cross_entropy=boot.ratio(s.nll, s.n), kl_to_full=boot.ratio(s.kl, s.n),
                      recovered_kl=boot.recovered(s.kl, none.kl) if none is not None else NAN_ESTIMATE)
        a = (agreement or {}).get(name)
        if a is not None and agree_boot is not None:
            cosine = agree_boot.mean(a.cosine) if np.isfinite(a.cosine).all() else NAN_ESTIMATE
            fields.update(agreement_exact=agree_boot.mean(a.exact), agreement_rouge_l=agree_boot.mean(a.rouge_l),
                          agreement_cosine=cosine, n_agreement=len(a.rouge_l))
        out[name] = SystemQuality(**fields)
    return out


def recovered_differences(sums: dict[str, PairSums], pairs: list[tuple[str, str]], split: str = "",
                          resamples: int = DEFAULT_RESAMPLES, seed: int = 0, confidence: float = 0.95,
                          ) -> dict[tuple[str, str], Estimate]:
    """{(a, b): recovered_kl(a) − recovered_kl(b)} on one split's pairs, from the same resampling
    ``split_quality`` draws for that split (same seed and key), so the gap's interval is paired with
    the two systems' own intervals. ``sums`` must include ``none``."""
    if not pairs:
        return {}
    n_pairs = len(sums["none"].n)
    boot = PairedBootstrap(n_pairs, resamples, seed, confidence, key=split)
    return {(a, b): boot.recovered_difference(sums[a].kl, sums[b].kl, sums["none"].kl) for a, b in pairs}
