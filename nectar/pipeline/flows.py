"""Prefect flows: thin wrappers over ``nectar.orchestration``.

``nectar_pipeline`` is the parent flow (one run per document); each stage runs as the subflow
``nectar_stage`` named ``<doc-id>-<stage>`` and tagged by document, publishing a counts table, a
sample of its rows and a progress artifact. ``nectar_stage`` is also deployed on its own so a data
engineer can re-run one stage of an existing run. Works in ephemeral mode (no server) and against
a server when PREFECT_API_URL is set.
"""
from __future__ import annotations

import os
import re
import socket
import time
from typing import Any, Callable

from prefect import flow, get_run_logger, tags
from prefect.artifacts import create_markdown_artifact, create_progress_artifact, create_table_artifact, \
    update_progress_artifact
from prefect.runtime import flow_run

from .. import comparison, orchestration
from ..comparison import sweep, variants as variant_runs
from ..orchestration.readers import write_json
from ..orchestration.executor import StageError, record_failure
from .gpu_slots import doc_slot, gpu_slot
from ..schemas.config import STAGES
from ..schemas.presets import load_config
from ..storage import atomic_write

# The first log line of a pipeline run: the host it runs on. A corpus reads it back (the worker's own
# "submitting" line can name a worker whose claim the server then rejected).
RUNS_ON = "nectar-pipeline runs on host "

# The CLI sets this to a terminal progress-bar factory; flows also publish Prefect progress.
CONSOLE_PROGRESS: Callable[[str], Callable[[int, int], None]] | None = None
# The CLI sets this to its console; notices (a stage redone because a file changed, a lock waited
# for) also go to the flow run's log.
CONSOLE_NOTICE: Callable[[str], None] | None = None


def _notify(message: str) -> None:
    if CONSOLE_NOTICE is not None:
        CONSOLE_NOTICE(message)
    else:
        import sys

        print(message, file=sys.__stderr__, flush=True)
    try:
        get_run_logger().warning(message)
    except Exception:  # outside a flow run
        pass


def _key(*parts: str) -> str:
    return re.sub(r"[^a-z0-9-]+", "-", "-".join(parts).lower()).strip("-")[:100]


def _prefect_progress(doc_id: str) -> Callable[[str], Callable[[int, int], None]]:
    def factory(stage: str) -> Callable[[int, int], None]:
        state = {"id": None, "last": 0.0}
        console = CONSOLE_PROGRESS(stage) if CONSOLE_PROGRESS else None

        def update(done: int, total: int) -> None:
            if console:
                console(done, total)
            pct = 100.0 * done / max(total, 1)
            now = time.monotonic()
            try:
                if state["id"] is None:
                    state["id"] = create_progress_artifact(
                        progress=pct, key=_key(doc_id, stage, "progress"),
                        description=f"{stage}: {done}/{total}")
                elif now - state["last"] > 2.0 or done >= total:  # throttle API calls
                    update_progress_artifact(state["id"], progress=pct, description=f"{stage}: {done}/{total}")
                else:
                    return
                state["last"] = now
            except Exception:  # progress must never fail a stage
                pass

        return update

    return factory


def _publish(ctx: orchestration.RunContext, stage: str, outcome) -> None:
    counts = outcome.manifest.counts
    rows = [{"metric": k, "value": v} for k, v in counts.items()]
    rows.insert(0, {"metric": "status", "value": outcome.status})
    rows.append({"metric": "duration_s", "value": outcome.manifest.duration_s})
    create_table_artifact(key=_key(ctx.doc_id, stage, "counts"), table=rows,
                          description=f"{ctx.doc_id} · {stage} · {outcome.status}")
    samples = orchestration.stage_samples(ctx, stage)
    if samples:
        create_table_artifact(key=_key(ctx.doc_id, stage, "sample"), table=samples,
                              description=f"{ctx.doc_id} · {stage} · first rows")
    for name, table in orchestration.stage_extra_tables(ctx, stage).items():
        create_table_artifact(key=_key(ctx.doc_id, stage, name), table=table,
                              description=f"{ctx.doc_id} · {stage} · {name}")


