"""Which of a run's states answers (``nectar ask``, ``nectar serve``): the live pointer.

    <run>/state/live.json        {"stage": "first" | "train", "dir": "state/<sha16>", "reason": …}
    <run>/state/<sha16>/         module.safetensors + module.json, a copy named by the weights' sha256

A stage folder is cleared when the stage re-runs, so the live state is never read from one: the
first and promote stages copy the state they publish into a folder named by its content (written
once, each file atomically, never changed after) and only then replace ``live.json`` atomically.
A reader sees the old state or the new one, never a half-written one, and a re-run of ``first``
or ``train`` cannot pull the files from under a server. Runs made before the pointer existed
answer with their train stage's module.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import fsspec

from ..storage import atomic_write
from .executor import RunDir, now

LIVE = ("state", "live.json")
FILES = ("module.safetensors", "module.json")


@dataclass(frozen=True)
class LiveState:
    stage: str  # the stage that made it: "first" or "train"
    url: str  # the folder holding module.safetensors and module.json
    reason: str
    since: str | None = None
    module_sha256: str | None = None  # the weights' digest publish recorded; None for a run without a pointer


def _sha256(url: str) -> str:
    import hashlib

    fs, path = fsspec.core.url_to_fs(url)
    h = hashlib.sha256()
    with fs.open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def publish(run: RunDir, stage: str, reason: str, extra: dict[str, Any] | None = None) -> LiveState:
    """Make ``stage``'s module (in ``<run>/<stage>/``) the live state: copy it into its content-named
    folder (unless there already), then replace the pointer. Returns what is live now."""
    digest = _sha256(run.url(stage, FILES[0]))
    folder = ("state", digest[:16])
    if not run.exists(*folder, FILES[1]):  # module.json is written last: present ⇔ complete
        for name in FILES:
            fs, path = fsspec.core.url_to_fs(run.url(stage, name))
            atomic_write(run.url(*folder, name), fs.cat_file(path))
    record = {"stage": stage, "dir": "/".join(folder), "module_sha256": digest, "reason": reason, "since": now(),
              **(extra or {})}
    atomic_write(run.url(*LIVE), json.dumps(record, indent=1))
    return LiveState(stage, run.url(*folder), reason, record["since"])


def read_live(run: RunDir) -> LiveState | None:
    """The live state, or None when the run has none yet (no state of either stage)."""
    if run.exists(*LIVE):
        record = json.loads(run.fs.cat_file(run.local_path(*LIVE)))
        return LiveState(record["stage"], run.url(*record["dir"].split("/")), record["reason"], record.get("since"),
                         record.get("module_sha256"))
    if run.exists("train", "module.json"):  # a run made before the live pointer
        return LiveState("train", run.url("train"), "the train stage's module (no live pointer in this run)")
    return None


DECISION = ("promote", "decision.json")


def run_relative(run: RunDir, url: str) -> str:
    """``url`` as a path under the run's root ("state/<sha16>"), so a record stays right when the run
    directory is moved or copied; a url outside the run is returned as it is."""
    root = run.root.rstrip("/") + "/"
    return url[len(root):] if url.startswith(root) else url


def in_run(run: RunDir, path: str) -> str:
    """A folder a record names, as a url of this run: a run-relative path under its root; an absolute
    one (records written before they were relative) re-rooted at the shortest tail of it that this run
    holds (``/old/place/run/state/<sha16>`` → ``<run>/state/<sha16>``), else as it is."""
    if not (path.startswith("/") or "://" in path):
        return run.url(*path.split("/"))
    parts = [p for p in path.split("://", 1)[-1].split("/") if p]
    for k in range(1, len(parts) + 1):
        if run.exists(*parts[-k:]):
            return run.url(*parts[-k:])
    return path


def decision_record(run: RunDir, live: str, reason: str, state: LiveState, counts: dict[str, Any]) -> dict[str, Any]:
    """promote's ``decision.json``: the live stage, why, and its state's folder relative to the run's root."""
    return {"live": live, "reason": reason, "dir": run_relative(run, state.url), **counts}


def read_decision(run: RunDir) -> dict[str, Any] | None:
    """promote's ``decision.json`` with ``dir`` as a url of this run (relative or old absolute: ``in_run``);
    None when promote has not decided."""
    if not run.exists(*DECISION):
        return None
    record = json.loads(run.fs.cat_file(run.local_path(*DECISION)))
    if "dir" in record:
        record["dir"] = in_run(run, record["dir"])
    return record


def live_stage(run: RunDir) -> str | None:
    state = read_live(run)
    return state.stage if state else None


# The stages a run's states wait for, in the DAG's order: the first state after chunk → first (no
# LLM server); the refined one after every stage up to the promote stage that put it live.
FIRST_PATH = ("chunk", "first")
REFINED_PATH = ("chunk", "first", "synthesize", "verify", "targets", "train", "promote")


def seconds_to(run: RunDir, stages: tuple[str, ...]) -> float | None:
    """Seconds the stages took when they ran (their manifests' durations, summed): the time from the
    document to that state in a run that ran them in order; None when one has not completed."""
    total = 0.0
    for stage in stages:
        manifest = run.read_manifest(stage)
        if manifest is None:
            return None
        total += manifest.duration_s
    return total


def state_summary(run: RunDir) -> list[str]:
    """Lines for ``nectar run``: the time to the first usable state, to the refined one, which one
    answers now, where, and why, and which one the evaluation scored."""
    lines = []
    first_s = seconds_to(run, FIRST_PATH)
    if first_s is not None and run.exists("first", "module.json"):
        first = run.read_manifest("first")
        counts = first.counts
        if counts.get("refined") and "usable_s" in counts:  # the fit was live before the steps ended
            usable_s = first_s - first.duration_s + counts["usable_s"]
            lines.append(f"first usable state: {usable_s:.1f} s from the document (chunk → first's fit, no LLM "
                         f"server); refined end to end on the reconstruction at {first_s:.1f} s ({run.url('first')})")
        else:
            lines.append(f"first usable state: {first_s:.1f} s from the document (chunk → first, no LLM server; "
                         f"{run.url('first')})")
    refined_s = seconds_to(run, REFINED_PATH)
    if refined_s is not None:
        lines.append(f"refined state: {refined_s:.1f} s (every stage through promote; {run.url('train')})")
    state = read_live(run)
    if state is not None:
        lines.append(f"live: {state.stage} state at {state.url} — {state.reason}")
    evaluated = evaluated_line(run, state)
    if evaluated:
        lines.append(evaluated)
    return lines


def evaluated_line(run: RunDir, live: LiveState | None) -> str | None:
    """Which state the run's evaluation scored, and a warning when the live state has moved since
    (its report would then describe a state nobody is served)."""
    manifest = run.read_manifest("evaluate")
    if manifest is None:
        return None
    counts = manifest.counts
    scored = counts.get("scored_state", "train")  # an evaluation that does not say scored train's module
    if live is None:
        current = True
    elif live.module_sha256 and "scored_module_sha256" in counts:
        current = live.module_sha256 == counts["scored_module_sha256"]
    else:
        current = live.stage == scored
    line = f"evaluated: the {scored} state ({run.url('evaluate', 'report.html')})"
    return line if current else (f"{line} — not the live {live.stage} state; re-score it: "
                                 f"nectar run --run-dir {run.root} --only evaluate")
