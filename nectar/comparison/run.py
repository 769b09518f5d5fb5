"""``nectar compare RUN_DIR``: every system at equal bytes, scored on the run's held-out pairs.

  0. data   the run's targets stage through the stage cache: a hit, or redone if stale
  1. plan   one job per (system, ρ); a trained job resolves to a run directory holding its train
            stage: the run itself when the settings are the run's, a variant that already trained
            the same settings (``nectar sweep``, an earlier compare), or a new variant directory
            ``RUN/sweep/<system>_rho-<ρ>/`` sharing the run's data stages (comparison/sweep.py)
  2. train  what is missing, through the train stage and its cache (a second compare trains nothing)
  3. fit    the baselines: state methods fitted at compare time (nectar.states, seconds)
  4. score  every provider on every held-out pair in one pass (evaluation/scoring.py: the full and
            no-document passes and the full model's continuations are shared by all systems), with
            one paired bootstrap over pairs per split; kvpress presses (``kvpress:<press>``) are
            scored on the same pairs in kvpress's own venv (nectar/kvpress/) and join the bootstrap;
            served states (``vllm:…``) through a vLLM server each, on the probes, over vLLM's top-k buckets
            (comparison/served_rows.py)
  5. write  RUN/compare/comparison.parquet (ComparisonRow), comparison.md, frontier.png, info.json
"""
from __future__ import annotations

import time
from typing import Any, Callable

from ..attention.exact import ExactDocState
from ..evaluation.questions import load_questions, with_questions
from ..evaluation.scoring import score_providers
from ..evaluation.selection import evaluated_splits, select_pairs, with_subset
from ..layout import build_layout
from ..orchestration.context import RunContext, load_base, load_run_doc_kv
from ..orchestration.document_run import RunOne, run_here
from ..orchestration.executor import now
from ..schemas.artifacts import TargetsPairRow
from ..tables import read_table
from ..targets.store import open_targets, targets_zarr_url
from .differences import differences_vs_kvpress, differences_vs_start
from .inputs import ProgressFactory, check_ready
from .jobs import Job, dims_of, plan_jobs, refresh_targets, train_missing
from .kvpress_rows import score_kvpress
from .obtain import Obtained, obtain
from .outputs import CompareResult, allocations, comparison_rows, write_outputs
from .served_rows import score_served
from .time_to_state import data_stage_seconds, prefill_seconds, state_seconds


# Pairs per teacher-forced forward and prompts per greedy batch: a decode step on CPU reads every weight
# once whatever the batch, so wider batches cut the agreement pass (a dozen systems × every prompt).
SCORE_BATCH, GEN_BATCH = 8, 16


def withheld_probe_ids(ctx: RunContext, targets_url: str) -> set[str]:
    """Held-out probes lying wholly in the units reconstruction leaves out (nectar/queries/recon.py)."""
    from ..schemas.artifacts import ProbeRow
    from ..queries.recon import withheld_probes

    tcfg = ctx.config.targets
    return withheld_probes(ctx.text, tcfg.recon, tcfg.probes, read_table(f"{targets_url}/probes.parquet", ProbeRow))


