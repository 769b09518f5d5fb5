"""The MLP with data: recovered KL (test and probes) against the training query tokens, for the paper's
MLP under regression and under distillation and for `matching`, at one budget (docs/quality.md, "The
MLP with data"; issue 22, lever 5).

    python benchmarks/mlp_data_curve.py RUN_DIR [--tokens 1000,3000,10000,30000] [--passes 12]
        [--systems regression,matching,distill] [--distill-max 10000] [--rho 0.05] [--out docs/images]

RUN_DIR is a COPY of a completed cpu run (its targets stage is redone here, in place). Data: the run's
verified train pairs, then reconstruction spans (``targets.recon.capture=true``,
``targets.recon.passes=P``: P tilings of the document, nectar/queries/recon.py) — ``train.splits:
train+recon``. Each point trains on a nested subset: train pairs in a seeded order, then reconstruction
spans, whole pairs up to N query tokens (``train.max_query_tokens``). Every system is the `nectar
compare` system of that name (its preset regime at the cpu preset, float32 storage) with:

  token regimes (regression, matching): batch 64 tokens, samples = clamp(20·N, 20k, 60k) — 20 epochs
    at the small points, the preset's 60k-sample budget (≥ 2 epochs) from N = 3k;
  distill: batch 4 pairs, samples = max(240, 3 epochs of the subset's pairs) (the preset's 240 pairs).

Scoring is `nectar compare`'s (nectar.comparison.score_and_write: teacher-forced KL to the full
model on every test and probe pair, recovered = 1 − KL/KL_none, 95 % paired bootstrap over pairs),
without greedy agreement. The run's own default state (its evaluate stage's metrics on the same pairs)
is the flat reference line. Writes OUT/mlp-data-curve.{json,png}; points are appended as they finish,
so a stopped benchmark keeps what it measured.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

from nectar.comparison import score_and_write, train_missing
from nectar.comparison.inputs import check_ready
from nectar.comparison.jobs import Job
from nectar.comparison.variants import variant_for
from nectar.comparison.systems import SYSTEMS, trained_config
from nectar.evaluation.plots import data_curve
from nectar.orchestration.context import open_run
from nectar.orchestration.document_run import run_here
from nectar.schemas.artifacts import MetricsRow
from nectar.schemas.config import PipelineConfig
from nectar.tables import read_table
from nectar.targets.reader import TargetsData
from nectar.targets.store import targets_zarr_url

SPLITS = ("test", "probes")


def with_recon(config: PipelineConfig, passes: int) -> PipelineConfig:
    """The run's configuration capturing ``passes`` tilings of reconstruction spans as training data."""
    recon = config.targets.recon.model_copy(update={"capture": True, "passes": passes})
    evaluate = config.evaluate.model_copy(update={"splits": ("test",), "agreement_max_samples": 0})
    return config.model_copy(update={"targets": config.targets.model_copy(update={"recon": recon}),
                                     "evaluate": evaluate})


def point_config(ctx, system: str, rho: float, n_tokens: int, pairs_per_token: float,
                 max_samples: int) -> PipelineConfig:
    """``system``'s compare configuration, trained on the first ``n_tokens`` of train+recon."""
    cfg = trained_config(ctx.config, SYSTEMS[system], rho)
    t = cfg.train
    if t.lambda_kl == 0:  # token batches: 20 epochs at small N, at most max_samples
        update = {"batch_size": 64, "samples": min(max(20 * n_tokens, 20_000), max_samples)}
    else:  # pair batches of 4; the subset's pairs ≈ n_tokens / mean pair length
        pairs = max(1, round(n_tokens * pairs_per_token))
        update = {"batch_size": 4, "samples": max(240, 3 * pairs)}
    update.update(splits="train+recon", max_query_tokens=n_tokens, eval_every=10 ** 9, checkpoint_every=10 ** 9,
                  module=t.module.model_copy(update={"bits": 32}))
    return cfg.model_copy(update={"train": t.model_copy(update=update)})


def measure_data(ctx) -> dict:
    """Pairs and query tokens of the train and recon splits of the (re)captured targets."""
    data = TargetsData(targets_zarr_url(ctx.stage_run("targets").url("targets")))
    out = {s: {"pairs": int(len(data.pairs(s))), "tokens": data.pair_tokens(data.pairs(s))} for s in ("train", "recon")}
    data.close()
    return out


def default_reference(run_dir: str) -> dict:
    """The run's own state (its evaluate stage) on the same pairs: recovered KL per split."""
    rows = read_table(f"{run_dir}/evaluate/metrics.parquet", MetricsRow)
    return {r.split: {"recovered_kl": r.recovered_kl, "ci": [r.recovered_kl_ci_low, r.recovered_kl_ci_high],
                      "n_pairs": r.n_pairs, "n_tokens": r.n_tokens}
            for r in rows if r.model == "module" and r.split in SPLITS}


