"""Run directories, stage manifests and cache-keyed stage execution (docs/design.md §4).

    runs/<doc-id>/<run-id>/
        run.json                 RunManifest
        document/                the document text and DocumentInfo
        <stage>/...              the stage's outputs
        <stage>/manifest.json    written LAST, atomically: present ⇔ the stage completed

A stage is skipped when its manifest's cache key — stage config minus resource-only fields, input
hashes and code version — matches. Nothing here imports Prefect: flows and the CLI call ``run_stage``.
"""
from __future__ import annotations

import json
import re
import sys
import time
import traceback
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Callable

import fsspec

from .. import __version__, integrity, shutdown
from ..schemas.artifacts import StageManifest
from ..schemas.base import FrozenConfig, stable_hash
from ..schemas.config import STAGES
from ..storage import atomic_write, written_digests
from ..tables import ArtifactError, read_json_artifact, write_json_artifact

CODE_VERSION = __version__


def now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip("-").lower()[:48] or "doc"


def doc_id_for(name: str, sha256: str) -> str:
    return f"{slug(name)}-{sha256[:8]}"


@dataclass(frozen=True)
class RunDir:
    """A run's root: a local path or any fsspec URL (``memory://``, ``s3://``, …)."""

    root: str

    @property
    def fs(self) -> fsspec.AbstractFileSystem:
        return fsspec.core.url_to_fs(self.root)[0]

    def url(self, *parts: str) -> str:
        return "/".join([self.root.rstrip("/"), *parts])

    def local_path(self, *parts: str) -> str:
        """Path for libraries that need a local file (torch, zarr local store): the fs path."""
        return fsspec.core.url_to_fs(self.url(*parts))[1]

    def exists(self, *parts: str) -> bool:
        fs, path = fsspec.core.url_to_fs(self.url(*parts))
        return fs.exists(path)

    def makedirs(self, *parts: str) -> str:
        fs, path = fsspec.core.url_to_fs(self.url(*parts))
        fs.makedirs(path, exist_ok=True)
        return self.url(*parts)

    def manifest_url(self, stage: str) -> str:
        return self.url(stage, "manifest.json")

    def read_manifest(self, stage: str) -> StageManifest | None:
        if not self.exists(stage, "manifest.json"):
            return None
        return read_json_artifact(self.manifest_url(stage), StageManifest)

    def invalidate(self, stage: str) -> None:
        """Remove a stage's manifest so it (and so everything downstream) is redone."""
        fs, path = fsspec.core.url_to_fs(self.manifest_url(stage))
        if fs.exists(path):
            fs.rm(path)

    def write_error(self, stage: str, message: str) -> None:
        atomic_write(self.url(stage, "error.json"),
                     json.dumps({"stage": stage, "at": now(), "error": message}, indent=2))

    def read_json(self, *parts: str) -> Any:
        """The JSON file at ``parts`` under the run, or None when there is none."""
        fs, path = fsspec.core.url_to_fs(self.url(*parts))
        if not fs.exists(path):
            return None
        with fs.open(path, "r") as f:
            return json.load(f)

    def read_error(self, stage: str) -> dict[str, Any] | None:
        return self.read_json(stage, "error.json")

    def clear_error(self, stage: str) -> None:
        fs, path = fsspec.core.url_to_fs(self.url(stage, "error.json"))
        if fs.exists(path):
            fs.rm(path)


def hash_url(url: str) -> str:
    """Content digest of a file (sha256) or of a folder (``tree:`` over its files' sha256)."""
    fs, path = fsspec.core.url_to_fs(url)
    parent, name = path.rstrip("/").rsplit("/", 1) if "/" in path.rstrip("/") else ("", path)
    files = integrity.digest_outputs(fs, parent, [name])
    return integrity.output_digest(files, name)


def cache_key(stage: str, config: FrozenConfig | dict[str, Any], inputs: dict[str, str],
              code: str | None = None) -> str:
    """What a stage's result is a function of: its config (minus resource-only fields), the content
    digests of its inputs and the digest of the code it runs (``code``; default: the release)."""
    cfg = config.cache_dict() if isinstance(config, FrozenConfig) else config
    return stable_hash({"stage": stage, "config": cfg, "inputs": inputs, "code": code or CODE_VERSION})


@dataclass
class StageOutcome:
    stage: str
    status: str  # "done" | "cached"
    manifest: StageManifest
    outputs: dict[str, str] = field(default_factory=dict)


class StageError(Exception):
    """A stage failed, and its failure is recorded in the run directory (``<stage>/error.json``).

    ``stage`` names the stage and ``cause`` is what it raised (also ``__cause__``): the CLI's one line
    names the stage and classifies the cause (``nectar.pipeline.errors``). ``KeyboardInterrupt`` and
    other non-``Exception`` exits are recorded too but pass through unwrapped."""

    def __init__(self, stage: str, cause: BaseException):
        super().__init__(stage, cause)  # both in args: the exception pickles (Prefect results)
        self.stage, self.cause = stage, cause

    def __str__(self) -> str:
        return str(self.cause)