def score_and_write(ctx: RunContext, jobs: list[Job], progress: ProgressFactory | None = None,
                    timings: dict[str, float] | None = None, questions: str | None = None,
                    out: str | None = None) -> CompareResult:
    """Steps 3–5: fit the baselines, score every job's provider on the held-out pairs (and on the user's
    ``questions`` file, as the ``questions`` split), write the outputs (into ``out``, default RUN/compare)."""
    bar = progress or (lambda name: (lambda d, t: None))
    timings = dict(timings or {})
    cfg = ctx.config.evaluate
    base = load_base(ctx.config)
    layout = build_layout(base.tokenizer, ctx.text)
    doc_kv = load_run_doc_kv(ctx)
    dims = dims_of(ctx)
    t0 = time.perf_counter()
    fit_bar = bar("compare:fit")
    served_jobs = [j for j in jobs if j.system.kind == "served"]  # scored through vLLM, after the others
    jobs = [j for j in jobs if j.system.kind != "served"]
    obtained: dict[str, Obtained] = {}
    for i, job in enumerate(jobs):
        obtained[job.key] = obtain(job, ctx, base, doc_kv, dims)
        fit_bar(i + 1, len(jobs))
    timings["load_and_fit_s"] = time.perf_counter() - t0
    targets = ctx.stage_run("targets").url("targets")
    g, _ = open_targets(targets_zarr_url(targets))
    target_rows = read_table(f"{targets}/pairs.parquet", TargetsPairRow)
    sel = select_pairs(target_rows, g["token_ids"][:], cfg, evaluated_splits(target_rows, cfg))
    if any(o.reads_document for o in obtained.values()):  # what reconstruction saw vs what it did not
        sel = with_subset(sel, "probes", "probes_withheld", withheld_probe_ids(ctx, targets), cfg)
    notes: dict[str, Any] = {}
    if questions:  # reference answers cached in RUN/questions/<sha256[:16]>/, shared with the evaluate stage
        loaded = load_questions(questions, base, layout, ExactDocState(doc_kv), ctx.run.url("questions"), cfg,
                                bar("compare:questions"))
        sel = with_questions(sel, loaded.pairs, cfg)
        notes["questions"] = {"file": questions, **loaded.counts()}
    kv_jobs = [j for j in jobs if j.system.kind == "kvpress"]
    extra_sums: dict = {}
    t0 = time.perf_counter()
    ran = score_kvpress(ctx, base, layout.context_ids, doc_kv, sel.pairs, kv_jobs, obtained, extra_sums, notes, out)
    if kv_jobs:
        timings["kvpress_s"] = time.perf_counter() - t0
    jobs = [j for j in jobs if j.system.kind != "kvpress" or j in ran]
    providers = {"full": obtained["full"].provider if "full" in obtained else ExactDocState(doc_kv), "none": None,
                 **{k: o.provider for k, o in obtained.items()
                    if k not in ("full", "none") and k not in {j.key for j in kv_jobs}}}
    bars: dict[str, Callable[[int, int], None]] = {}

    def step(name: str, done: int, total: int) -> None:
        if name not in bars:
            bars[name] = bar(f"compare:{name}")
        bars[name](done, total)

    sums, quality = score_providers(base, layout.n, providers, sel, cfg, SCORE_BATCH, GEN_BATCH, step, timings,
                                    extra_sums)
    notes["differences"] = (differences_vs_kvpress(jobs, sums, sel, quality, cfg)
                            + differences_vs_start(jobs, sums, sel, quality, cfg))
    data_s, prefill_s = data_stage_seconds(ctx), prefill_seconds(base, layout.context_ids)
    for job in jobs:
        obtained[job.key].state_seconds = state_seconds(job, obtained[job.key], data_s, prefill_s)
    rows = comparison_rows(jobs, obtained, quality)
    t0 = time.perf_counter()
    rows += score_served(ctx, base, doc_kv, sel.pairs, served_jobs, notes)
    if served_jobs:
        timings["served_s"] = time.perf_counter() - t0
    timings["total_s"] = sum(v for k, v in timings.items() if k != "total_s")
    facts = {"run": ctx.run.root, "document": ctx.info.source_uri, "model": base.name, "n": layout.n,
             "kv_bytes": doc_kv.nbytes(), "kv_dtype": str(doc_kv.keys[0].dtype).removeprefix("torch."),
             "created_at": now()}
    return write_outputs(ctx.run, rows, facts, timings, notes, allocations(obtained), out)


def compare(ctx: RunContext, systems: list[str] | None = None, rhos: list[float] | None = None,
            run_one: RunOne = run_here, progress: ProgressFactory | None = None, questions: str | None = None,
            out: str | None = None) -> CompareResult:
    """Plan, train what is missing, score and write (into ``out``, or RUN/compare); ``run_one`` runs a
    stage (the Prefect flow's runs it as a subflow)."""
    check_ready(ctx)
    refresh_targets(ctx, run_one)
    jobs = plan_jobs(ctx, systems, rhos)
    t0 = time.perf_counter()
    train_missing(jobs, run_one, progress("compare:train") if progress else None)
    return score_and_write(ctx, jobs, progress, {"train_s": time.perf_counter() - t0}, questions, out)
