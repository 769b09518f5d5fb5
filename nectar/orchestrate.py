"""Running the pipeline's stages on a run directory — the logic the Prefect flows and CLI wrap.

No Prefect import here: each ``run_<stage>`` resolves its inputs from upstream manifests, builds the
stage's cache key and calls the pure stage function through ``runs.run_stage``.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

from .documents import load_document
from .runs import RunDir, StageOutcome, doc_id_for, now, run_stage, slug
from .schemas.artifacts import ChunkRow, DatasetRow, DocumentInfo, PairRow, RunManifest
from .schemas.base import stable_hash
from .schemas.config import STAGES, PipelineConfig
from .tables import ArtifactError, read_json_artifact, read_table, write_json_artifact

Progress = Callable[[int, int], None]
ProgressFactory = Callable[[str], Progress]

# Stages whose implementation ships in this release; `status` lists others as not available.
UPSTREAM: dict[str, tuple[str, ...]] = {
    "chunk": (), "synthesize": ("chunk",), "verify": ("synthesize",), "targets": ("verify",),
    "train": ("targets",), "evaluate": ("train", "targets", "verify", "chunk"),
}


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
    fs, path = __import__("fsspec").core.url_to_fs(run.url("document", "document.txt"))
    fs.makedirs(fs._parent(path), exist_ok=True)
    with fs.open(path, "w") as f:
        f.write(text)
    write_json_artifact(run.url("document", "info.json"), info)
    return RunContext(run, config, text, info, progress)


def open_run(run_dir: str, progress: ProgressFactory = _no_progress) -> RunContext:
    """Reopen an existing run (for `--only`, stage deployments and `status`)."""
    run = RunDir(run_dir)
    manifest = read_json_artifact(run.url("run.json"), RunManifest)
    config = PipelineConfig.model_validate(manifest.config)
    info = read_json_artifact(run.url("document", "info.json"), DocumentInfo)
    fs, path = __import__("fsspec").core.url_to_fs(run.url("document", "document.txt"))
    with fs.open(path, "r") as f:
        text = f.read()
    parent = RunDir(manifest.parent_run) if manifest.parent_run else None
    return RunContext(run, config, text, info, progress, parent)


def _code_version() -> str:
    from .runs import CODE_VERSION

    return CODE_VERSION


def _context_tokens(config: PipelineConfig, text: str) -> int:
    """n under the run's model; refuses up front a document that can't fit the model's window."""
    from .layout import build_layout, check_fits

    base = _base(config)
    layout = build_layout(base.tokenizer, text)
    check_fits(layout, config.targets.max_query_tokens, base.max_context_tokens)
    return layout.n


def _base(config: PipelineConfig):
    from .models import load_base_model

    return load_base_model(config.model)


def _upstream_outputs(ctx: RunContext, stage: str) -> dict[str, str]:
    inputs: dict[str, str] = {"document": ctx.info.sha256}
    for up in UPSTREAM[stage]:
        manifest = ctx.stage_run(up).read_manifest(up)
        if manifest is None:
            raise StageInputError(
                f"stage {stage!r} needs the outputs of {up!r}, which has not completed in {ctx.run.root}; "
                f"run `nectar run ... --from {up}` first")
        inputs.update({f"{up}/{name}": h for name, h in manifest.outputs.items()})
    return inputs


def _stage_config(ctx: RunContext, stage: str) -> dict[str, Any]:
    cfg = ctx.config
    own = getattr(cfg, stage).cache_dict() if stage in ("chunk", "synthesize", "verify", "targets",
                                                        "train", "evaluate") else {}
    # Stages that run the base model depend on it too.
    return {stage: own, "model": cfg.model.cache_dict()}


def run_chunk(ctx: RunContext, force: bool = False) -> StageOutcome:
    from .stages.chunk import chunk_document
    from .tables import write_table

    def body(url: str):
        rows = chunk_document(ctx.text, ctx.config.chunk)
        write_table(f"{url}/chunks.parquet", rows, ChunkRow)
        return ["chunks.parquet"], {"chunks": len(rows), "words": ctx.info.n_words}

    return run_stage(ctx.run, "chunk", {"chunk": ctx.config.chunk.cache_dict()},
                     _upstream_outputs(ctx, "chunk"), body, force)


def run_synthesize(ctx: RunContext, force: bool = False) -> StageOutcome:
    from .llm import make_backend
    from .stages.synthesize import synthesize

    inputs = _upstream_outputs(ctx, "synthesize")

    def body(url: str):
        chunks = read_table(ctx.run.url("chunk", "chunks.parquet"), ChunkRow)
        backend = make_backend(ctx.config.synthesize.llm, ctx.config.model)
        counts = synthesize(chunks, ctx.config.synthesize, backend, url, progress=ctx.progress("synthesize"))
        return ["pairs.parquet"], counts

    return run_stage(ctx.run, "synthesize", _stage_config(ctx, "synthesize"), inputs, body, force)


