"""A run directory's lifecycle: create it for a document and configuration, or reopen it."""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Callable

from pydantic import ValidationError

from ..documents import load_document
from ..layout import ContextTooLongError
from .executor import CODE_VERSION, RunDir, doc_id_for, now, slug
from ..schemas.artifacts import DocumentInfo, RunManifest
from ..schemas.base import stable_hash
from ..schemas.config import PipelineConfig
from ..storage import atomic_write
from ..tables import ArtifactError, read_json_artifact, write_json_artifact

Progress = Callable[[int, int], None]
ProgressFactory = Callable[[str], Progress]

SHARED_DATA_STAGES = ("chunk", "synthesize", "verify", "targets")


class StageInputError(RuntimeError):
    """A stage was asked to run before the stages it reads from completed."""


class RunDirMismatch(StageInputError):
    """The run directory holds a run of another document."""


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@dataclass
class RunContext:
    run: RunDir
    config: PipelineConfig
    text: str
    info: DocumentInfo
    progress: ProgressFactory

    parent: RunDir | None = None  # sweep variants share the parent run's data stages
    notify: Callable[[str], None] = _stderr  # one-line notices (a stage redone because a file changed)

    @property
    def doc_id(self) -> str:
        return self.info.doc_id

    def stage_run(self, stage: str) -> RunDir:
        """The run directory holding ``stage``'s outputs (the parent's, for shared data stages)."""
        if self.parent is not None and stage in SHARED_DATA_STAGES:
            return self.parent
        return self.run


def _no_progress(stage: str) -> Progress:
    return lambda done, total: None


def default_run_dir(doc_id: str, config: PipelineConfig, root: str = "runs") -> str:
    run_id = f"{slug(config.preset)}-{stable_hash(config.cache_dict())[:8]}"
    return f"{root.rstrip('/')}/{doc_id}/{run_id}"


@dataclass(frozen=True)
class CheckedRun:
    """A document and configuration that passed every check, and the run directory they go to."""

    run: RunDir
    text: str
    info: DocumentInfo
    reopen: bool = False  # an existing run re-run with its own configuration (``--only``)


def check_run(document: str, config: PipelineConfig, run_dir: str | None = None) -> CheckedRun:
    """Everything ``prepare_run`` checks, writing nothing: the document (readable UTF-8 text that
    fits the model's window with the longest query) and a run directory that is new or holds a
    run of the same document. Raises DocumentError / ContextTooLongError / RunDirMismatch."""
    text, source = load_document(document)
    doc_id = doc_id_for(source.name, source.sha256)
    run = RunDir(run_dir or default_run_dir(doc_id, config))
    _check_owner(run, doc_id, document)
    try:
        n = _context_tokens(config, text)
    except ContextTooLongError as exc:
        raise ContextTooLongError(f"{document} (model {config.model.name}): {exc}") from None
    info = DocumentInfo(doc_id=doc_id, source_uri=source.uri, sha256=source.sha256, n_chars=len(text),
                        n_words=len(text.split()), n_context_tokens=n, model=config.model.name)
    return CheckedRun(run, text, info)


def _check_owner(run: RunDir, doc_id: str, document: str) -> None:
    if run.exists("run.json"):
        existing = read_json_artifact(run.url("run.json"), RunManifest)
        if existing.doc_id != doc_id:
            raise RunDirMismatch(
                f"{run.root} holds a run of another document ({existing.doc_id}, from {existing.source_uri}), "
                f"not of {document} ({doc_id}); give another --run-dir, or leave it out for the default")


