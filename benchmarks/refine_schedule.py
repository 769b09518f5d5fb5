"""Whether another rate makes the first state's end-to-end steps worth more: the panel's probes and questions
for the first state refined at other rates (a cosine decay, a higher constant) against its own steps.

    python benchmarks/refine_schedule.py --out /work/exp/rates-gfdl13 --documents gfdl13 --budgets 0.005 \
        --withheld 0 --variants cosine:0.002,constant:0.002

Each variant SCHEDULE:R is a state — ``recon_first_cos<R>@int4`` for a cosine decay from the peak R,
``recon_first_lr<R>@int4`` for the constant rate R: ``recon_first@int4`` (the first state: its fit, its steps per
document length, nectar/states/recon_refine.py) with that ``lr_schedule`` and ``lr`` — registered here, opt-in,
and scored by benchmarks/document_panel.py's machinery (its cells and its cache) against the first state at its
constant rate (``recon_first@int4``, the Δ's reference, reused from the folder's cache when a panel of that
document at that budget ran there) and KVzip+int4. The steps, the batches and their seeded order are
the first state's; only the rate at each step differs.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

BASE = "recon_first@int4"
PREFIX = {"cosine": "cos", "constant": "lr"}
HOW = {"cosine": "warmed up to {r:g} and decayed to 0 by a cosine", "constant": "{r:g} at every step"}


def parse_variants(text: str) -> list[tuple[str, float]]:
    """``cosine:0.002,constant:0.002`` → [("cosine", 0.002), ("constant", 0.002)]."""
    out = []
    for item in (x for x in text.split(",") if x):
        schedule, _, rate = item.partition(":")
        if schedule not in PREFIX or not rate:
            raise SystemExit(f"--variants {item!r}: expected SCHEDULE:RATE with SCHEDULE one of "
                             f"{', '.join(PREFIX)} (e.g. cosine:0.002)")
        out.append((schedule, float(rate)))
    return out


def state_name(schedule: str, rate: float) -> str:
    return f"recon_first_{PREFIX[schedule]}{rate:g}@int4"


def register_variants(variants: list[tuple[str, float]]) -> list[str]:
    """A registered state for each (schedule, rate): the first state with its steps taken at that rate."""
    from nectar.comparison.systems import register_variant

    return [register_variant(BASE, state_name(schedule, rate), f"; the steps' rate {HOW[schedule].format(r=rate)}",
                             lr_schedule=schedule, lr=rate) for schedule, rate in variants]


def main(argv: list[str] | None = None):
    import document_panel

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--variants", default="cosine:0.002", help="SCHEDULE:RATE,… (cosine or constant), each a state")
    ap.add_argument("--references", default=f"{BASE},kvpress:kvzip:int4",
                    help="what the states are compared with (the first is the Δ's reference)")
    args, rest = ap.parse_known_args(argv)
    states = ",".join(register_variants(parse_variants(args.variants)))
    refs = args.references
    return document_panel.main(rest + ["--states", states, "--references", refs, "--reference", refs.split(",")[0]])


if __name__ == "__main__":
    main()
