"""How many refinement steps the end-to-end refinement needs: the panel's probes against the step count.

    python benchmarks/refine_steps.py --out /work/exp/steps-naming --documents naming --budgets 0.005 \
        --steps 25,50,100 --withheld 0

Each step count N is the state ``recon_first_refined<N>@int4`` — ``recon_first_refined@int4`` (the
``recon_refine`` method, nectar/states/recon_refine.py) with ``steps=N`` — registered here, opt-in, and
scored by benchmarks/document_panel.py's machinery (its cells and its cache) against
the first state's fit alone (``recon_first_fit@int4``, the Δ's reference); 200 steps is ``recon_first_refined@int4``
itself (and, where keys are scarce, the first state ``recon_first@int4``). Adam runs at a constant
rate in a seeded batch order, so an N-step state is the 200-step run's state after N steps: the curve is
one refinement seen at several lengths. The time each state took is in its cell's comparison table.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def register_steps(steps: list[int]) -> list[str]:
    """``recon_first_refined<N>@int4`` for each N: the registered refined state with N steps."""
    from nectar.comparison.systems import register_variant
    from nectar.states.recon_refine import REFINE_STEPS

    base = "recon_first_refined@int4"
    return [base if n == REFINE_STEPS else register_variant(base, f"recon_first_refined{n}@int4", f" ({n} steps)",
                                                             steps=n) for n in steps]


def main(argv: list[str] | None = None):
    import document_panel

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", default="25,50,100,200", help="step counts, each a state (200: the method's own)")
    args, rest = ap.parse_known_args(argv)
    states = ",".join(register_steps([int(s) for s in args.steps.split(",") if s]))
    return document_panel.main(rest + ["--states", states, "--references", "recon_first_fit@int4",
                                       "--reference", "recon_first_fit@int4"])


if __name__ == "__main__":
    main()
