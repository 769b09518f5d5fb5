"""``nectar compare``: every system at equal bytes on one run's held-out pairs (docs/design.md §11).

systems.py  the registry of systems (reference, trained regimes, closed-form baselines)
run.py      plan → train what is missing → fit baselines → score with paired intervals → write
table.py    the markdown table
sweep.py    grids over architectures, ρ and loss weights as child runs sharing the data stages
"""
from .run import (CompareInputError, CompareResult, compare, compare_dir, open_for_compare, parse_bytes, parse_rhos, plan_jobs,  # noqa: F401
                  refresh_targets, score_and_write, train_missing, validate)
from .systems import SYSTEMS, System, register, resolve, trained_config  # noqa: F401