# What a stage body returns: the output files (relative to the stage dir) and its counts.
StageResult = tuple[list[str], dict[str, Any]]
# Redo only the damaged part of a stage's outputs: given the changed files, fix the stage's own
# resume state so its body rebuilds them; return the changes it did not handle.
Repair = Callable[[str, list[integrity.Change]], list[integrity.Change]]
# Word a body's exception for the user before it is recorded: the same one (e.g. with a hint added)
# or a clearer one (its ``__cause__`` the original).
Explain = Callable[[Exception], Exception]
ATTEMPT = "attempt.json"  # the cache key the stage's partial files were made for


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def check_stage(run: RunDir, stage: str, manifest: StageManifest) -> list[integrity.Change]:
    """How a completed stage's outputs differ from its manifest (empty: intact; reads every byte)."""
    if manifest.outputs and not manifest.files:
        return [integrity.Change("manifest.json", "unrecorded")]
    fs, path = fsspec.core.url_to_fs(run.url(stage))
    return integrity.check_outputs(fs, path, manifest.files, manifest.outputs)


def run_stage(
    run: RunDir,
    stage: str,
    config: FrozenConfig | dict[str, Any],
    inputs: dict[str, str],
    body: Callable[[str], StageResult],
    force: bool = False,
    code: str | None = None,
    repair: Repair | None = None,
    notify: Callable[[str], None] = _stderr,
    explain: Explain | None = None,
) -> StageOutcome:
    """Run ``body(stage_url)`` unless a manifest with the same cache key exists AND the outputs on
    disk still match the digests it recorded.

    The manifest is removed before the body starts and written after it returns, so a run killed
    mid-stage never looks complete. The body resumes from the partial files it left only when
    they were made for the same cache key (``attempt.json``) and the run isn't forced; otherwise
    the stage folder starts empty. Damaged outputs of a completed stage are removed (or handed to
    ``repair``) and the body rebuilds them, with one line through ``notify`` naming the file. An
    exception of the body is recorded (and raised as ``StageError``) as ``explain`` words it, when
    given. The stage is named as the one running throughout (``shutdown.doing``: a stop says so).
    """
    if stage not in STAGES and stage != "document":
        raise ValueError(f"unknown stage {stage!r}")
    code = code or CODE_VERSION
    key = cache_key(stage, config, inputs, code)
    with shutdown.doing(stage):
        try:
            existing = run.read_manifest(stage)
        except ArtifactError as exc:
            notify(f"{stage}: {exc}; redoing {stage}")
            existing = None
        damaged: list[integrity.Change] = []
        if existing is not None and existing.cache_key == key and not force:
            damaged = check_stage(run, stage, existing)
            if not damaged:
                _record_invocation(run, stage, "cached")
                return StageOutcome(stage, "cached", existing, existing.outputs)
            notify(f"{stage}: {integrity.summarize(stage, damaged)} since the stage completed; redoing {stage}")
        run.invalidate(stage)
        run.clear_error(stage)
        if damaged:
            _remove_damaged(run, stage, existing, damaged, repair)
        elif force or _attempt_key(run, stage) != key:
            _clear_stage(run, stage)  # partial files of another configuration/inputs/code, or a forced redo
        stage_url = run.makedirs(stage)
        atomic_write(run.url(stage, ATTEMPT), json.dumps({"cache_key": key, "started_at": now()}))
        started, t0 = now(), time.perf_counter()
        try:
            with written_digests(stage_url) as written:
                files, counts = body(stage_url)
            fs, path = fsspec.core.url_to_fs(stage_url)
            digests = integrity.digest_outputs(fs, path, files, written)
        except BaseException as exc:
            if explain is not None and isinstance(exc, Exception):
                exc = explain(exc)
            _record_stage_failure(run, stage, exc, notify)
            if not isinstance(exc, Exception):
                raise
            raise StageError(stage, exc) from exc
        outputs = {name: integrity.output_digest(digests, name) for name in files}
        cfg = config.cache_dict() if isinstance(config, FrozenConfig) else config
        manifest = StageManifest(
            stage=stage, cache_key=key, config=cfg, inputs=inputs, outputs=outputs,
            code_version=code, counts=counts, started_at=started, finished_at=now(),
            duration_s=round(time.perf_counter() - t0, 3), files=digests,
        )
        write_json_artifact(run.manifest_url(stage), manifest)
        _record_invocation(run, stage, "done")
        return StageOutcome(stage, "done", manifest, outputs)


def _record_stage_failure(run: RunDir, stage: str, exc: BaseException, notify: Callable[[str], None]) -> None:
    """error.json and the invocation record of a body that raised ``exc`` (an interruption says the
    next run resumes); a failure to record it (e.g. the full disk that failed the stage) is told."""
    try:
        stop, _ = shutdown.stopped_by()
        if isinstance(exc, KeyboardInterrupt) or stop is not None:  # asked to stop: the next run resumes
            why = str(stop or exc) or "SIGINT (Ctrl-C)"
            run.write_error(stage, f"interrupted: {why}; the next run resumes this stage")
        else:
            run.write_error(stage, f"{type(exc).__name__}: {exc}\n{''.join(traceback.format_exception(exc, limit=6))}")
        _record_invocation(run, stage, "failed")
    except OSError as record_exc:
        notify(f"{stage}: could not record the failure in {run.url(stage)} ({record_exc})")