def _publish_failure(ctx: orchestration.RunContext, stage: str, exc: BaseException) -> None:
    rerun = f"nectar rerun {ctx.run.root} {stage}"
    try:
        create_markdown_artifact(
            key=_key(ctx.doc_id, stage, "error"),
            markdown=f"### {stage} failed\n\n```\n{type(exc).__name__}: {exc}\n```\n\nFix the cause, then re-run:\n\n"
                     f"```\n{rerun}\n```\n(or `nectar run {ctx.info.source_uri} --run-dir {ctx.run.root} --only {stage}` "
                     "without a server)",
            description=f"{ctx.doc_id} · {stage} · failed")
    except Exception:
        pass


@flow(name="nectar-stage", log_prints=True)
def nectar_stage(run_dir: str, stage: str, force: bool = True) -> dict[str, Any]:
    """Run one stage of an existing run directory (re-runs it when ``force``)."""
    if stage not in STAGES:
        raise ValueError(f"unknown stage {stage!r}; stages are {', '.join(STAGES)}")
    logger = get_run_logger()
    with orchestration.run_lock(run_dir, notify=_notify):  # one writer per run directory
        ctx = orchestration.open_run(run_dir)
        ctx.progress = _prefect_progress(ctx.doc_id)
        ctx.notify = _notify
        with tags("nectar", f"doc:{ctx.doc_id}", f"stage:{stage}"):
            try:
                with gpu_slot(stage):  # one GPU stage at a time per GPU, across runs (needs a server)
                    outcome = orchestration.STAGE_RUNNERS[stage](ctx, force)
            except BaseException as exc:
                failure = record_failure(ctx.run, stage, exc)
                _publish_failure(ctx, stage, failure.cause if isinstance(failure, StageError) else exc)
                if failure is exc:
                    raise
                raise failure from exc
    logger.info("%s %s: %s %s", ctx.doc_id, stage, outcome.status, outcome.manifest.counts)
    _publish(ctx, stage, outcome)
    return {"stage": stage, "status": outcome.status, "counts": outcome.manifest.counts}


def _pipeline_run_name() -> str:
    params = flow_run.parameters or {}
    doc = str(params.get("document", "document")).rstrip("/").split("/")[-1].split(":")[-1]
    return f"{_key(doc) or 'document'}-pipeline"


def _stage_subflow(ctx: orchestration.RunContext, stage: str, force: bool) -> dict[str, Any]:
    """The core's ``run_one`` under Prefect: the stage as the ``nectar-stage`` subflow, named
    ``<doc-id>-<stage>`` (a child run's ``<doc-id>-<its folder>-<stage>``) and tagged by document."""
    child = f"-{ctx.run.root.rstrip('/').split('/')[-1]}" if ctx.parent is not None else ""
    with tags("nectar", f"doc:{ctx.doc_id}"):
        runner = nectar_stage.with_options(flow_run_name=f"{ctx.doc_id}{child}-{stage}")
        return runner(run_dir=ctx.run.root, stage=stage, force=force)


@flow(name="nectar-pipeline", flow_run_name=_pipeline_run_name, log_prints=True)
def nectar_pipeline(
    document: str,
    preset: str = "cpu",
    config_file: str | None = None,
    overrides: list[str] | None = None,
    run_dir: str | None = None,
    from_stage: str | None = None,
    only_stage: str | None = None,
    force: bool = False,
    regime: str | None = None,
) -> dict[str, Any]:
    """chunk → first → synthesize → verify → targets → train → promote → evaluate (of the live state)
    for one document: the orchestration core (``orchestration.run_document``) with each stage as a
    subflow, one run per document at a time on a server (``doc_slot``)."""
    get_run_logger().info("%s%s (pid %d)", RUNS_ON, socket.gethostname(), os.getpid())  # for `nectar trigger`'s table
    config = load_config(preset, config_file, regime, overrides or [])
    done = orchestration.run_document(document, config, run_dir, from_stage=from_stage, only_stage=only_stage,
                                      force=force, run_one=_stage_subflow, notify=_notify, slot=doc_slot)
    return {"run_dir": done.ctx.run.root, "doc_id": done.ctx.doc_id, "stages": done.results}


