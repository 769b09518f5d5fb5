"""Prefect deployments, schedules and triggers for the pipeline (``nectar deploy|schedule|trigger|rerun``).

What ``nectar deploy`` registers on the server in ``PREFECT_API_URL``:

    work pool  nectar (type process)        queues: default, gpu (concurrency = number of GPUs)
    <pipeline flow>/pipeline                 a whole run for a document given at trigger time
    <pipeline flow>/doc-<name>               one per scheduled document: cron + fixed parameters
    <stage flow>/<stage>                     one per stage: re-run that stage of an existing run
                                             (GPU stages go to the ``gpu`` queue)
    global concurrency limit nectar-gpu      one slot per GPU, held by GPU stages inside pipeline runs

Entrypoints are module paths (``nectar.pipeline.flows.nectar_pipeline``): workers import the
installed package and the Docker image is the code. Every deployment gets ONE pull step,
``set_working_directory(<working dir>)``: flow runs start there, so relative run directories
(``runs/<doc>/<run>``) land in a stable folder (a shared volume under compose). Without a pull step
a process worker copies the deployment's ``path`` (the directory ``nectar deploy`` ran in, .venv
and all) into a temp workspace for every flow run — minutes per run, and runs written into a
folder that is deleted afterwards.
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Mapping

from ..orchestration.executor import slug
from ..schemas.config import STAGES
from .gpu_slots import GPU_LIMIT, GPU_STAGES

PIPELINE_ENTRYPOINT = "nectar.pipeline.flows.nectar_pipeline"
STAGE_ENTRYPOINT = "nectar.pipeline.flows.nectar_stage"
DEFAULT_POOL = "nectar"
GPU_QUEUE = "gpu"
PIPELINE_DEPLOYMENT = "pipeline"
TAGS = ["nectar"]
TERMINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}


class DeployError(RuntimeError):
    """The server, a deployment or a parameter can't do what was asked; the message says why."""


# ----------------------------------------------------------------------------------- parameters

def llm_overrides_from_env(env: Mapping[str, str]) -> list[str]:
    """Config overrides pointing every LLM role at the compose stack's OpenAI-compatible servers.

    NECTAR_LLM_BASE_URL / NECTAR_GEN_MODEL        synthesis (and, by default, every other role)
    NECTAR_ANSWER_BASE_URL / NECTAR_ANSWER_MODEL  verify's long-context re-answer
    NECTAR_JUDGE_BASE_URL / NECTAR_JUDGE_MODEL    the judge of verify and evaluate
    Unset or empty role variables fall back to the generation server and model; nothing is
    overridden when NECTAR_LLM_BASE_URL is unset (the preset's own LLM settings apply).
    """
    gen_url = env.get("NECTAR_LLM_BASE_URL")
    if not gen_url:
        return []
    gen_model = env.get("NECTAR_GEN_MODEL") or None

    def role(prefix: str) -> tuple[str, str | None]:
        return env.get(f"NECTAR_{prefix}_BASE_URL") or gen_url, env.get(f"NECTAR_{prefix}_MODEL") or gen_model

    roles = {"synthesize.llm": (gen_url, gen_model), "verify.answer_llm": role("ANSWER"),
             "verify.judge": role("JUDGE"), "evaluate.judge": role("JUDGE")}
    out = []
    for name, (url, model) in roles.items():
        out += [f"{name}.backend=openai", f"{name}.base_url={url}"]
        if model:
            out.append(f"{name}.model={model}")
    return out


def pipeline_parameters(preset: str = "cpu", config_file: str | None = None,
                        overrides: list[str] | None = None, run_dir: str | None = None,
                        document: str | None = None) -> dict[str, Any]:
    """Parameters of ``nectar_pipeline``, validated here so a typo fails at deploy time, not at 3 a.m."""
    from ..schemas.presets import load_config

    load_config(preset, config_file, overrides=list(overrides or ()))  # raises ConfigError, named
    params: dict[str, Any] = {"preset": preset, "config_file": config_file,
                              "overrides": list(overrides or [])}
    if run_dir is not None:
        params["run_dir"] = run_dir
    if document is not None:
        params["document"] = document
    return params


