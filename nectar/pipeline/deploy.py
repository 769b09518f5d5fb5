"""Prefect deployments and schedules for the pipeline (``nectar deploy|schedule``); the commands that
start and follow flow runs on them are ``operations.py``.

What ``nectar deploy`` registers on the server in ``PREFECT_API_URL``:

    work pool  nectar (type process)        queues: default, gpu (concurrency = number of GPUs)
    <pipeline flow>/pipeline                 a whole run for a document given at trigger time
    <pipeline flow>/doc-<name>               one per scheduled document: cron + fixed parameters
    <stage flow>/<stage>                     one per stage: re-run that stage of an existing run
                                             (GPU stages go to the ``gpu`` queue)
    global concurrency limit nectar-gpu      one slot per GPU, held by GPU stages inside pipeline runs
    automation nectar-crashed-runs           a flow run whose heartbeats stop (its worker or host died)
                                             is marked Crashed, so a corpus retries it on another worker

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


class DeployError(RuntimeError):
    """The server, a deployment or a parameter can't do what was asked; the message says why."""


# ----------------------------------------------------------------------------------- parameters

def llm_overrides_from_env(env: Mapping[str, str]) -> list[str]:
    """Config overrides pointing every LLM role at the compose stack's OpenAI-compatible servers.

    NECTAR_LLM_BASE_URL / NECTAR_GEN_MODEL        synthesis (and, by default, every other role)
    NECTAR_ANSWER_BASE_URL / NECTAR_ANSWER_MODEL  verify's long-context re-answer
    NECTAR_JUDGE_BASE_URL / NECTAR_JUDGE_MODEL    the judge of verify and evaluate
    NECTAR_LLM_BACKEND                            openai (default) or vllm (adds vLLM's cache_salt)
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
    backend = env.get("NECTAR_LLM_BACKEND") or "openai"
    out = []
    for name, (url, model) in roles.items():
        out += [f"{name}.backend={backend}", f"{name}.base_url={url}"]
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


def api_client():
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

    with api_client() as client:
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
    with api_client() as client:
        client.upsert_global_concurrency_limit_by_name(name, gpus)


CRASH_AUTOMATION = "nectar-crashed-runs"
CRASH_AFTER_S = 600.0  # flow runs send a heartbeat every PREFECT_FLOWS_HEARTBEAT_FREQUENCY s (180 by default)


def ensure_crash_detection(within_s: float = CRASH_AFTER_S, name: str = CRASH_AUTOMATION) -> None:
    """Prefect's answer to a worker that dies mid-run: an automation that marks a running flow run
    Crashed when no heartbeat (nor end) follows its last heartbeat within ``within_s`` seconds.

    Without it a killed host's flow run stays Running forever and nobody retries it. Set
    ``within_s`` above the workers' heartbeat period (PREFECT_FLOWS_HEARTBEAT_FREQUENCY) — a long
    stage keeps beating, so only a silent process is declared dead. Created or updated in place."""
    from datetime import timedelta

    from prefect.automations import Automation
    from prefect.client.schemas.objects import StateType
    from prefect.events.actions import ChangeFlowRunState
    from prefect.events.schemas.automations import EventTrigger, Posture

    trigger = EventTrigger(
        after={"prefect.flow-run.heartbeat"},
        expect={"prefect.flow-run.heartbeat", "prefect.flow-run.Completed", "prefect.flow-run.Failed",
                "prefect.flow-run.Cancelled", "prefect.flow-run.Crashed"},
        match={"prefect.resource.id": ["prefect.flow-run.*"]}, for_each={"prefect.resource.id"},
        posture=Posture.Proactive, threshold=1, within=timedelta(seconds=within_s))
    action = ChangeFlowRunState(state=StateType.CRASHED,
                                message=f"no heartbeat for {within_s:.0f} s: its worker or host stopped")
    auto = Automation(name=name, description="Mark flow runs whose process died as Crashed", trigger=trigger,
                      actions=[action])
    try:
        existing = Automation.read(name=name)
    except ValueError:  # not there yet
        existing = None
    if existing is None:
        auto.create()
    else:
        auto.id = existing.id
        auto.update()


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
        with api_client() as client:
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
           env: Mapping[str, str] | None = None, crash_after_s: float | None = CRASH_AFTER_S) -> dict[str, str]:
    """``nectar deploy``: the pool, the GPU limits, the crash detection, the pipeline deployment and the
    stage deployments (``crash_after_s=None``: no crash detection).

    ``working_dir`` (default: the current directory) is where flow runs start on the worker.
    """
    params = pipeline_parameters(preset, config_file, overrides)
    working_dir = str(working_dir or os.getcwd())
    ensure_work_pool(pool, gpus)
    ensure_gpu_limit(gpus)
    if crash_after_s:
        ensure_crash_detection(crash_after_s)
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
