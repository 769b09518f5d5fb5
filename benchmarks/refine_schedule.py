"""Whether a decaying rate makes the first state's end-to-end steps worth more: the panel's probes and questions
for the first state refined at a cosine-decayed rate against the same steps at the constant rate.

    python benchmarks/refine_schedule.py --out /work/exp/cosine-gfdl13 --documents gfdl13 --budgets 0.005 \
        --withheld 0 --rates 0.002

Each peak rate R is the state ``recon_first_cos<R>@int4`` — ``recon_first@int4`` (the first state: its fit, its
steps per document length, nectar/states/recon_refine.py) with ``lr_schedule: cosine`` and ``lr: R`` — registered
here, opt-in, and scored by benchmarks/document_panel.py's machinery (its cells and its cache) against the first
state at its constant rate (``recon_first@int4``, the Δ's reference, reused from the folder's cache when a
panel of that document at that budget ran there) and KVzip+int4. The steps, the batches and their seeded order are
the first state's; only the rate at each step differs.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

BASE = "recon_first@int4"


def state_name(rate: float) -> str:
    return f"recon_first_cos{rate:g}@int4"


def register_rates(rates: list[float]) -> list[str]:
    """``recon_first_cos<R>@int4`` for each peak rate R: the first state with a cosine-decayed rate."""
    from nectar.comparison.systems import SYSTEMS, System, register

    base = SYSTEMS[BASE]
    names = []
    for rate in rates:
        name = state_name(rate)
        if name not in SYSTEMS:
            register(System(name, "method", f"{base.description}; the steps' rate warmed up to {rate:g} and "
                            "decayed to 0 by a cosine", method=base.method, bits=base.bits,
                            options={**base.options, "lr_schedule": "cosine", "lr": rate}, default=False))
        names.append(name)
    return names


def main(argv: list[str] | None = None):
    import document_panel

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rates", default="0.002", help="peak rates of the cosine schedule, each a state")
    ap.add_argument("--references", default=f"{BASE},kvpress:kvzip:int4",
                    help="what the states are compared with (the first is the Δ's reference)")
    args, rest = ap.parse_known_args(argv)
    states = ",".join(register_rates([float(r) for r in args.rates.split(",") if r]))
    refs = args.references
    return document_panel.main(rest + ["--states", states, "--references", refs, "--reference", refs.split(",")[0]])


if __name__ == "__main__":
    main()
