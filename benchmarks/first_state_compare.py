"""Issue 39, side by side: the run's first state and refined state against kvpress's KVzip+int4, in ONE
``nectar compare`` pass on the same machine, document and minutes — quality at 5 % and 1 % of the bytes
and the ``state_seconds`` of each (the first state's fit timed again inside this compare, beside the
press).

    python benchmarks/first_state_compare.py RUN_DIR --out /tmp/cmp            # --bytes 0.05,0.01

What ``nectar compare RUN --bytes 0.05,0.01 --systems none,full,recon_first@int4,kvpress:kvzip:int4
--out DIR`` does, with two cuts for a loaded 2-core machine: greedy agreement off
(``evaluate.agreement_max_samples=0``: teacher-forced KL is the measure) and ``recon_first@int4`` only
where the run has no first state of its own (the run's ρ is ``run:first`` itself).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    from nectar.comparison import open_for_compare, score_and_write
    from nectar.comparison import parse_bytes, plan_jobs, refresh_targets

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run_dir")
    ap.add_argument("--out", required=True)
    ap.add_argument("--bytes", default="0.05,0.01")
    args = ap.parse_args()
    load0, t0 = os.getloadavg(), time.perf_counter()
    ctx = open_for_compare(args.run_dir)
    evaluate = ctx.config.evaluate.model_copy(update={"agreement_max_samples": 0})
    ctx.config = ctx.config.model_copy(update={"evaluate": evaluate})
    refresh_targets(ctx)
    rhos = parse_bytes(args.bytes, ctx.config.model.dtype)
    jobs = plan_jobs(ctx, ["none", "full", "recon_first@int4", "kvpress:kvzip:int4"], rhos)
    run_rho = ctx.config.train.module.rho
    jobs = [j for j in jobs if not (j.system.name == "recon_first@int4" and j.rho == run_rho)]
    result = score_and_write(ctx, jobs, out=args.out)
    rows = [r.model_dump(include={"system", "rho", "split", "state_bytes", "state_seconds", "recovered_kl",
                                  "recovered_kl_ci_low", "recovered_kl_ci_high", "token_acc", "source"}) for r in result.rows]
    facts = {"wall_s": round(time.perf_counter() - t0, 1), "load_before": [round(x, 2) for x in load0],
             "load_after": [round(x, 2) for x in os.getloadavg()]}
    Path(args.out, "first_state_compare.json").write_text(json.dumps({"facts": facts, "rows": rows}, indent=1,
                                                                      default=str))
    print(result.markdown)
    print(json.dumps(facts))


if __name__ == "__main__":
    main()