@flow(name="nectar-sweep", flow_run_name=lambda: _pipeline_run_name().replace("-pipeline", "-sweep"),
      log_prints=True)
def nectar_sweep(
    document: str,
    grid: list[str],
    preset: str = "cpu",
    config_file: str | None = None,
    overrides: list[str] | None = None,
    run_dir: str | None = None,
    force: bool = False,
    regime: str | None = None,
) -> dict[str, Any]:
    """Data stages once, then train + evaluate for every grid variant; one comparison table."""
    config = load_config(preset, config_file, regime, overrides or [])
    variants = sweep.with_base(config, sweep.expand_variants(config, sweep.parse_grid(grid)))
    request = orchestration.plan_document(document, config, run_dir, force=force)
    rows = []
    with orchestration.open_document(request, config, notify=_notify) as ctx, \
            tags("nectar", f"doc:{ctx.doc_id}", "sweep"):
        with orchestration.llm_scope(ctx):  # synthesize and verify share one vLLM server
            for stage, stage_force in request.plan:
                if stage in orchestration.SHARED_DATA_STAGES:
                    _stage_subflow(ctx, stage, stage_force)
        for variant in variants:
            vctx = variant_runs.variant_context(ctx, variant)
            for stage in ("train", "evaluate"):
                _stage_subflow(vctx, stage, force)
            rows.append(sweep.comparison_row(variant, vctx.run))
        table_md = sweep.comparison_markdown(rows)
        atomic_write(ctx.run.url("sweep", "comparison.md"), table_md)
        write_json(ctx.run.url("sweep", "comparison.json"), rows)
    create_table_artifact(key=_key(ctx.doc_id, "sweep"), table=rows, description=f"{ctx.doc_id} · sweep")
    return {"run_dir": ctx.run.root, "doc_id": ctx.doc_id, "comparison": rows, "table": table_md}


def _compare_run_name() -> str:
    run_dir = str((flow_run.parameters or {}).get("run_dir", "run")).rstrip("/")
    return f"{_key(run_dir.split('/')[-1]) or 'run'}-compare"


@flow(name="nectar-compare", flow_run_name=_compare_run_name, log_prints=True)
def nectar_compare(run_dir: str, rhos: list[float] | None = None, systems: list[str] | None = None,
                   questions: str | None = None, out: str | None = None) -> dict[str, Any]:
    """Every system at equal bytes on one run (``nectar compare``): the train stages of what is
    missing run as subflows (cache hits when trained before), then one scoring pass; the table and
    the frontier figure are published as artifacts."""
    ctx = comparison.open_for_compare(run_dir)
    ctx.progress = _prefect_progress(ctx.doc_id)
    with tags("nectar", f"doc:{ctx.doc_id}", "compare"):
        result = comparison.compare(ctx, systems, rhos, run_one=_stage_subflow, progress=ctx.progress,
                                    questions=questions, out=out)
    out = comparison.compare_dir(ctx, out)
    create_table_artifact(key=_key(ctx.doc_id, "compare"), description=f"{ctx.doc_id} · equal-bytes comparison",
                          table=[r.model_dump(exclude={"schema_version"}) for r in result.rows])
    create_markdown_artifact(key=_key(ctx.doc_id, "compare-report"), description=f"{ctx.doc_id} · comparison",
                             markdown=result.markdown.replace("](frontier.png)", f"]({out}/frontier.png)")
                             + f"\n\nFiles: `{out}/comparison.parquet`, `{out}/comparison.md`, `{out}/frontier.png`\n")
    return {"run_dir": ctx.run.root, "doc_id": ctx.doc_id, "table": result.markdown, "files": result.files,
            "timings_s": result.timings, "out": out}