def document_deployment_name(document: str) -> str:
    """``doc-<name>`` from the document URI's file name (stable while the content changes)."""
    stem = Path(document.rstrip("/").split("/")[-1]).stem or document
    return f"doc-{slug(stem)}"


def job_variables(working_dir: str, env: Mapping[str, str] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"working_dir": str(working_dir)}
    if env:
        out["env"] = dict(env)
    return out


def pull_steps(working_dir: str) -> list[dict[str, Any]]:
    return [{"prefect.deployments.steps.set_working_directory": {"directory": str(working_dir)}}]


# ---------------------------------------------------------------------------- server resources

def require_server() -> str:
    """The API URL; deployments and triggers are meaningless against an ephemeral server."""
    from prefect.settings import PREFECT_API_URL

    url = PREFECT_API_URL.value()
    if not url:
        raise DeployError("PREFECT_API_URL is not set: deployments need a running Prefect server "
                          "(e.g. export PREFECT_API_URL=http://127.0.0.1:4200/api)")
    return url


def _client():
    from prefect.client.orchestration import get_client

    require_server()
    return get_client(sync_client=True)


def ensure_work_pool(pool: str = DEFAULT_POOL, gpus: int | None = None) -> None:
    """A process work pool with a ``gpu`` queue that runs at most ``gpus`` flow runs at once.

    ``gpus=None`` keeps an existing queue's limit (a new queue gets 1).
    """
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectNotFound
    from prefect.workers.process import ProcessWorker

    with _client() as client:
        try:
            existing = client.read_work_pool(pool)
            if existing.type != "process":
                raise DeployError(f"work pool {pool!r} exists with type {existing.type!r}; nectar "
                                  "deploys to a 'process' pool (pass --pool to use another name)")
        except ObjectNotFound:
            client.create_work_pool(WorkPoolCreate(
                name=pool, type="process", description="NECTAR pipeline runs",
                base_job_template=ProcessWorker.get_default_base_job_template()))
        try:
            queue = client.read_work_queue_by_name(GPU_QUEUE, work_pool_name=pool)
            if gpus is not None and queue.concurrency_limit != gpus:
                client.update_work_queue(queue.id, concurrency_limit=gpus)
        except ObjectNotFound:
            client.create_work_queue(GPU_QUEUE, description="stage re-runs that use the GPU",
                                     work_pool_name=pool, concurrency_limit=gpus or 1)


def ensure_gpu_limit(gpus: int = 1, name: str = GPU_LIMIT) -> None:
    """The global concurrency limit GPU stages hold inside pipeline runs (see gpu_slots.py)."""
    with _client() as client:
        client.upsert_global_concurrency_limit_by_name(name, gpus)


# ----------------------------------------------------------------------------------- deployments

def _runner_deployment(entrypoint: str, name: str, pool: str, **kwargs: Any):
    from prefect.deployments.runner import RunnerDeployment

    return RunnerDeployment.from_entrypoint(entrypoint=entrypoint, name=name, work_pool_name=pool,
                                            **kwargs)


def pipeline_deployment(pool: str, parameters: dict[str, Any], working_dir: str,
                        name: str = PIPELINE_DEPLOYMENT, cron: str | None = None,
                        timezone: str | None = None, tags: list[str] | None = None,
                        env: Mapping[str, str] | None = None):
    schedules = None
    if cron:
        from prefect.client.schemas.schedules import CronSchedule

        schedules = [CronSchedule(cron=cron, timezone=timezone or "UTC")]
    limit = None
    if "document" in parameters:  # a document's own deployment: one run at a time, the next waits
        from prefect.client.schemas.objects import ConcurrencyLimitConfig, ConcurrencyLimitStrategy

        limit = ConcurrencyLimitConfig(limit=1, collision_strategy=ConcurrencyLimitStrategy.ENQUEUE)
    return _runner_deployment(
        PIPELINE_ENTRYPOINT, name, pool, parameters=parameters, schedules=schedules, concurrency_limit=limit,
        tags=[*TAGS, *(tags or [])], job_variables=job_variables(working_dir, env),
        description="Run the NECTAR pipeline (chunk → … → evaluate) for one document; "
                    "completed stages are skipped, so re-running a failed run resumes it.")


