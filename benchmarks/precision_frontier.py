"""Recovered KL against the bytes as stored, for the KV baselines at float32 / int8 / int4 and the run's
trained state: the frontier of docs/quality.md ("Equal bytes at any precision").

    python benchmarks/precision_frontier.py RUN_DIR [--bytes 0.005,0.01,0.02,0.05,0.1,0.2]
        [--splits probes] [--out DIR]
    python benchmarks/precision_frontier.py RUN_DIR --systems recon_fit@int4,recon_fit,kvpress:kvzip:int4,\
        kvpress:kvzip,evict@int4 --bytes 0.005,0.01,0.02,0.05,0.1,0.2 --no-state

Budgets are fractions of the document KV's bytes at the model's KV dtype (``--bytes`` of ``nectar
compare``). Every baseline system at every precision is fitted at every budget (Attention Matching's
fits use ``--am-bytes``: its p × p NNLS per head grows fast with int4's ~7× more keys); the run's own trained state is scored at its own ρ (the others would each need a
training run: ``nectar compare --systems matching@int4 --bytes …`` trains them). Scoring, intervals
and outputs are ``nectar compare``'s. ``--systems`` names any closed-form or kvpress systems instead
(each at every budget; a kvpress budget no precision can meet, int4 above ~14 %, leaves that row
out with the reason) (comparison.score_and_write), on the held-out splits asked for,
without the greedy-agreement pass. Writes OUT/comparison.{parquet,md}, frontier.png, info.json.
"""
from __future__ import annotations

import argparse
import shutil

from nectar.comparison import open_for_compare, parse_bytes, score_and_write
from nectar.comparison.jobs import Job
from nectar.comparison.systems import SYSTEMS, resolve


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run_dir")
    ap.add_argument("--bytes", default="0.005,0.01,0.02,0.05,0.1,0.2")
    ap.add_argument("--am-bytes", default="0.005,0.01,0.02,0.05",
                    help="budgets for attention_matching at every precision (its NNLS is p × p per head)")
    ap.add_argument("--baselines", default="evict,attention_matching")
    ap.add_argument("--systems", default="", help="closed-form / kvpress systems at every budget (replaces --baselines)")
    ap.add_argument("--no-state", action="store_true", help="leave out the run's own trained state")
    ap.add_argument("--splits", default="probes")
    ap.add_argument("--out", default=None, help="copy the compare/ outputs here")
    args = ap.parse_args()
    ctx = open_for_compare(args.run_dir)
    splits = tuple(s for s in args.splits.split(",") if s)
    # the held-out splits asked for (probes is added by the targets when it is not a configured split)
    evaluate = ctx.config.evaluate.model_copy(update={"splits": tuple(s for s in splits if s != "probes"),
                                                      "agreement_max_samples": 0})
    ctx.config = ctx.config.model_copy(update={"evaluate": evaluate})
    jobs = [Job(SYSTEMS["none"], None), Job(SYSTEMS["full"], None)]
    if not args.no_state:  # the run's own state (the cpu preset's matching)
        jobs.append(Job(SYSTEMS["matching"], ctx.config.train.module.rho, ctx.config, ctx))
    if args.systems:
        chosen = resolve([s for s in args.systems.split(",") if s])
        jobs += [Job(system, rho) for system in chosen if system.kind in ("method", "kvpress")
                 for rho in parse_bytes(args.bytes, ctx.config.model.dtype)]
    for name in [b for b in args.baselines.split(",") if b and not args.systems]:
        budgets = args.am_bytes if name == "attention_matching" else args.bytes
        for suffix in ("", "@int8", "@int4"):
            jobs += [Job(SYSTEMS[name + suffix], rho) for rho in parse_bytes(budgets, ctx.config.model.dtype)]
    result = score_and_write(ctx, jobs)
    print(result.markdown)
    if args.out:
        for f in result.files + (["frontier.png"] if "frontier.png" not in result.files else []):
            shutil.copy(ctx.run.local_path("compare", f), f"{args.out}/{f}")


if __name__ == "__main__":
    main()
