"""``nectar compare``: every system at equal bytes on one run's held-out pairs (docs/design.md §11).

systems.py        the registry of systems (reference, trained regimes, closed-form methods, kvpress presses,
                  served states)
inputs.py         the run directory and budgets a compare is given, one-line errors
jobs.py           one job per (system, budget); the trained systems' train stages
variants.py       variant run directories (RUN/sweep/<name>/) sharing the parent's data stages
obtain.py         each job's state: reference, trained module, the run's own states, a fitted method
kvpress_rows.py   kvpress's presses scored in their own venv
served_rows.py    the run's state as vLLM serves it (vllm:…), scored through a vLLM server on the probes
time_to_state.py  seconds from the document to each usable state
differences.py    paired differences to the best press and to a refined state's start
outputs.py        comparison.parquet, comparison.md, info.json and the figures
table.py          the markdown
run.py            compare: plan → train what is missing → fit → score → write
compose.py        several runs' states composed, against their documents concatenated
sweep.py          grids over architectures, ρ and loss weights as variant runs
"""
from .inputs import CompareInputError, open_for_compare, parse_bytes, parse_rhos  # noqa: F401
from .jobs import plan_jobs, refresh_targets, train_missing, validate  # noqa: F401
from .outputs import CompareResult, compare_dir  # noqa: F401
from .run import compare, score_and_write  # noqa: F401
from .systems import SYSTEMS, System, register, resolve, trained_config  # noqa: F401
