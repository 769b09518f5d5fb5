"""What ``nectar compare`` is asked: the run directory it opens and the budgets it is given, with a one-line
error (``CompareInputError``) for anything it cannot work with.
"""
from __future__ import annotations

import math
from typing import Callable

from ..orchestration.context import RunContext, open_run
from ..orchestration.executor import RunDir
from ..tables import ArtifactError

ProgressFactory = Callable[[str], Callable[[int, int], None]]


class CompareInputError(ValueError):
    """A run directory, budget or system that ``nectar compare`` can't work with (one line)."""


KV_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def parse_bytes(text: str | None, kv_dtype: str) -> list[float]:
    """``--bytes 0.01,0.05``: budgets as fractions of the document KV's bytes at the model's KV dtype →
    the budgets ρ (shares of the float32 KV's bytes, what every system is sized by): the same at fp32,
    half at bf16 (a bf16 KV is half the bytes, so 5 % of it is 2.5 % of the float32 one)."""
    fractions = parse_rhos(text, "--bytes")
    return [f * KV_DTYPE_BYTES[kv_dtype] / 4 for f in fractions]


def parse_rhos(text: str | None, option: str = "--rho") -> list[float]:
    """``"0.02,0.05,0.10"`` → [0.02, 0.05, 0.1]; each a fraction of the document KV bytes in (0, 1)."""
    if text is None or not text.strip():
        return []
    out = []
    for item in text.split(","):
        item = item.strip()
        try:
            rho = float(item)
        except ValueError:
            raise CompareInputError(f"{option} {item!r} is not a number; give budgets as fractions of the document "
                                    f"KV cache, e.g. {option} 0.02,0.05,0.10") from None
        if not (0 < rho < 1) or math.isnan(rho):
            raise CompareInputError(f"{option} {item}: a budget is the state's share of the document KV cache bytes "
                                    "and must lie strictly between 0 and 1 (e.g. 0.05)")
        out.append(rho)
    return out


def check_ready(ctx: RunContext) -> None:
    """The run's data stages must have completed: compare trains and scores on its targets."""
    if ctx.stage_run("targets").read_manifest("targets") is None:
        raise CompareInputError(
            f"{ctx.run.root} has no completed targets stage; compare reuses the run's data stages (chunk → targets): "
            f"run `nectar run {ctx.info.source_uri} --run-dir {ctx.run.root}` first")


def open_for_compare(run_dir: str, progress: ProgressFactory | None = None) -> RunContext:
    """Reopen a run for comparison, with one-line errors for a folder that is not a usable run."""
    run = RunDir(run_dir)
    if not run.exists("run.json"):
        raise CompareInputError(f"{run_dir} is not a run directory (no run.json); make one with `nectar run DOC`")
    try:
        ctx = open_run(run_dir, progress) if progress else open_run(run_dir)
    except ArtifactError as exc:
        raise CompareInputError(f"{run_dir}: {exc}") from None
    check_ready(ctx)
    return ctx
