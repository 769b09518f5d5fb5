"""Run directories, stage manifests and cache-keyed stage execution (DESIGN.md §4).

    runs/<doc-id>/<run-id>/
        run.json                 RunManifest
        document/                the document text and DocumentInfo
        <stage>/...              the stage's outputs
        <stage>/manifest.json    written LAST, atomically: present ⇔ the stage completed

A stage is skipped when its manifest's cache key — stage config minus resource-only fields, input
hashes and code version — matches. Nothing here imports Prefect: flows and the CLI call ``run_stage``.
"""
from __future__ import annotations

import hashlib
import json
import re
import time
import traceback
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Callable

import fsspec

from . import __version__
from .schemas.artifacts import StageManifest
from .schemas.base import FrozenConfig, stable_hash
from .schemas.config import STAGES
from .storage import atomic_write
from .tables import ArtifactError, read_json_artifact, write_json_artifact

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

    def read_error(self, stage: str) -> dict[str, Any] | None:
        fs, path = fsspec.core.url_to_fs(self.url(stage, "error.json"))
        if not fs.exists(path):
            return None
        with fs.open(path, "r") as f:
            return json.load(f)

    def clear_error(self, stage: str) -> None:
        fs, path = fsspec.core.url_to_fs(self.url(stage, "error.json"))
        if fs.exists(path):
            fs.rm(path)


def hash_url(url: str) -> str:
    """Content hash of a file, or of a directory's listing (names and sizes) for large stores."""
    fs, path = fsspec.core.url_to_fs(url)
    if not fs.exists(path):
        raise ArtifactError(f"{url}: missing")
    h = hashlib.sha256()
    if fs.isdir(path):
        for info in sorted(fs.find(path, detail=True).values(), key=lambda i: i["name"]):
            rel = info["name"][len(path):]
            if rel.endswith("manifest.json"):
                continue
            h.update(f"{rel}:{info.get('size')}".encode())
            if info.get("size", 0) <= 1 << 16:  # small files (metadata, headers): hash contents
                h.update(fs.cat_file(info["name"]))
        return "dir:" + h.hexdigest()
    with fs.open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def cache_key(stage: str, config: FrozenConfig | dict[str, Any], inputs: dict[str, str]) -> str:
    cfg = config.cache_dict() if isinstance(config, FrozenConfig) else config
    return stable_hash({"stage": stage, "config": cfg, "inputs": inputs, "code": CODE_VERSION})


@dataclass
class StageOutcome:
    stage: str
    status: str  # "done" | "cached"
    manifest: StageManifest
    outputs: dict[str, str] = field(default_factory=dict)


class StageFailed(RuntimeError):
    def __init__(self, stage: str, message: str):
        super().__init__(f"stage {stage!r} failed: {message}")
        self.stage = stage
        self.message = message


# What a stage body returns: the output files (relative to the stage dir) and its counts.
StageResult = tuple[list[str], dict[str, Any]]


def run_stage(
    run: RunDir,
    stage: str,
    config: FrozenConfig | dict[str, Any],
    inputs: dict[str, str],
    body: Callable[[str], StageResult],
    force: bool = False,
) -> StageOutcome:
    """Run ``body(stage_url)`` unless a manifest with the same cache key exists.

    The manifest is removed before the body starts and written after it returns, so a run killed
    mid-stage never looks complete; the body itself resumes from whatever partial files it left.
    """
    if stage not in STAGES and stage != "document":
        raise ValueError(f"unknown stage {stage!r}")
    key = cache_key(stage, config, inputs)
    existing = run.read_manifest(stage)
    if existing is not None and existing.cache_key == key and not force:
        _record_invocation(run, stage, "cached")
        return StageOutcome(stage, "cached", existing, existing.outputs)
    run.invalidate(stage)
    run.clear_error(stage)
    stage_url = run.makedirs(stage)
    started, t0 = now(), time.perf_counter()
    try:
        files, counts = body(stage_url)
    except BaseException as exc:
        run.write_error(stage, f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=6)}")
        _record_invocation(run, stage, "failed")
        try:
            exc._nectar_recorded = True  # so callers don't record it twice
        except AttributeError:
            pass
        raise
    outputs = {name: hash_url(run.url(stage, name)) for name in files}
    cfg = config.cache_dict() if isinstance(config, FrozenConfig) else config
    manifest = StageManifest(
        stage=stage, cache_key=key, config=cfg, inputs=inputs, outputs=outputs,
        code_version=CODE_VERSION, counts=counts, started_at=started, finished_at=now(),
        duration_s=round(time.perf_counter() - t0, 3),
    )
    write_json_artifact(run.manifest_url(stage), manifest)
    _record_invocation(run, stage, "done")
    return StageOutcome(stage, "done", manifest, outputs)


def record_failure(run: RunDir, stage: str, exc: BaseException) -> None:
    """For failures before a stage's body started (bad inputs, imports): same traces as in-body ones."""
    if getattr(exc, "_nectar_recorded", False):
        return
    run.write_error(stage, f"{type(exc).__name__}: {exc}")
    _record_invocation(run, stage, "failed")


def _record_invocation(run: RunDir, stage: str, status: str) -> None:
    """What the latest invocation of a stage did (done / cached / failed), for `nectar status`."""
    atomic_write(run.url(stage, "last_invocation.json"), json.dumps({"status": status, "at": now()}))


def last_invocation(run: RunDir, stage: str) -> dict[str, Any] | None:
    fs, path = fsspec.core.url_to_fs(run.url(stage, "last_invocation.json"))
    if not fs.exists(path):
        return None
    with fs.open(path, "r") as f:
        return json.load(f)


def stage_status(run: RunDir, stage: str) -> dict[str, Any]:
    """done / cached / failed / missing, with the manifest's counts and the last error."""
    manifest = run.read_manifest(stage)
    last = last_invocation(run, stage) or {}
    error = run.read_error(stage)
    if last.get("status") == "failed" or (manifest is None and error):
        state = "failed"
    elif manifest is None:
        state = "missing"
    else:
        state = last.get("status", "done")
    return {"stage": stage, "state": state, "counts": manifest.counts if manifest else {},
            "duration_s": manifest.duration_s if manifest else None,
            "finished_at": manifest.finished_at if manifest else None,
            "error": (error or {}).get("error") if state == "failed" else None}
