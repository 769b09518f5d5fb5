"""A corpus through Prefect: one pipeline flow run per document on the deployments, watched to the end.

``nectar trigger DOC…`` (several documents, a glob, a directory or a manifest) lands here; the pure
parts (expanding the arguments, each document's run directory, skip / retry / start) are
``nectar.orchestration.corpus``. What this adds:

* each document that is not finished gets a flow run of ``nectar-pipeline/pipeline`` with an
  explicit run directory under the shared runs root, tagged ``corpus:<name>`` and
  ``run:<doc-id>/<run-id>`` — a document whose run is still queued or running is followed, not
  triggered twice;
* the server throttles: flow runs wait in *Scheduled* for a worker slot (the pool's and each
  worker's ``--limit``), GPU stages for the ``nectar-gpu`` slots (gpu_slots.py);
* ``--wait`` follows them: a run that failed or crashed (a dead worker's run is marked *Crashed* by
  the heartbeat automation of ``deploy.ensure_crash_detection``) is retried — the same flow run is
  rescheduled, any worker takes it, completed stages are cache hits — up to ``retries`` times;
* the per-document table (done / running / queued / failed, the stage, the worker's host) is
  printed and published as ONE table artifact, ``corpus-<name>``, updated as it changes.

``run_here`` is the same for ``nectar run`` (in this process, one document after the other).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

from ..orchestration.corpus import DocRow, PlannedDoc, action, progress, summary
from .deploy import PIPELINE_DEPLOYMENT, PIPELINE_ENTRYPOINT, api_client

ACTIVE = {"SCHEDULED", "PENDING", "RUNNING", "PAUSED", "CANCELLING"}
FAILED = {"FAILED", "CRASHED", "CANCELLED"}
Notify = Callable[[str], None]


@dataclass(frozen=True)
class CorpusOptions:
    name: str
    preset: str | None = None
    config_file: str | None = None
    overrides: tuple[str, ...] = ()
    retries: int = 1
    timeout_s: float = 3600.0
    poll_s: float = 2.0


def run_tag(doc: PlannedDoc) -> str:
    parts = doc.run_dir.rstrip("/").split("/")
    return f"run:{'/'.join(parts[-2:])}"


# ----------------------------------------------------------------------------------------- trigger

def submit(docs: list[PlannedDoc], opts: CorpusOptions, notify: Notify) -> tuple[list[DocRow], dict[str, Any]]:
    """Skip finished documents, follow active ones, trigger the rest; rows and {run_dir: flow run id}."""
    from . import operations

    rows, runs = [], {}
    active = _active_runs(docs)
    for doc in docs:
        row = DocRow(doc.document, doc.doc_id, doc.run_dir, "queued")
        if doc.run_dir in active:
            fr = active[doc.run_dir]
            row.state, row.detail = _row_state(fr.state.type.value), f"already {fr.state.name}: followed"
            runs[doc.run_dir] = fr.id
        else:
            p = progress(doc.run_dir, verify=True)  # a stale output counts as not done
            what = action(p)
            if what == "skip":
                row.state, row.detail = "skipped", f"done earlier ({p.stages_done} stages)"
            else:
                overrides = [*opts.overrides, *doc.entry.overrides]
                fr = operations.trigger(doc.document, opts.preset, opts.config_file, overrides or None,
                                        doc.run_dir, extra_tags=[f"corpus:{opts.name}", run_tag(doc)])
                runs[doc.run_dir] = fr.id
                row.attempts = 1
                row.stage = p.stage or ""
                row.detail = (f"retry from {p.stage} ({p.error})" if what == "retry"
                              else "resumes at " + p.stage if p.state == "partial" else "new")
        rows.append(row)
    publish(rows, opts.name)
    return rows, runs


def _active_runs(docs: list[PlannedDoc]) -> dict[str, Any]:
    """run_dir → a queued or running flow run for it (by its ``run:`` tag), if any."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterState, FlowRunFilterStateType, \
        FlowRunFilterTags
    from prefect.client.schemas.objects import StateType

    by_tag = {run_tag(d): d.run_dir for d in docs}
    flt = FlowRunFilter(tags=FlowRunFilterTags(all_=["nectar"]),
                        state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType(s) for s in ACTIVE])))
    out, offset, page = {}, 0, 200
    with api_client() as client:
        while True:  # every active nectar run, a page at a time (the server caps a page)
            found = client.read_flow_runs(flow_run_filter=flt, limit=page, offset=offset)
            for fr in found:
                for tag in fr.tags:
                    if tag in by_tag:
                        out[by_tag[tag]] = fr
            if len(found) < page:
                return out
            offset += page


def _row_state(state_type: str) -> str:
    return {"SCHEDULED": "queued", "PENDING": "queued", "RUNNING": "running", "COMPLETED": "done",
            "CRASHED": "crashed"}.get(state_type, "failed" if state_type in FAILED else state_type.lower())


# ------------------------------------------------------------------------------------------- watch

