"""``nectar status DIR``: a terminal view of every run under a directory (or one run).

Reads only what the runs themselves wrote (docs/design.md §4) — ``run.json``, each stage's
``manifest.json`` (present ⇔ the stage completed) and ``error.json`` (written when a stage raised) —
so it works on any fsspec URL, with or without a Prefect server, and while a run is in progress.

    DIR may be   runs/<doc-id>/<run-id>   one run (holds run.json)
                 runs/<doc-id>            every run of one document
                 runs                     every run of every document
"""
from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from typing import Any, Iterable

import fsspec

from ..orchestration.executor import RunDir
from ..orchestration.executor import stage_status as runs_stage_status
from ..schemas.artifacts import RunManifest
from ..schemas.config import STAGES
from ..tables import ArtifactError, read_json_artifact

# done: completed by its latest invocation; cached: completed earlier, the latest invocation skipped it
# stale: completed, but an input changed since or an output no longer matches its recorded digest
#        (the next run redoes it)
# failed: its latest invocation raised (error.json holds the message and a short traceback)
# partial: the stage folder exists with no manifest and no error (running now, or killed mid-stage)
# missing: nothing yet; not available: this build has no implementation of the stage
STATES = ("done", "cached", "stale", "failed", "partial", "missing", "not available")


@dataclass(frozen=True)
class StageStatus:
    stage: str
    state: str
    counts: dict[str, Any] = field(default_factory=dict)
    finished_at: str | None = None
    duration_s: float | None = None
    error: str | None = None  # the full error text from error.json
    error_at: str | None = None
    rerun: str | None = None  # the command that re-runs this stage on the existing inputs
    stale: str | None = None  # why a completed stage is stale (which input or output changed)

    @property
    def error_summary(self) -> str | None:
        """The exception line (error.json holds the message first, then a short traceback)."""
        return self.error.strip().splitlines()[0] if self.error else None


@dataclass(frozen=True)
class RunStatus:
    run_dir: str
    doc_id: str
    run_id: str
    source_uri: str
    preset: str | None
    created_at: str | None
    stages: tuple[StageStatus, ...]
    problem: str | None = None  # run.json missing or invalid

    @property
    def state(self) -> str:
        states = [s.state for s in self.stages]
        if self.problem:
            return "invalid"
        if "failed" in states:
            return "failed"
        if "stale" in states:
            return "stale"
        if all(s in ("done", "cached", "not available") for s in states):
            return "complete"
        return "incomplete"

    @property
    def last_error(self) -> StageStatus | None:
        failed = [s for s in self.stages if s.state == "failed"]
        return max(failed, key=lambda s: s.error_at or "") if failed else None


def available_stages() -> set[str]:
    """Stages this build implements (the orchestrator's list)."""
    from ..orchestration import available_stages as implemented

    return set(implemented())


def rerun_command(run_dir: str, stage: str, source_uri: str | None = None) -> str:
    """The command that re-runs one stage on the run's existing inputs (config from its run.json)."""
    if source_uri and source_uri != "?":
        return f"nectar run {shlex.quote(source_uri)} --run-dir {shlex.quote(run_dir)} --only {stage}"
    return f"nectar rerun {shlex.quote(run_dir)} {stage}"


def find_runs(root: str, max_depth: int = 2) -> list[RunDir]:
    """Run directories at ``root`` or up to ``max_depth`` levels below it (those with run.json)."""
    fs, path = fsspec.core.url_to_fs(root)
    if not fs.exists(path):
        raise FileNotFoundError(f"{root}: no such directory")
    if fs.exists(f"{path.rstrip('/')}/run.json"):
        return [RunDir(root.rstrip("/"))]
    found: list[RunDir] = []
    for depth in range(1, max_depth + 1):
        pattern = "/".join([path.rstrip("/"), *["*"] * depth, "run.json"])
        for hit in sorted(fs.glob(pattern)):
            rel = hit[len(path.rstrip("/")) + 1 : -len("/run.json")]
            found.append(RunDir(f"{root.rstrip('/')}/{rel}"))
    return found


def stage_status(run: RunDir, stage: str, available: set[str], source_uri: str | None = None) -> StageStatus:
    st = runs_stage_status(run, stage)  # done / cached / failed / missing, from the run directory
    state, rerun = st["state"], rerun_command(run.root, stage, source_uri)
    if state == "missing":
        if stage not in available:
            return StageStatus(stage, "not available")
        if not run.exists(stage):
            return StageStatus(stage, "missing")
        state = "partial"
    error = run.read_error(stage) if state == "failed" else None
    return StageStatus(stage, state, dict(st["counts"]), st["finished_at"], st["duration_s"],
                       error=st["error"], error_at=(error or {}).get("at"), rerun=rerun, stale=st.get("stale"))


