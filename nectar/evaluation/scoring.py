"""Score any set of document providers on a selection of cached pairs, with paired intervals.

The one path the evaluate stage (module / full / none) and ``nectar compare`` (a dozen systems at
several budgets) share: teacher-forced per-pair sums with the full-context pass computed once per
batch, greedy continuations with the full model's generated once, then per split one paired
bootstrap over its pairs (``quality.split_quality``).
"""
from __future__ import annotations

import time
from typing import Callable

from ..base_model import BaseLM, embedder_path
from ..schemas.config import EvaluateConfig
from .agreement import agreement_scores, greedy_continuations, sentence_embedder
from .quality import SystemQuality, split_quality
from .selection import Selection
from .teacher import PairSums, teacher_forced_pair_sums

Step = Callable[[str, int, int], None]  # (step, done, total)


def agreement_continuations(base: BaseLM, n: int, providers: dict, sel: Selection, cfg: EvaluateConfig,
                            batch_size: int = 8, progress: Callable[[int, int], None] | None = None,
                            ) -> dict[str, dict[str, list[int]]]:
    """{system: {pair_id: greedy tokens}} for every pair of an agreement sample (each pair once,
    whatever its splits); the prompt is the pair's query up to its response."""
    wanted = sorted({pid for ids in sel.agreement.values() for pid in ids})
    if not wanted:
        return {}
    by_id = {p.pair_id: p for p in sel.pairs}
    prompts = [by_id[pid].ids[: by_id[pid].response_start] for pid in wanted]
    cont = greedy_continuations(base, n, providers, prompts, cfg.agreement_new_tokens, batch_size, progress)
    return {name: dict(zip(wanted, toks)) for name, toks in cont.items()}


def quality_by_split(sel: Selection, sums: dict[str, PairSums], continuations: dict[str, dict[str, list[int]]],
                     decode: Callable[[list[int]], str], embed, cfg: EvaluateConfig,
                     ) -> dict[str, dict[str, SystemQuality]]:
    """{split: {system: SystemQuality}} from per-pair sums over ``sel.pairs`` and the greedy
    continuations (the full model's under "full"); splits without pairs are left out."""
    out = {}
    for split, idx in sel.split_index().items():
        if not len(idx):
            continue
        agree = None
        ids = sel.agreement.get(split, [])
        if ids and continuations:
            ref = [continuations["full"][pid] for pid in ids]
            agree = {name: agreement_scores(decode, ref, [c[pid] for pid in ids], embed)
                     for name, c in continuations.items()}
        out[split] = split_quality({name: s.take(idx) for name, s in sums.items()}, agree, split,
                                   cfg.bootstrap_resamples, cfg.seed)
    return out


def score_providers(base: BaseLM, n: int, providers: dict[str, Callable | None], sel: Selection,
                    cfg: EvaluateConfig, batch_size: int = 4, gen_batch_size: int = 8,
                    step: Step | None = None, timings: dict[str, float] | None = None,
                    ) -> tuple[dict[str, PairSums], dict[str, dict[str, SystemQuality]]]:
    """Per-pair sums of every provider (must include "full" and "none") and their quality per split.
    ``timings`` (when given) receives the seconds of each phase."""
    step = step or (lambda *_: None)
    timings = {} if timings is None else timings
    t0 = time.perf_counter()
    sums = teacher_forced_pair_sums(base, providers, sel.pairs, n, batch_size,
                                    lambda d, t: step("teacher_forced", d, t))
    t1 = time.perf_counter()
    continuations = agreement_continuations(base, n, providers, sel, cfg, gen_batch_size,
                                            lambda d, t: step("agreement", d, t))
    t2 = time.perf_counter()
    embed = sentence_embedder(embedder_path(cfg.embedder)) if continuations else None
    decode = lambda ids: base.tokenizer.decode(ids, skip_special_tokens=True).strip()  # noqa: E731
    quality = quality_by_split(sel, sums, continuations, decode, embed, cfg)
    timings.update(teacher_forced_s=t1 - t0, agreement_generation_s=t2 - t1,
                   agreement_scoring_and_bootstrap_s=time.perf_counter() - t2)
    return sums, quality