def watch(rows: list[DocRow], runs: dict[str, Any], opts: CorpusOptions, notify: Notify) -> list[DocRow]:
    """Follow every triggered run to its end, retrying failed and crashed ones; the final rows."""
    from prefect.states import Scheduled

    deadline = time.monotonic() + opts.timeout_s
    by_dir = {r.run_dir: r for r in rows}
    pending = dict(runs)
    # One API read per poll for all runs; a large corpus polls less often (the server serves workers too).
    poll_s = max(opts.poll_s, len(pending) / 100)
    while pending:
        if time.monotonic() > deadline:
            raise TimeoutError(f"corpus {opts.name}: {len(pending)} document(s) not finished after "
                               f"{opts.timeout_s:.0f} s ({summary(rows)}); run the same command again to follow them")
        changed = False
        with api_client() as client:
            flow_runs = _read_runs(client, list(pending.values()))
            for run_dir, fr_id in list(pending.items()):
                fr, row = flow_runs[str(fr_id)], by_dir[run_dir]
                before = (row.state, row.stage, row.host)
                _update_row(row, fr, client)
                if row.state in ("failed", "crashed"):
                    if row.attempts <= opts.retries:
                        notify(f"{row.doc_id}: {fr.state.name} at {row.stage or '?'} on {row.host or '?'}: "
                               f"retrying (attempt {row.attempts + 1})")
                        client.set_flow_run_state(fr.id, Scheduled(
                            name="AwaitingRetry", message=f"corpus {opts.name}: retry after {fr.state.name}"),
                            force=True)
                        row.attempts += 1
                        row.state = "queued"
                    else:
                        del pending[run_dir]
                elif row.state == "done":
                    del pending[run_dir]
                if (row.state, row.stage, row.host) != before:
                    changed = True
                    notify(f"{row.doc_id}: {row.state} {row.stage} {('on ' + row.host) if row.host else ''}".rstrip())
        if changed:
            publish(rows, opts.name)
        if pending:
            time.sleep(poll_s)
    publish(rows, opts.name)
    return rows


def _read_runs(client, ids: list) -> dict[str, Any]:
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    out: dict[str, Any] = {}
    for i in range(0, len(ids), 200):  # the API's page size
        chunk = ids[i:i + 200]
        for fr in client.read_flow_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=chunk)),
                                        limit=len(chunk)):
            out[str(fr.id)] = fr
    return out


def _update_row(row: DocRow, fr, client) -> None:
    state = _row_state(fr.state.type.value)
    attempt = (fr.run_count, state)
    if state != "queued" and (row.extra.get("seen") != attempt or not row.host):
        # A new state or attempt (or the worker's log line not in yet): which worker has it, one log query.
        row.extra["seen"] = attempt
        row.host = worker_host(client, fr.id) or row.host
    row.state = state
    if state == "queued":
        return
    p = progress(row.run_dir)  # manifests only: cheap enough each poll for the runs in progress
    if state == "done":
        row.stage, row.detail = "", f"{p.stages_done} stages"
    elif state in ("failed", "crashed"):
        row.stage = p.stage or ""
        row.detail = (p.error or fr.state.message or "")[:160]
    else:
        row.stage = p.stage or ""


def worker_host(client, flow_run_id) -> str | None:
    """The host running the flow run's latest attempt: the pipeline flow's first log line.

    Not the worker's "submitting flow run" line: two workers polling at once can both log it for
    one run, and the server then rejects one of them."""
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.client.schemas.sorting import LogSort

    from .flows import RUNS_ON

    logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])),
                            sort=LogSort.TIMESTAMP_DESC, limit=200)
    for log in logs:
        if log.message.startswith(RUNS_ON):
            return log.message[len(RUNS_ON):].split()[0]
    return None


# -------------------------------------------------------------------------------------- in process

def run_here(docs: list[PlannedDoc], run_one: Callable[[PlannedDoc], Any], notify: Notify,
             stopped: Callable[[], bool]) -> list[DocRow]:
    """``nectar run`` of a corpus: one document after the other in this process; a failed document
    is recorded and the next one goes on (the same command later retries it from its failed stage)."""
    rows = []
    for doc in docs:
        row = DocRow(doc.document, doc.doc_id, doc.run_dir, "queued")
        p = progress(doc.run_dir, verify=True)
        what = action(p)
        if what == "skip":
            row.state, row.detail = "skipped", f"done earlier ({p.stages_done} stages)"
            rows.append(row)
            continue
        notify(f"{doc.doc_id}: {'retry from ' + p.stage if what == 'retry' else 'start'} ({doc.run_dir})")
        row.attempts = 1
        try:
            run_one(doc)
        except Exception as exc:
            if stopped():
                raise
            after = progress(doc.run_dir)
            row.state, row.stage = "failed", after.stage or ""
            row.detail = (after.error or f"{type(exc).__name__}: {exc}").splitlines()[0][:160]
        else:
            row.state, row.detail = "done", ("retried from " + p.stage) if what == "retry" else ""
        rows.append(row)
    return rows


# ------------------------------------------------------------------------------------------- report

