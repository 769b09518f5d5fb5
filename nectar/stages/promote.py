"""The promote stage: which of the run's two states answers — the first state (document alone,
nectar/stages/first.py) or the refined one (the train stage, fitted with the self-study questions too).
Pure function, no Prefect; the run directory's live pointer is the orchestration's (nectar/orchestration/live.py).

Both states are scored teacher-forced against the full-context model on the run's held-out pairs
(every test pair and held-out probe the targets stage cached, pooled), one shared full and
no-document pass. The refined state goes live only when it is BETTER: its recovered no-document KL
minus the first state's, with a paired bootstrap interval over pairs (the same resampled pairs for
both), has its lower bound above 0. A tie or a loss keeps the first state, and the decision says so.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..attention.doc_kv import DocKV
from ..attention.exact import ExactDocState
from ..base_model import BaseLM
from ..evaluation.bootstrap import PairedBootstrap
from ..evaluation.selection import select_pairs
from ..evaluation.teacher import teacher_forced_pair_sums
from ..modules.builder import NectarModule
from ..modules.provider import ModuleDocState
from ..schemas.artifacts import TargetsPairRow
from ..schemas.config import EvaluateConfig
from ..tables import read_table
from ..targets.store import open_targets, targets_zarr_url

HELD_OUT = ("test", "probes")


@dataclass(frozen=True)
class Decision:
    live: str  # "first" or "train"
    reason: str
    counts: dict


def held_out_pairs(targets_url: str, cfg: EvaluateConfig):
    """The EvalPairs of every held-out test pair and probe the targets hold (pooled)."""
    g, _ = open_targets(targets_zarr_url(targets_url))
    rows = read_table(f"{targets_url}/pairs.parquet", TargetsPairRow)
    splits = [s for s in HELD_OUT if any(r.split == s for r in rows)]
    return select_pairs(rows, g["token_ids"][:], cfg, splits).pairs


def decide(base: BaseLM, doc_kv: DocKV, first: NectarModule, refined: NectarModule, targets_url: str,
           cfg: EvaluateConfig, confidence: float, progress=None) -> Decision:
    """Score both states on the held-out pairs; the refined one goes live only when its recovered KL
    is higher with the paired interval of the difference above 0."""
    pairs = held_out_pairs(targets_url, cfg)
    if not pairs:
        return Decision("first", "no held-out pairs to compare on: the first state stays live",
                        {"held_out_pairs": 0})
    providers = {"full": ExactDocState(doc_kv), "none": None, "first": ModuleDocState(first),
                 "train": ModuleDocState(refined)}
    sums = teacher_forced_pair_sums(base, providers, pairs, doc_kv.n, progress=progress)
    boot = PairedBootstrap(len(pairs), cfg.bootstrap_resamples, cfg.seed, confidence, key="promote")
    rec = {name: boot.recovered(sums[name].kl, sums["none"].kl) for name in ("first", "train")}
    delta = boot.recovered_difference(sums["train"].kl, sums["first"].kl, sums["none"].kl)  # train − first
    counts = {"held_out_pairs": len(pairs), "held_out_tokens": int(sums["full"].n.sum()),
              "recovered_first": round(rec["first"].value, 5), "recovered_train": round(rec["train"].value, 5),
              "delta": round(delta.value, 5), "delta_low": round(delta.low, 5), "delta_high": round(delta.high, 5),
              "confidence": confidence}
    shown = f"Δ recovered KL (refined − first) {delta.fmt(2, 100)} points over {len(pairs)} held-out pairs"
    if delta.low > 0:
        return Decision("train", f"the refined state is better: {shown}", counts)
    verdict = "not better (the interval includes 0)" if delta.high >= 0 else "worse"
    return Decision("first", f"the refined state is {verdict}: {shown}; the first state stays live", counts)