def point_job(ctx, system: str, n_tokens: int, rho: float, pairs_per_token: float, max_samples: int) -> Job:
    """One system trained on the first ``n_tokens`` (its variant run directory; cached when trained)."""
    config = point_config(ctx, system, rho, n_tokens, pairs_per_token, max_samples)
    name = f"{system}_n{n_tokens}"
    return Job(dataclasses.replace(SYSTEMS[system], name=name), rho, config, variant_for(ctx, name, config))


def point_rows(jobs: dict[str, tuple[str, int, Job]], rows) -> list[dict]:
    """The benchmark's points from compare's rows of the point jobs (test and probes)."""
    out = []
    for r in rows:
        if r.system not in jobs or r.split not in SPLITS:
            continue
        system, n, job = jobs[r.system]
        counts = job.ctx.run.read_manifest("train").counts
        out.append({"system": system, "n_target": n, "train_query_tokens": counts.get("train_query_tokens"),
                    "samples": counts.get("samples"), "steps": counts.get("steps"), "train_s": r.train_seconds,
                    "split": r.split, "n_pairs": r.n_pairs, "n_tokens": r.n_tokens, "recovered_kl": r.recovered_kl,
                    "ci": [r.recovered_kl_ci_low, r.recovered_kl_ci_high], "kl_to_full": r.kl_to_full,
                    "state_bytes": r.state_bytes, "peak_lr": job.config.train.peak_lr,
                    "batch_size": job.config.train.batch_size, "run": job.ctx.run.root})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run_dir")
    ap.add_argument("--tokens", default="1000,3000,10000,30000")
    ap.add_argument("--passes", type=int, default=12, help="reconstruction tilings captured (~2.5k tokens each)")
    ap.add_argument("--systems", default="regression,matching,distill", help="in this order, each over every N")
    ap.add_argument("--distill-max", type=int, default=10_000, help="distill only up to this N (146 tokens/s)")
    ap.add_argument("--max-samples", type=int, default=60_000, help="cap on token-regime samples per point")
    ap.add_argument("--train-until", default=None, help="HH:MM UTC: points not trained by then are left out")
    ap.add_argument("--rho", type=float, default=0.05)
    ap.add_argument("--out", default="docs/images")
    args = ap.parse_args()
    ctx = open_run(args.run_dir)  # its targets stage is redone (or resumed) here, then checked
    ctx.config = with_recon(ctx.config, args.passes)
    t0 = time.perf_counter()
    run_here(ctx, "targets", False)
    check_ready(ctx)
    data = measure_data(ctx)
    result = {"run": args.run_dir, "rho": args.rho, "passes": args.passes, "data": data,
              "targets_s": time.perf_counter() - t0, "default": default_reference(args.run_dir), "points": [],
              "skipped": []}
    print(f"data: {data} (targets {result['targets_s']:.0f}s)", flush=True)
    total = data["train"]["tokens"] + data["recon"]["tokens"]
    pairs_per_token = (data["train"]["pairs"] + data["recon"]["pairs"]) / total
    out = Path(args.out)
    # all trainings first (system by system, N growing; each cached in its variant directory, so a
    # benchmark stopped by the clock and re-run with the finished points only trains nothing), then
    # one scoring pass: none and full are scored once for every point
    jobs: dict[str, tuple[str, int, Job]] = {}
    for system in [s for s in args.systems.split(",") if s]:
        for n in [int(float(x)) for x in args.tokens.split(",") if x]:
            if system == "distill" and n > args.distill_max:
                continue
            job = point_job(ctx, system, min(n, total), args.rho, pairs_per_token, args.max_samples)
            if job.ctx.run.read_manifest("train") is None and args.train_until and \
                    time.strftime("%H:%M", time.gmtime()) >= args.train_until:
                result["skipped"].append(job.system.name)  # past the clock: not trained, not scored
                print(f"skipped {job.system.name}: past --train-until {args.train_until} UTC", flush=True)
                continue
            t1 = time.perf_counter()
            train_missing([job], run_here)
            jobs[job.system.name] = (system, n, job)
            print(f"trained {job.system.name} ({time.perf_counter() - t1:.0f}s here; "
                  f"{job.ctx.run.read_manifest('train').duration_s:.0f}s its train stage)", flush=True)
    ref = [Job(SYSTEMS["none"], None), Job(SYSTEMS["full"], None)]
    t1 = time.perf_counter()
    scored = score_and_write(ctx, ref + [j for _, _, j in jobs.values()])
    result["score_s"] = time.perf_counter() - t1
    result["points"] = point_rows(jobs, scored.rows)
    for r in result["points"]:
        print(f"{r['system']} N={r['n_target']}: {r['split']} recovered {100 * r['recovered_kl']:.1f} % "
              f"[{100 * r['ci'][0]:.1f}, {100 * r['ci'][1]:.1f}] ({r['train_query_tokens']} tokens, "
              f"{r['samples']} samples, train {r['train_s']:.0f}s)", flush=True)
    (out / "mlp-data-curve.json").write_text(json.dumps(result, indent=1))
    png = data_curve(result["points"], result["default"])
    if png:
        (out / "mlp-data-curve.png").write_bytes(png)

if __name__ == "__main__":
    main()
