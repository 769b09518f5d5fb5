"""A run directory's lifecycle: create it for a document and configuration, or reopen it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..documents import load_document
from ..runs import RunDir, doc_id_for, now, slug
from ..schemas.artifacts import DocumentInfo, RunManifest
from ..schemas.base import stable_hash
from ..schemas.config import PipelineConfig
from ..storage import atomic_write
from ..tables import read_json_artifact, write_json_artifact

Progress = Callable[[int, int], None]
ProgressFactory = Callable[[str], Progress]

SHARED_DATA_STAGES = ("chunk", "synthesize", "verify", "targets")


class StageInputError(RuntimeError):
    """A stage was asked to run before the stages it reads from completed."""


@dataclass
class RunContext:
    run: RunDir
    config: PipelineConfig
    text: str
    info: DocumentInfo
    progress: ProgressFactory

    parent: RunDir | None = None  # sweep variants share the parent run's data stages

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


def prepare_run(document: str, config: PipelineConfig, run_dir: str | None = None,
                progress: ProgressFactory = _no_progress) -> RunContext:
    """Load and validate the document, then create (or reopen) its run directory."""
    text, source = load_document(document)
    doc_id = doc_id_for(source.name, source.sha256)
    run = RunDir(run_dir or default_run_dir(doc_id, config))
    info = DocumentInfo(doc_id=doc_id, source_uri=source.uri, sha256=source.sha256, n_chars=len(text),
                        n_words=len(text.split()), n_context_tokens=_context_tokens(config, text),
                        model=config.model.name)
    if run.exists("run.json"):
        existing = read_json_artifact(run.url("run.json"), RunManifest)
        if existing.doc_id != doc_id:
            raise StageInputError(f"{run.root} belongs to document {existing.doc_id}, not {doc_id}")
    write_json_artifact(run.url("run.json"), RunManifest(
        doc_id=doc_id, run_id=run.root.rstrip("/").split("/")[-1], source_uri=source.uri,
        config=config.model_dump(mode="json"), code_version=_code_version(), created_at=now()))
    atomic_write(run.url("document", "document.txt"), text)
    write_json_artifact(run.url("document", "info.json"), info)
    return RunContext(run, config, text, info, progress)


def open_run(run_dir: str, progress: ProgressFactory = _no_progress) -> RunContext:
    """Reopen an existing run (for `--only`, stage deployments and `status`)."""
    run = RunDir(run_dir)
    manifest = read_json_artifact(run.url("run.json"), RunManifest)
    config = PipelineConfig.model_validate(manifest.config)
    info = read_json_artifact(run.url("document", "info.json"), DocumentInfo)
    with run.fs.open(run.local_path("document", "document.txt"), "r") as f:
        text = f.read()
    parent = RunDir(manifest.parent_run) if manifest.parent_run else None
    return RunContext(run, config, text, info, progress, parent)


def _code_version() -> str:
    from ..runs import CODE_VERSION

    return CODE_VERSION


def _context_tokens(config: PipelineConfig, text: str) -> int:
    """n under the run's model; refuses up front a document that can't fit the model's window."""
    from ..layout import build_layout, check_fits

    base = load_base(config)
    layout = build_layout(base.tokenizer, text)
    check_fits(layout, config.targets.max_query_tokens, base.max_context_tokens)
    return layout.n


def load_base(config: PipelineConfig):
    from ..models import load_base_model

    return load_base_model(config.model)


def doc_kv_meta(ctx: RunContext, base) -> dict[str, str]:
    return {"model_hash": base.weights_hash, "doc_sha256": ctx.info.sha256, "n": str(ctx.info.n_context_tokens)}


def load_run_doc_kv(ctx: RunContext):
    """The document KV the targets stage saved (checked against this run's model and document)."""
    from ..attention.doc_kv import load_doc_kv

    base = load_base(ctx.config)
    return load_doc_kv(ctx.stage_run("targets").url("targets", "doc_kv.safetensors"), base, doc_kv_meta(ctx, base))
