"""Operating deployed flows (``nectar trigger|rerun|retry`` and ``--wait``): start a flow run of a
deployment ``deploy.py`` registered, retry a failed one, follow one to its end."""
from __future__ import annotations

import time
from typing import Any

from ..schemas.config import STAGES
from .deploy import (PIPELINE_DEPLOYMENT, PIPELINE_ENTRYPOINT, STAGE_ENTRYPOINT, TAGS, DeployError, api_client,
                     document_deployment_name, pipeline_parameters, require_server)

TERMINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}


def _flow_name(entrypoint: str) -> str:
    from prefect.flows import load_flow_from_entrypoint

    return load_flow_from_entrypoint(entrypoint).name


def trigger(document: str, preset: str | None = None, config_file: str | None = None,
            overrides: list[str] | None = None, run_dir: str | None = None,
            from_stage: str | None = None, only_stage: str | None = None, force: bool = False,
            deployment: str | None = None, extra_tags: list[str] | None = None):
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
    return _run(name, params, [*TAGS, tag, *(extra_tags or [])])


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

    with api_client() as client:
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
    with api_client() as client:
        while True:
            run = client.read_flow_run(flow_run_id)
            if run.state is not None and run.state.type.value in TERMINAL:
                return run
            if time.monotonic() > deadline:
                raise TimeoutError(f"flow run {run.name} still {run.state.name if run.state else '?'} "
                                   f"after {timeout_s:.0f}s")
            time.sleep(poll_s)