def run_verify(ctx: RunContext, force: bool = False) -> StageOutcome:
    from .llm import make_backend
    from .models import embedder_path
    from .stages.verify import verify

    inputs = _upstream_outputs(ctx, "verify")

    def body(url: str):
        pairs = read_table(ctx.run.url("synthesize", "pairs.parquet"), PairRow)
        vcfg = ctx.config.verify
        answer = make_backend(vcfg.answer_llm, ctx.config.model)
        judge = answer if vcfg.judge == vcfg.answer_llm else make_backend(vcfg.judge, ctx.config.model)
        counts = verify(ctx.text, pairs, vcfg, answer, judge, embedder_path(vcfg.embedder), url,
                        progress=ctx.progress("verify"))
        return ["dataset.parquet"], counts

    return run_stage(ctx.run, "verify", _stage_config(ctx, "verify"), inputs, body, force)


def doc_kv_meta(ctx: RunContext, base) -> dict[str, str]:
    return {"model_hash": base.weights_hash, "doc_sha256": ctx.info.sha256, "n": str(ctx.info.n_context_tokens)}


def load_run_doc_kv(ctx: RunContext):
    """The document KV the targets stage saved (checked against this run's model and document)."""
    from .attention.prefix import load_doc_kv

    base = _base(ctx.config)
    return load_doc_kv(ctx.stage_run("targets").url("targets", "doc_kv.safetensors"), base, doc_kv_meta(ctx, base))


def _train_log(ctx: RunContext) -> list:
    from .schemas.artifacts import TrainLogRow

    try:
        return read_table(ctx.run.url("train", "train_log.parquet"), TrainLogRow)
    except ArtifactError:
        return []


def run_targets(ctx: RunContext, force: bool = False) -> StageOutcome:
    from .attention.prefix import prefill_document, save_doc_kv
    from .layout import build_layout, check_fits
    from .stages.targets import build_targets

    inputs = _upstream_outputs(ctx, "targets")

    def body(url: str):
        base = _base(ctx.config)
        layout = build_layout(base.tokenizer, ctx.text)
        check_fits(layout, ctx.config.targets.max_query_tokens, base.max_context_tokens)
        rows = read_table(ctx.run.url("verify", "dataset.parquet"), DatasetRow)
        kv_url = f"{url}/doc_kv.safetensors"
        try:  # reuse a KV from an interrupted attempt of this same model/document
            doc_kv = load_run_doc_kv(ctx)
        except Exception:
            doc_kv = prefill_document(base, layout.context_ids)
            save_doc_kv(doc_kv, kv_url, doc_kv_meta(ctx, base))
        counts = build_targets(base, layout, doc_kv, rows, ctx.config.targets, url, ctx.info.sha256,
                               backend=ctx.config.model.attention_backend, progress=ctx.progress("targets"))
        counts["doc_kv_bytes"] = doc_kv.nbytes()
        return ["targets.zarr", "pairs.parquet", "doc_kv.safetensors"], counts

    return run_stage(ctx.run, "targets", _stage_config(ctx, "targets"), inputs, body, force)


def _optional(module: str, func: str) -> Callable | None:
    try:
        mod = __import__(module, fromlist=[func])
        return getattr(mod, func)
    except (ImportError, AttributeError):
        return None


def run_train(ctx: RunContext, force: bool = False) -> StageOutcome:
    from .stages.train import TRAIN_OUTPUTS, train

    inputs = _upstream_outputs(ctx, "train")

    def body(url: str):
        base = _base(ctx.config)
        doc_kv = load_run_doc_kv(ctx) if ctx.config.train.module.arch == "quadrature" else None
        counts = train(ctx.stage_run("targets").url("targets"), ctx.config.train, base, doc_kv, url,
                       progress=ctx.progress("train"))
        return list(TRAIN_OUTPUTS), counts

    return run_stage(ctx.run, "train", _stage_config(ctx, "train"), inputs, body, force)