def stage_deployments(pool: str, working_dir: str, env: Mapping[str, str] | None = None):
    """One deployment per stage; each takes the run directory (the config comes from its run.json)."""
    out = []
    for stage in STAGES:
        out.append(_runner_deployment(
            STAGE_ENTRYPOINT, stage, pool, parameters={"stage": stage, "force": True},
            tags=[*TAGS, f"stage:{stage}", *(["gpu"] if stage in GPU_STAGES else [])],
            work_queue_name=GPU_QUEUE if stage in GPU_STAGES else None,
            job_variables=job_variables(working_dir, env),
            description=f"Re-run the {stage} stage of an existing run on its existing inputs."))
    return out


def apply(deployments: list, working_dir: str) -> dict[str, str]:
    """Register (create or update) deployments with the working-directory pull step; name → id."""
    from prefect.client.schemas.actions import DeploymentUpdate

    ids = {}
    try:
        with _client() as client:
            for dep in deployments:
                dep_id = dep.apply()
                # RunnerDeployment.apply() registers no pull steps for module entrypoints; set ours.
                client.update_deployment(dep_id, DeploymentUpdate(pull_steps=pull_steps(working_dir)))
                ids[f"{dep.flow_name}/{dep.name}"] = str(dep_id)
    except DeployError:
        raise
    except Exception as exc:  # httpx / Prefect errors: say which server refused
        raise DeployError(f"could not register deployments on {require_server()}: {exc}") from exc
    return ids


def deploy(pool: str = DEFAULT_POOL, preset: str = "cpu", config_file: str | None = None,
           overrides: list[str] | None = None, working_dir: str | None = None, gpus: int = 1,
           env: Mapping[str, str] | None = None) -> dict[str, str]:
    """``nectar deploy``: the pool, the GPU limits, the pipeline deployment and the stage deployments.

    ``working_dir`` (default: the current directory) is where flow runs start on the worker.
    """
    params = pipeline_parameters(preset, config_file, overrides)
    working_dir = str(working_dir or os.getcwd())
    ensure_work_pool(pool, gpus)
    ensure_gpu_limit(gpus)
    deps = [pipeline_deployment(pool, params, working_dir, env=env), *stage_deployments(pool, working_dir, env)]
    return apply(deps, working_dir)


def schedule_document(document: str, cron: str | None, pool: str = DEFAULT_POOL, preset: str = "cpu",
                      config_file: str | None = None, overrides: list[str] | None = None,
                      run_dir: str | None = None, working_dir: str | None = None,
                      timezone: str | None = None, env: Mapping[str, str] | None = None) -> dict[str, str]:
    """A per-document deployment (``<pipeline flow>/doc-<name>``), on a cron schedule if given."""
    if cron:
        _check_cron(cron)
    params = pipeline_parameters(preset, config_file, overrides, run_dir, document=document)
    working_dir = str(working_dir or os.getcwd())
    ensure_work_pool(pool)
    name = document_deployment_name(document)
    dep = pipeline_deployment(pool, params, working_dir, name=name, cron=cron, timezone=timezone,
                              tags=[f"doc:{name[4:]}"], env=env)
    return apply([dep], working_dir)


def _check_cron(cron: str) -> None:
    from prefect.client.schemas.schedules import CronSchedule

    try:
        CronSchedule(cron=cron)
    except Exception as exc:
        raise DeployError(f"invalid cron expression {cron!r}: {exc}") from None


# -------------------------------------------------------------------------------------- triggers

def _flow_name(entrypoint: str) -> str:
    from prefect.flows import load_flow_from_entrypoint

    return load_flow_from_entrypoint(entrypoint).name


