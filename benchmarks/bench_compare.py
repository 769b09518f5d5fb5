"""How long ``nectar compare`` takes on a run, and what dominates (issue 11: ≤ 20 min at one ρ on
the 2-core machine for the embedded default).

    python benchmarks/bench_compare.py RUN_DIR                 # as a user would: after `nectar run`
    python benchmarks/bench_compare.py RUN_DIR --cold          # nothing trained: a copy of the run's
                                                               # data stages only (every system trains)

``--cold`` copies the run's document, verified dataset and targets into a temporary run directory
(the run's own module and any variants are left behind), so every trained system is trained there.
The comparison itself runs in-process (``nectar.comparison.compare``, the steps the Prefect flow
runs, without the Prefect server). Printed: load average before/after, each phase's seconds, each
system's train/fit seconds, the scoring pass, and the verdict against the target.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nectar import comparison  # noqa: E402

TARGET_S = 20 * 60


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def cold_copy(run_dir: str, dest: str) -> str:
    """A run directory holding only the run's data stages (no train/evaluate/sweep/compare)."""
    src = Path(run_dir)
    for part in ("run.json", "document", "chunk", "synthesize", "verify", "targets"):
        p = src / part
        if p.is_dir():
            shutil.copytree(p, Path(dest) / part)
        elif p.exists():
            shutil.copy2(p, Path(dest) / part)
    return dest


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir")
    ap.add_argument("--rho", default=None, help="further budgets, e.g. 0.02,0.10 (the run's ρ is always in)")
    ap.add_argument("--systems", default=None, help="comma-separated subset (default: all)")
    ap.add_argument("--cold", action="store_true", help="train every system from scratch (a copy of the run)")
    args = ap.parse_args()

    import torch

    torch.set_num_threads(min(2, os.cpu_count() or 2))
    tmp = tempfile.mkdtemp(prefix="bench-compare-") if args.cold else None
    run_dir = cold_copy(args.run_dir, f"{tmp}/run") if tmp else args.run_dir
    systems = [s for s in args.systems.split(",") if s] if args.systems else None
    print(f"run={args.run_dir}{' (cold copy: ' + run_dir + ')' if tmp else ''} cpus={os.cpu_count()} "
          f"torch_threads={torch.get_num_threads()} load_before={_load()}", flush=True)
    t0 = time.perf_counter()
    ctx = comparison.open_for_compare(run_dir)
    res = comparison.compare(ctx, systems, comparison.parse_rhos(args.rho))
    wall = time.perf_counter() - t0
    print(f"load_after={_load()}")
    print("\nphase                                   seconds")
    for k, v in res.timings.items():
        print(f"{k:38s} {v:8.1f}")
    print("\nsystem                 rho   train/fit s   state MB")
    seen = set()
    for r in res.rows:
        if (r.system, r.rho) in seen:
            continue
        seen.add((r.system, r.rho))
        rho = "-" if r.rho is None else f"{r.rho:g}"
        sec = "-" if r.train_seconds is None else f"{r.train_seconds:.1f}"
        print(f"{r.system:20s} {rho:>5s} {sec:>13s} {r.state_bytes / 1e6:10.2f}")
    print(f"\nsplits: {', '.join(f'{s} {n} pairs' for s, n in sorted({(r.split, r.n_pairs) for r in res.rows}))}")
    verdict = "OK" if wall <= TARGET_S else "over"
    print(f"nectar compare wall: {wall:.1f} s (target <= {TARGET_S} s at one rho on 2 cores): {verdict}")
    print(f"table: {run_dir}/compare/comparison.md")
    if tmp:
        print(f"(the cold copy stays in {tmp} for inspection; remove it when done)")


if __name__ == "__main__":
    main()