def table(rows: list[DocRow], title: str):
    from rich.table import Table

    styles = {"done": "green", "skipped": "cyan", "running": "yellow", "queued": "dim", "failed": "bold red",
              "crashed": "bold red"}
    t = Table(title=f"{title}: {summary(rows)}", title_justify="left")
    for col in ("document", "state", "stage", "tries", "host", "detail", "run dir"):
        t.add_column(col, overflow="fold")
    for r in rows:
        t.add_row(r.document.rstrip("/").split("/")[-1], f"[{styles.get(r.state, '')}]{r.state}[/]", r.stage,
                  str(r.attempts), r.host, r.detail, r.run_dir)
    return t


def publish(rows: list[DocRow], name: str) -> None:
    """The table as ONE Prefect artifact, ``corpus-<name>`` (a new version each time it changes)."""
    from prefect.artifacts import create_table_artifact

    from .flows import _key

    try:
        create_table_artifact(key=_key("corpus", name), table=[r.as_dict() for r in rows],
                              description=f"corpus {name}: {summary(rows)}")
    except Exception:  # the table is also printed; an artifact must never fail the corpus
        pass


def deployment_defaults(deployment: str | None = None) -> dict[str, Any]:
    """The pipeline deployment's parameters and working directory (where relative runs land)."""
    from prefect.flows import load_flow_from_entrypoint

    name = deployment or f"{load_flow_from_entrypoint(PIPELINE_ENTRYPOINT).name}/{PIPELINE_DEPLOYMENT}"
    with api_client() as client:
        dep = client.read_deployment_by_name(name)
    working_dir = (dep.job_variables or {}).get("working_dir")
    return {"parameters": dict(dep.parameters or {}), "working_dir": working_dir}



# ------------------------------------------------------------------------------ the commands' glue

def is_corpus(documents: list[str] | None) -> bool:
    """More than one document, or one argument that stands for several (directory, glob, manifest)."""
    import os

    from ..orchestration.corpus import is_manifest

    if not documents:
        return False
    if len(documents) > 1:
        return True
    one = documents[0]
    return "://" not in one and (os.path.isdir(one) or any(c in one for c in "*?[") or is_manifest(one))


def check_single_document_flags(**given: Any) -> None:
    """Flags that address one run directory mean nothing for a corpus: say so instead of ignoring them."""
    from ..orchestration.corpus import CorpusError

    used = [f"--{k.rstrip('_').replace('_', '-')}" for k, v in given.items() if v]
    if used:
        raise CorpusError(f"{', '.join(used)} {'applies' if len(used) == 1 else 'apply'} to one document; a corpus gives each document its own run "
                          "directory (a manifest entry's run_dir) and resumes failed ones at their failed stage "
                          "by itself — drop the flag, or run that document alone")


def corpus_name(documents: list[str]) -> str:
    """The manifest's or directory's name; otherwise a short hash of the arguments."""
    import hashlib
    import os

    from .flows import _key

    if len(documents) == 1:
        stem = os.path.splitext(os.path.basename(documents[0].rstrip("/")))[0]
        if stem and not any(c in stem for c in "*?["):
            return _key(stem)
    return "corpus-" + hashlib.sha256("\0".join(documents).encode()).hexdigest()[:8]


def plan(documents: list[str], preset: str, config_file: str | None, overrides: list[str],
         runs_root: str) -> list[PlannedDoc]:
    from ..orchestration.corpus import expand, plan_entries
    from ..schemas.presets import load_config

    return plan_entries(expand(documents),
                        lambda e: load_config(preset, config_file, None, [*overrides, *e.overrides]), runs_root)


def trigger_command(documents: list[str], preset: str | None, config_file: str | None, overrides: list[str],
                    runs_root: str | None, name: str | None, llm_url: str | None, retries: int, wait: bool,
                    timeout_s: float, notify: Notify) -> list[DocRow]:
    """``nectar trigger`` of a corpus. The deployment's preset, config file and overrides apply unless
    given; every run gets them explicitly, so each run directory is the one computed here."""
    import os

    from .deploy import DeployError, llm_overrides_from_env

    dep = deployment_defaults()
    params = dep["parameters"]
    preset = preset or params.get("preset", "cpu")
    config_file = config_file or params.get("config_file")
    overrides = list(overrides or params.get("overrides") or [])
    if llm_url:  # one LLM server for every document's self-study and judging
        overrides += llm_overrides_from_env({"NECTAR_LLM_BASE_URL": llm_url, "NECTAR_LLM_BACKEND": "openai"})
    if runs_root is None:
        if not dep["working_dir"]:
            raise DeployError("the pipeline deployment has no working directory: give --runs DIR, a run "
                              "root every worker reaches (shared path or fsspec URL)")
        runs_root = os.path.join(dep["working_dir"], "runs")
    docs = plan(documents, preset, config_file, overrides, runs_root)
    opts = CorpusOptions(name or corpus_name(documents), preset, config_file, tuple(overrides), retries, timeout_s)
    rows, runs = submit(docs, opts, notify)
    if wait:
        rows = watch(rows, runs, opts, notify)
    return rows