def trigger(document: str, preset: str | None = None, config_file: str | None = None,
            overrides: list[str] | None = None, run_dir: str | None = None,
            from_stage: str | None = None, only_stage: str | None = None, force: bool = False,
            deployment: str | None = None):
    """Create a flow run of the pipeline deployment for ``document``; returns the FlowRun at once.

    Unset options keep the deployment's defaults (its preset, config file and overrides).
    """
    params: dict[str, Any] = {"document": document}
    if preset is not None or config_file is not None or overrides:
        params.update(pipeline_parameters(preset or "cpu", config_file, overrides))
    for key, value in (("run_dir", run_dir), ("from_stage", from_stage), ("only_stage", only_stage)):
        if value is not None:
            params[key] = value
    if force:
        params["force"] = True
    name = deployment or f"{_flow_name(PIPELINE_ENTRYPOINT)}/{PIPELINE_DEPLOYMENT}"
    tag = f"doc:{document_deployment_name(document)[4:]}"
    return _run(name, params, [*TAGS, tag])


def rerun_stage(run_dir: str, stage: str):
    """Create a flow run of ``<stage flow>/<stage>`` for an existing run directory."""
    if stage not in STAGES:
        raise DeployError(f"unknown stage {stage!r}; choose one of {', '.join(STAGES)}")
    return _run(f"{_flow_name(STAGE_ENTRYPOINT)}/{stage}", {"run_dir": run_dir, "stage": stage},
                [*TAGS, f"stage:{stage}"])


def _run(name: str, params: dict[str, Any], tags: list[str]):
    from prefect.deployments import run_deployment
    from prefect.exceptions import ObjectNotFound

    require_server()
    try:
        return run_deployment(name, parameters=params, timeout=0, tags=tags, as_subflow=False)
    except ObjectNotFound:
        raise DeployError(f"deployment {name!r} not found: run `nectar deploy` first") from None


def _find_flow_run(client, flow_run: str):
    """A flow run by id, or the latest failed/crashed run with that name (e.g. ``manual-pipeline``)."""
    from uuid import UUID

    from prefect.client.schemas.filters import (FlowRunFilter, FlowRunFilterName, FlowRunFilterState,
                                                FlowRunFilterStateType)
    from prefect.client.schemas.objects import StateType
    from prefect.client.schemas.sorting import FlowRunSort

    try:
        return client.read_flow_run(UUID(flow_run))
    except ValueError:
        pass
    runs = client.read_flow_runs(
        flow_run_filter=FlowRunFilter(
            name=FlowRunFilterName(any_=[flow_run]),
            state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.FAILED, StateType.CRASHED]))),
        sort=FlowRunSort.EXPECTED_START_TIME_DESC, limit=1)
    if not runs:
        raise DeployError(f"no failed or crashed flow run named {flow_run!r}")
    return runs[0]


def retry_flow_run(flow_run: str):
    """What the UI's Retry button does: the run goes back to Scheduled (AwaitingRetry) with the same
    parameters, a worker picks it up, and stages whose manifests match are cache hits."""
    from prefect.states import Scheduled

    with _client() as client:
        run = _find_flow_run(client, flow_run)
        if run.state is None or run.state.type.value not in ("FAILED", "CRASHED", "CANCELLED"):
            raise DeployError(f"flow run {run.name} is {run.state.name if run.state else 'unknown'}; "
                              "only failed, crashed or cancelled runs are retried")
        client.set_flow_run_state(run.id, Scheduled(name="AwaitingRetry", message="Retry from nectar retry"),
                                  force=True)
        return client.read_flow_run(run.id)


def wait_for_run(flow_run_id, timeout_s: float = 3600.0, poll_s: float = 2.0):
    """Poll until the flow run reaches a terminal state; returns the FlowRun."""
    deadline = time.monotonic() + timeout_s
    with _client() as client:
        while True:
            run = client.read_flow_run(flow_run_id)
            if run.state is not None and run.state.type.value in TERMINAL:
                return run
            if time.monotonic() > deadline:
                raise TimeoutError(f"flow run {run.name} still {run.state.name if run.state else '?'} "
                                   f"after {timeout_s:.0f}s")
            time.sleep(poll_s)


# ------------------------------------------------------------------------------------------- CLI