def check_request(document: str | None, config: PipelineConfig, run_dir: str | None = None,
                  only_stage: str | None = None) -> CheckedRun:
    """What ``nectar run`` is asked to do, checked before anything starts. ``--only STAGE`` on an
    existing run directory re-runs that stage with the run's own configuration (its run.json), and
    the document, when given, must be the run's; on a new directory it is a fresh run."""
    if only_stage and run_dir and RunDir(run_dir).exists("run.json"):
        ctx = open_run(run_dir)
        if document is not None:
            _, source = load_document(document)
            if source.sha256 != ctx.info.sha256:
                _check_owner(ctx.run, doc_id_for(source.name, source.sha256), document)
                raise RunDirMismatch(f"{run_dir} holds a run of {ctx.info.source_uri} (sha256 "
                                     f"{ctx.info.sha256[:12]}…); {document} has sha256 {source.sha256[:12]}…")
        return CheckedRun(ctx.run, ctx.text, ctx.info, reopen=True)
    from ..documents import DEFAULT_DOCUMENT

    return check_run(document or DEFAULT_DOCUMENT, config, run_dir)


def prepare_run(document: str, config: PipelineConfig, run_dir: str | None = None,
                progress: ProgressFactory = _no_progress, checked: CheckedRun | None = None) -> RunContext:
    """Load and validate the document, then create (or reopen) its run directory."""
    checked = checked or check_run(document, config, run_dir)
    run, info = checked.run, checked.info
    write_json_artifact(run.url("run.json"), RunManifest(
        doc_id=info.doc_id, run_id=run.root.rstrip("/").split("/")[-1], source_uri=info.source_uri,
        config=config.model_dump(mode="json"), code_version=_code_version(), created_at=now()))
    atomic_write(run.url("document", "document.txt"), checked.text)
    write_json_artifact(run.url("document", "info.json"), info)
    return RunContext(run, config, checked.text, info, progress)


def open_run(run_dir: str, progress: ProgressFactory = _no_progress) -> RunContext:
    """Reopen an existing run (for `--only`, stage deployments and `status`)."""
    run = RunDir(run_dir)
    if not run.exists("run.json"):
        raise ArtifactError(f"{run_dir}: not a run directory (no run.json); give a directory `nectar run` "
                            "created (it prints it last), e.g. runs/<doc-id>/<run-id>")
    manifest = read_json_artifact(run.url("run.json"), RunManifest)
    try:
        config = PipelineConfig.model_validate(manifest.config)
    except ValidationError as exc:
        err = exc.errors()[0]
        raise ArtifactError(f"{run.url('run.json')}: config field {'.'.join(map(str, err['loc']))!r}: "
                            f"{err['msg']} (made by another release?); start a new run directory") from None
    info = read_json_artifact(run.url("document", "info.json"), DocumentInfo)
    try:
        text = run.fs.cat_file(run.local_path("document", "document.txt")).decode("utf-8")
    except (FileNotFoundError, UnicodeDecodeError) as exc:
        raise ArtifactError(f"{run.url('document', 'document.txt')}: {type(exc).__name__}: {exc}; "
                            "re-run with the document to restore it") from None
    parent = RunDir(manifest.parent_run) if manifest.parent_run else None
    return RunContext(run, config, text, info, progress, parent)


def _code_version() -> str:
    return CODE_VERSION


def _context_tokens(config: PipelineConfig, text: str) -> int:
    """n under the run's model; refuses up front a document that can't fit the model's window."""
    from ..layout import build_layout, check_fits

    base = load_base(config)
    layout = build_layout(base.tokenizer, text)
    check_fits(layout, config.targets.max_query_tokens, base.max_context_tokens)
    return layout.n


def load_base(config: PipelineConfig):
    from ..base_model import load_base_model

    return load_base_model(config.model)


def doc_kv_meta(ctx: RunContext, base) -> dict[str, str]:
    return {"model_hash": base.weights_hash, "doc_sha256": ctx.info.sha256, "n": str(ctx.info.n_context_tokens)}


def load_run_doc_kv(ctx: RunContext):
    """The document KV the targets stage saved (checked against this run's model and document)."""
    from ..attention.doc_kv import load_doc_kv

    base = load_base(ctx.config)
    return load_doc_kv(ctx.stage_run("targets").url("targets", "doc_kv.safetensors"), base, doc_kv_meta(ctx, base))