def _attempt_key(run: RunDir, stage: str) -> str | None:
    fs, path = fsspec.core.url_to_fs(run.url(stage, ATTEMPT))
    try:
        return json.loads(fs.cat_file(path)).get("cache_key")
    except (FileNotFoundError, ValueError, AttributeError):
        return None


def _clear_stage(run: RunDir, stage: str) -> None:
    fs, path = fsspec.core.url_to_fs(run.url(stage))
    if fs.exists(path):
        fs.rm(path, recursive=True)


def _remove_damaged(run: RunDir, stage: str, manifest: StageManifest, damaged: list[integrity.Change],
                    repair: Repair | None) -> None:
    """Remove what changed so the body rebuilds it: a damaged file, or the whole folder output a
    damaged file belongs to (unless ``repair`` can redo just that part)."""
    left = repair(run.url(stage), damaged) if repair is not None else damaged
    fs, base = fsspec.core.url_to_fs(run.url(stage))
    for change in left:
        owner = next((name for name in manifest.outputs
                      if change.path == name or change.path.startswith(name.rstrip("/") + "/")), None)
        if owner is None:  # e.g. the manifest itself recorded nothing: start the stage over
            _clear_stage(run, stage)
            return
        target = f"{base}/{owner}"
        if fs.exists(target):
            fs.rm(target, recursive=True)


def record_failure(run: RunDir, stage: str, exc: BaseException) -> BaseException:
    """For failures before a stage's body started (bad inputs, imports): the same traces as in-body
    ones. Returns what to raise: a ``StageError`` naming the stage (``exc`` itself when it already is
    one, recorded by ``run_stage``, or when it is no ``Exception``, e.g. ``KeyboardInterrupt``)."""
    if isinstance(exc, StageError):
        return exc
    run.write_error(stage, f"{type(exc).__name__}: {exc}")
    _record_invocation(run, stage, "failed")
    return StageError(stage, exc) if isinstance(exc, Exception) else exc


def _record_invocation(run: RunDir, stage: str, status: str) -> None:
    """What the latest invocation of a stage did (done / cached / failed), for `nectar status`."""
    atomic_write(run.url(stage, "last_invocation.json"), json.dumps({"status": status, "at": now()}))


def last_invocation(run: RunDir, stage: str) -> dict[str, Any] | None:
    return run.read_json(stage, "last_invocation.json")


def stale_reason(run: RunDir, stage: str, manifest: StageManifest) -> str | None:
    """Why a completed stage no longer counts as cached, or None: an upstream result it was made
    from has changed (lineage), or its own outputs differ from their digests (integrity)."""
    for name, digest in manifest.inputs.items():
        up, _, rel = name.partition("/")
        if not rel or up not in STAGES:
            continue
        upstream = _upstream_manifest(run, up)
        if upstream is None or upstream.outputs.get(rel) != digest:
            return f"its input {name} changed since it ran (re-run {up} and what follows)"
    changes = check_stage(run, stage, manifest)
    return integrity.summarize(stage, changes) if changes else None


def _upstream_manifest(run: RunDir, stage: str) -> StageManifest | None:
    """The manifest of ``stage`` as this run reads it (a sweep variant reads its parent's)."""
    try:
        manifest = run.read_manifest(stage)
        if manifest is None and run.exists("run.json"):
            parent = json.loads(run.fs.cat_file(run.local_path("run.json"))).get("parent_run")
            if parent:
                manifest = RunDir(parent).read_manifest(stage)
        return manifest
    except (ArtifactError, ValueError):
        return None


def stage_status(run: RunDir, stage: str, verify: bool = True) -> dict[str, Any]:
    """done / cached / stale / failed / missing, with the manifest's counts and the last error.

    ``stale``: completed, but an input changed since or its outputs no longer match the manifest's
    digests (``verify``: reads every output byte); the next ``nectar run`` redoes it.
    """
    try:
        manifest = run.read_manifest(stage)
    except ArtifactError as exc:
        return {"stage": stage, "state": "stale", "counts": {}, "duration_s": None, "finished_at": None,
                "error": None, "stale": str(exc)}
    last = last_invocation(run, stage) or {}
    error = run.read_error(stage)
    stale = None
    if last.get("status") == "failed" or (manifest is None and error):
        state = "failed"
    elif manifest is None:
        state = "missing"
    else:
        state = last.get("status", "done")
        stale = stale_reason(run, stage, manifest) if verify else None
        if stale:
            state = "stale"
    return {"stage": stage, "state": state, "counts": manifest.counts if manifest else {},
            "duration_s": manifest.duration_s if manifest else None,
            "finished_at": manifest.finished_at if manifest else None,
            "error": (error or {}).get("error") if state == "failed" else None, "stale": stale}
