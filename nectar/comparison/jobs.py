"""What a comparison will run: one job per (system, budget), checked before anything is written, and the
trained systems' train stages run through the stage cache.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from ..modules.budget import BudgetError
from ..modules.builder import ModulePlan, plan_from_config
from ..orchestration.context import RunContext
from ..orchestration.document_run import RunOne, run_here
from ..schemas.config import PipelineConfig
from ..schemas.presets import ConfigError
from ..targets.store import open_targets, targets_zarr_url
from .inputs import CompareInputError
from .served_rows import check_served
from .systems import RUN_STATES, System, resolve, run_states, trained_config
from .variants import variant_for


@dataclass
class Job:
    """One system at one budget (rho None for the reference systems)."""

    system: System
    rho: float | None
    config: PipelineConfig | None = None  # trained: the variant's configuration
    ctx: RunContext | None = None  # trained: the run directory holding its train stage

    @property
    def key(self) -> str:
        return self.system.name if self.rho is None else f"{self.system.name}@{self.rho:g}"


def refresh_targets(ctx: RunContext, run_one: RunOne = run_here) -> None:
    """Pass the targets stage (what compare reads) through the stage cache: a hit when it is current
    with the run's configuration and the code, redone when they changed since (e.g. probe settings),
    so nothing is trained or scored on stale targets. Stages before it are the run's business."""
    if ctx.parent is not None:
        return  # a variant's data stages are its parent's
    run_one(ctx, "targets", False)


def dims_of(ctx: RunContext) -> dict[str, Any]:
    _, h = open_targets(targets_zarr_url(ctx.stage_run("targets").url("targets")))
    return dict(num_layers=h.num_layers, num_kv_heads=h.num_kv_heads, head_dim=h.head_dim, n_context=h.n_context,
                scaling=h.scaling)


def baseline_plan(ctx: RunContext, rho: float, dims: dict[str, Any] | None = None) -> ModulePlan:
    """The run's module plan at ``rho``: what a baseline at the same budget must fit into."""
    module_cfg = ctx.config.train.module.model_copy(update={"rho": rho})
    return plan_from_config(module_cfg, **(dims or dims_of(ctx)))


def validate(ctx: RunContext, systems: list[str] | None = None,
             rhos: list[float] | None = None) -> tuple[list[System], list[float]]:
    """The systems and budgets (the run's ρ first), checked before anything is written or trained:
    unknown systems, and budgets too small to plan a module for this document, are refused."""
    try:
        chosen = resolve(systems)
    except ConfigError as exc:
        raise CompareInputError(str(exc)) from None
    check_served(ctx, chosen)
    budgets = list(dict.fromkeys([ctx.config.train.module.rho, *(rhos or [])]))
    dims = dims_of(ctx)
    for rho in budgets:
        try:
            baseline_plan(ctx, rho, dims)
        except (BudgetError, ValueError) as exc:
            raise CompareInputError(f"--rho {rho:g}: {' '.join(str(exc).split())}") from None
    return chosen, budgets


def plan_jobs(ctx: RunContext, systems: list[str] | None = None, rhos: list[float] | None = None) -> list[Job]:
    """The jobs: references once, every other system at the run's ρ and at each of ``rhos``, and the
    run's own states (first, refined) at the run's ρ whenever it has them."""
    chosen, budgets = validate(ctx, systems, rhos)
    if ctx.parent is None:  # a variant's states are not the run's
        done = {stage for stage, _ in RUN_STATES.values() if ctx.run.exists(stage, "module.json")}
        chosen = chosen + run_states(done)
    jobs: list[Job] = []
    for s in chosen:
        if s.kind == "reference":
            jobs.append(Job(s, None))
            continue
        for rho in budgets:
            if s.kind == "trained":  # baselines and kvpress presses: one job per budget
                config = trained_config(ctx.config, s, rho)
                jobs.append(Job(s, rho, config, variant_for(ctx, f"{s.name}_rho-{rho:g}", config)))
            elif s.kind in ("run", "served"):  # made by the pipeline (served: exported from it) at the run's ρ only
                if rho == ctx.config.train.module.rho:
                    jobs.append(Job(s, rho, ctx.config, ctx))
            else:
                jobs.append(Job(s, rho))
    return jobs


def train_missing(jobs: list[Job], run_one: RunOne = run_here,
                  progress: Callable[[int, int], None] | None = None) -> None:
    """Run the train stage of every trained job (its run directory's): cached ones return at once."""
    trained = [j for j in jobs if j.system.kind == "trained"]
    for i, job in enumerate(trained):
        run_one(job.ctx, "train", False)
        if progress:
            progress(i + 1, len(trained))
