"""Reading a pipeline run back from the Prefect API: its stage subflow runs, states and artifacts.

The Prefect UI shows the same thing; this is for ``nectar trigger --wait`` and scripts that want
the outcome of a run without a browser.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any
from uuid import UUID


@dataclass(frozen=True)
class StageRun:
    name: str  # "<doc-id>-<stage>"
    state: str  # COMPLETED / FAILED / …
    message: str | None
    flow_run_id: UUID
    parameters: dict[str, Any]

    @property
    def stage(self) -> str | None:
        return self.parameters.get("stage")


def _sync_client():
    from prefect.client.orchestration import get_client

    return get_client(sync_client=True)


def stage_runs(parent_flow_run_id: UUID) -> list[StageRun]:
    """The stage subflow runs of a pipeline flow run, in start order."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId
    from prefect.client.schemas.sorting import FlowRunSort

    with _sync_client() as client:
        parent = client.read_flow_run(parent_flow_run_id)
        # Subflows hang off a task run of the parent; the filter follows that link server-side.
        runs = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[parent.id])),
            sort=FlowRunSort.START_TIME_ASC, limit=200)
    return [StageRun(r.name, r.state.type.value if r.state else "UNKNOWN",
                     r.state.message if r.state else None, r.id, dict(r.parameters)) for r in runs]


def artifacts(flow_run_ids: list[UUID]) -> dict[str, Any]:
    """Latest artifact per key for these flow runs: key → (type, data parsed from JSON when a table)."""
    from prefect.client.schemas.objects import Artifact

    with _sync_client() as client:
        # POST /artifacts/filter with only the filter we need: Prefect 3.8's read_artifacts() sends
        # null for the filters it isn't given (rejected with 422 by FastAPI >= 0.151), and given
        # empty filters instead it joins on task runs and drops artifacts made outside a task.
        response = client.request("POST", "/artifacts/filter", json={
            "artifacts": {"flow_run_id": {"any_": [str(i) for i in flow_run_ids]}},
            "sort": "CREATED_DESC", "limit": 200, "offset": 0})
        found = Artifact.model_validate_list(response.json())
    out: dict[str, Any] = {}
    for art in found:
        if art.key and art.key not in out:
            data = art.data
            if art.type == "table" and isinstance(data, str):
                data = json.loads(data)
            out[art.key] = {"type": art.type, "data": data, "flow_run_id": art.flow_run_id}
    return out


def table_as_dict(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """A ``metric``/``value`` counts table (as the flows publish it) as a plain mapping."""
    return {row["metric"]: row["value"] for row in rows}


def summary_lines(parent_flow_run_id: UUID) -> list[str]:
    """One line per stage: ``<doc>-<stage>: COMPLETED`` plus the failure message when it failed."""
    lines = []
    for run in stage_runs(parent_flow_run_id):
        line = f"{run.name}: {run.state}"
        if run.state in ("FAILED", "CRASHED") and run.message:
            line += f" — {run.message.strip().splitlines()[0][:200]}"
        lines.append(line)
    return lines