def run_status(run: RunDir, available: set[str] | None = None) -> RunStatus:
    available = available_stages() if available is None else available
    parts = run.root.rstrip("/").split("/")
    try:
        info = read_json_artifact(run.url("run.json"), RunManifest)
    except ArtifactError as exc:
        stages = tuple(stage_status(run, s, available) for s in STAGES)
        return RunStatus(run.root, parts[-2] if len(parts) > 1 else "?", parts[-1], "?", None,
                         None, stages, problem=str(exc))
    stages = tuple(stage_status(run, s, available, info.source_uri) for s in STAGES)
    return RunStatus(run.root, info.doc_id, info.run_id, info.source_uri,
                     info.config.get("preset"), info.created_at, stages)


def collect(root: str, available: set[str] | None = None) -> list[RunStatus]:
    """Status of every run under ``root``, oldest first."""
    available = available_stages() if available is None else available
    runs = [run_status(r, available) for r in find_runs(root)]
    return sorted(runs, key=lambda r: (r.doc_id, r.created_at or ""))


# ------------------------------------------------------------------------------------ rendering

_STYLE = {"done": "green", "cached": "cyan", "stale": "magenta", "failed": "bold red", "partial": "yellow",
          "missing": "dim", "not available": "dim italic"}


def _format_counts(counts: dict[str, Any], limit: int = 4) -> str:
    """The first few scalar counts: enough to see at a glance what a stage produced."""
    items = [(k, v) for k, v in counts.items() if isinstance(v, (int, float, str, bool))]
    text = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in items[:limit])
    return text + (", …" if len(items) > limit else "")


def run_table(status: RunStatus):
    from rich.table import Table

    title = f"{status.doc_id} / {status.run_id}  \\[{status.state}]"  # \\[: a literal bracket, not rich markup
    caption = f"{status.run_dir}  ·  source {status.source_uri}  ·  preset {status.preset or '?'}"
    table = Table(title=title, caption=caption, title_justify="left", caption_justify="left")
    for col in ("stage", "state", "counts", "finished", "s"):
        table.add_column(col, no_wrap=col in ("stage", "state"))
    for s in status.stages:
        detail = (s.error_summary if s.state == "failed" else f"stale: {s.stale}" if s.state == "stale"
                  else _format_counts(s.counts))
        table.add_row(s.stage, f"[{_STYLE[s.state]}]{s.state}[/]", detail or "",
                      s.finished_at or s.error_at or "", "" if s.duration_s is None else f"{s.duration_s:.1f}")
    return table


def corpus_table(statuses: list[RunStatus]):
    """One row per run: its state, the stage it stopped at (failed, or the next to run), stages done."""
    from rich.table import Table

    counts: dict[str, int] = {}
    for st in statuses:
        counts[st.state] = counts.get(st.state, 0) + 1
    table = Table(title=f"{len(statuses)} runs: " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())),
                  title_justify="left")
    for col in ("document", "run", "state", "stage", "stages done", "source"):
        table.add_column(col, overflow="fold")
    style = {"complete": "green", "failed": "bold red", "stale": "magenta", "incomplete": "yellow", "invalid": "red"}
    for st in statuses:
        failed = st.last_error
        nxt = next((s.stage for s in st.stages if s.state not in ("done", "cached", "not available")), "")
        done = sum(s.state in ("done", "cached") for s in st.stages)
        table.add_row(st.doc_id, st.run_id, f"[{style.get(st.state, '')}]{st.state}[/]",
                      f"{failed.stage}: {failed.error_summary}"[:120] if failed else nxt, str(done), st.source_uri)
    return table


def render(statuses: Iterable[RunStatus], console=None) -> None:
    """Print one table per run, then the last error and the command that re-runs the stage."""
    from rich.console import Console

    console = console or Console()
    statuses = list(statuses)
    if not statuses:
        console.print("no runs found (a run directory holds run.json)")
        return
    if len(statuses) > 1:  # a corpus: one line per run first, then each run's stages
        console.print(corpus_table(statuses))
        console.print()
    for status in statuses:
        console.print(run_table(status))
        if status.problem:
            console.print(f"[red]run.json: {status.problem}[/]")
        failed = status.last_error
        if failed is not None:
            console.print(f"[bold red]{failed.stage} failed[/] at {failed.error_at}: {failed.error_summary}")
            console.print(f"  fix the cause, then re-run it: [bold]{failed.rerun}[/]")
            console.print(f"  or on a worker: [bold]{rerun_command(status.run_dir, failed.stage)}[/]")
        console.print()


def print_runs_status(root: str, console=None) -> None:
    """``nectar status DIR`` for a folder of runs (or one run)."""
    render(collect(root), console)


def status_json(statuses: Iterable[RunStatus]) -> list[dict[str, Any]]:
    """Plain data for ``nectar status --json`` (scripts, dashboards)."""
    out = []
    for r in statuses:
        out.append({
            "run_dir": r.run_dir, "doc_id": r.doc_id, "run_id": r.run_id, "source_uri": r.source_uri,
            "preset": r.preset, "created_at": r.created_at, "state": r.state, "problem": r.problem,
            "stages": [{"stage": s.stage, "state": s.state, "counts": s.counts,
                        "finished_at": s.finished_at, "duration_s": s.duration_s,
                        "error": s.error_summary, "error_at": s.error_at, "rerun": s.rerun, "stale": s.stale}
                       for s in r.stages],
        })
    return out