def run_evaluate(ctx: RunContext, force: bool = False) -> StageOutcome:
    from .evaluation.judge import make_chat
    from .layout import build_layout
    from .llm import make_backend
    from .modules.io import load_module
    from .stages.evaluate import evaluate

    inputs = _upstream_outputs(ctx, "evaluate")
    bars: dict[str, Progress] = {}

    def step(name: str, done: int, total: int) -> None:
        if name not in bars:
            bars[name] = ctx.progress(f"evaluate:{name}")
        bars[name](done, total)

    def body(url: str):
        base = _base(ctx.config)
        layout = build_layout(base.tokenizer, ctx.text)
        doc_kv = load_run_doc_kv(ctx)
        module, spec = load_module(ctx.run.url("train"), base, ctx.info.sha256, device=base.device)
        upstream = ctx.stage_run("verify")
        dataset = read_table(upstream.url("verify", "dataset.parquet"), DatasetRow)
        chunks = read_table(ctx.stage_run("chunk").url("chunk", "chunks.parquet"), ChunkRow)
        judge = make_chat(make_backend(ctx.config.evaluate.judge, ctx.config.model), ctx.config.evaluate.judge)
        result = evaluate(ctx.config.evaluate, base, layout, doc_kv, module, spec,
                          ctx.stage_run("targets").url("targets"), dataset, chunks, judge, url,
                          train_log=_train_log(ctx),
                          title=f"NECTAR · {ctx.doc_id} · {ctx.run.root.rstrip('/').split('/')[-1]}",
                          facts={"document": ctx.info.source_uri, "run": ctx.run.root}, progress=step)
        _write_json(f"{url}/tables.json", result["tables"])  # for dashboards and sweeps
        return [*result["files"], "tables.json"], result["counts"]

    return run_stage(ctx.run, "evaluate", _stage_config(ctx, "evaluate"), inputs, body, force)


STAGE_RUNNERS: dict[str, Callable[[RunContext, bool], StageOutcome]] = {
    "chunk": run_chunk, "synthesize": run_synthesize, "verify": run_verify,
    "targets": run_targets, "train": run_train, "evaluate": run_evaluate,
}


def available_stages() -> list[str]:
    return list(STAGES)


def plan_stages(from_stage: str | None, only_stage: str | None, force: bool) -> list[tuple[str, bool]]:
    """(stage, force) for each stage to run: --from forces it and everything after, --only one stage."""
    for s in (from_stage, only_stage):
        if s is not None and s not in STAGES:
            raise ValueError(f"unknown stage {s!r}; stages are {', '.join(STAGES)}")
    if from_stage and only_stage:
        raise ValueError("use either --from or --only, not both")
    avail = available_stages()
    if only_stage:
        return [(only_stage, True)]
    start = STAGES.index(from_stage) if from_stage else 0
    # Stages before --from still run: they are cache hits when complete, and redone if not.
    return [(s, force or (from_stage is not None and i >= start)) for i, s in enumerate(STAGES) if s in avail]


SAMPLE_TABLES = {"chunk": ("chunks.parquet", ChunkRow), "synthesize": ("pairs.parquet", PairRow),
                 "verify": ("dataset.parquet", DatasetRow)}


def stage_samples(ctx: RunContext, stage: str, k: int = 5) -> list[dict[str, Any]]:
    """A few rows of a stage's main table, shortened, for dashboards."""
    if stage not in SAMPLE_TABLES:
        return []
    name, cls = SAMPLE_TABLES[stage]
    try:
        rows = read_table(ctx.run.url(stage, name), cls)[:k]
    except ArtifactError:
        return []
    keep = {"chunk": ("chunk_id", "n_words", "text"), "synthesize": ("pair_id", "task", "instruction", "response", "parse_error"),
            "verify": ("pair_id", "task", "instruction", "verdict", "confidence", "split", "challenge")}[stage]
    return [{key: _short(getattr(r, key)) for key in keep} for r in rows]


def _short(value: Any, limit: int = 120) -> Any:
    if isinstance(value, str) and len(value) > limit:
        return value[: limit - 1] + "…"
    return value


def stage_extra_tables(ctx: RunContext, stage: str) -> dict[str, list[dict[str, Any]]]:
    """Further tables a stage publishes (evaluate: headline, metrics, judge), by artifact name."""
    if stage != "evaluate":
        return {}
    tables = read_eval_tables(ctx.run)
    report = ctx.run.url("evaluate", "report.html")
    if tables.get("headline"):
        tables["headline"] = [{**row, "report": report} for row in tables["headline"]]
    return tables


def read_eval_tables(run: RunDir) -> dict[str, list[dict[str, Any]]]:
    import json

    import fsspec

    fs, path = fsspec.core.url_to_fs(run.url("evaluate", "tables.json"))
    if not fs.exists(path):
        return {}
    with fs.open(path, "r") as f:
        return json.load(f)


def _write_json(url: str, data: Any) -> None:
    import json

    import fsspec

    fs, path = fsspec.core.url_to_fs(url)
    with fs.open(path, "w") as f:
        json.dump(data, f, indent=1, default=str)
