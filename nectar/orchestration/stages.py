"""Stage wiring: each ``run_<stage>`` resolves its inputs from the upstream manifests, builds the
stage's cache key and calls the pure stage function through ``runs.run_stage``."""
from __future__ import annotations

from typing import Any, Callable

from ..runs import StageOutcome, run_stage
from ..schemas.artifacts import ChunkRow, DatasetRow, PairRow
from ..schemas.config import STAGES
from ..tables import ArtifactError, read_table
from .context import (SHARED_DATA_STAGES, Progress, RunContext, StageInputError, doc_kv_meta, load_base,
                      load_run_doc_kv)
from .readers import write_json

__all__ = ["SHARED_DATA_STAGES", "STAGE_RUNNERS", "UPSTREAM", "available_stages", "plan_stages"]

UPSTREAM: dict[str, tuple[str, ...]] = {
    "chunk": (), "synthesize": ("chunk",), "verify": ("synthesize",), "targets": ("verify",),
    "train": ("targets",), "evaluate": ("train", "targets", "verify", "chunk"),
}


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
    from ..stages.chunk import chunk_document
    from ..tables import write_table

    def body(url: str):
        rows = chunk_document(ctx.text, ctx.config.chunk)
        write_table(f"{url}/chunks.parquet", rows, ChunkRow)
        return ["chunks.parquet"], {"chunks": len(rows), "words": ctx.info.n_words}

    return run_stage(ctx.run, "chunk", {"chunk": ctx.config.chunk.cache_dict()},
                     _upstream_outputs(ctx, "chunk"), body, force)


def run_synthesize(ctx: RunContext, force: bool = False) -> StageOutcome:
    from ..llm import make_backend
    from ..stages.synthesize import synthesize

    inputs = _upstream_outputs(ctx, "synthesize")

    def body(url: str):
        chunks = read_table(ctx.run.url("chunk", "chunks.parquet"), ChunkRow)
        backend = make_backend(ctx.config.synthesize.llm, ctx.config.model)
        counts = synthesize(chunks, ctx.config.synthesize, backend, url, progress=ctx.progress("synthesize"))
        return ["pairs.parquet"], counts

    return run_stage(ctx.run, "synthesize", _stage_config(ctx, "synthesize"), inputs, body, force)


def run_verify(ctx: RunContext, force: bool = False) -> StageOutcome:
    from ..llm import make_backend
    from ..models import embedder_path
    from ..stages.verify import verify

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


def _train_log(ctx: RunContext) -> list:
    from ..schemas.artifacts import TrainLogRow

    try:
        return read_table(ctx.run.url("train", "train_log.parquet"), TrainLogRow)
    except ArtifactError:
        return []


def run_targets(ctx: RunContext, force: bool = False) -> StageOutcome:
    from ..layout import build_layout, check_fits
    from ..schemas.artifacts import ProbeRow
    from ..stages.probes import make_probes, probe_dataset_rows
    from ..stages.targets import build_targets
    from ..tables import write_table

    inputs = _upstream_outputs(ctx, "targets")

    def body(url: str):
        base = load_base(ctx.config)
        layout = build_layout(base.tokenizer, ctx.text)
        cfg = ctx.config.targets
        check_fits(layout, cfg.max_query_tokens, base.max_context_tokens)
        rows = read_table(ctx.run.url("verify", "dataset.parquet"), DatasetRow)
        # Document probes join the verified pairs: held-out ones as split "probes", train ones
        # (when targets.probes.train) as extra training queries. Every probe is listed in probes.parquet.
        probes = make_probes(ctx.text, cfg.probes) if (cfg.probes.held_out or cfg.probes.train) else []
        write_table(f"{url}/probes.parquet", probes, ProbeRow)
        rows = rows + [r for r in probe_dataset_rows(probes, cfg.probes.train)
                       if cfg.probes.held_out or r.split == "train"]
        doc_kv = _document_kv(ctx, base, layout, f"{url}/doc_kv.safetensors")
        counts = build_targets(base, layout, doc_kv, rows, cfg, url, ctx.info.sha256,
                               backend=ctx.config.model.attention_backend, progress=ctx.progress("targets"))
        counts["doc_kv_bytes"] = doc_kv.nbytes()
        counts["probes_held_out"] = sum(p.split == "probes" for p in probes)
        counts["probes_train"] = sum(p.split == "train" for p in probes) if cfg.probes.train else 0
        return ["targets.zarr", "pairs.parquet", "probes.parquet", "doc_kv.safetensors"], counts

    return run_stage(ctx.run, "targets", _stage_config(ctx, "targets"), inputs, body, force)


def run_train(ctx: RunContext, force: bool = False) -> StageOutcome:
    from ..stages.train import TRAIN_OUTPUTS, train

    inputs = _upstream_outputs(ctx, "train")

    def body(url: str):
        base = load_base(ctx.config)
        doc_kv = load_run_doc_kv(ctx) if ctx.config.train.module.arch == "quadrature" else None
        counts = train(ctx.stage_run("targets").url("targets"), ctx.config.train, base, doc_kv, url,
                       progress=ctx.progress("train"))
        return list(TRAIN_OUTPUTS), counts

    return run_stage(ctx.run, "train", _stage_config(ctx, "train"), inputs, body, force)


def run_evaluate(ctx: RunContext, force: bool = False) -> StageOutcome:
    from ..evaluation.judge import make_chat
    from ..layout import build_layout
    from ..llm import make_backend
    from ..modules.io import load_module
    from ..stages.evaluate import evaluate

    inputs = _upstream_outputs(ctx, "evaluate")
    bars: dict[str, Progress] = {}

    def step(name: str, done: int, total: int) -> None:
        if name not in bars:
            bars[name] = ctx.progress(f"evaluate:{name}")
        bars[name](done, total)

    def body(url: str):
        base = load_base(ctx.config)
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
        write_json(f"{url}/tables.json", result["tables"])  # for dashboards and sweeps
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


def _document_kv(ctx: RunContext, base, layout, kv_url: str):
    """The document KV, prefilled once per (model, document): reused from an interrupted attempt of
    this same stage when its header matches, rebuilt when it was made for another model/document."""
    from ..attention.prefix import DocKVMismatch, prefill_document, save_doc_kv

    if ctx.stage_run("targets").exists("targets", "doc_kv.safetensors"):
        try:
            return load_run_doc_kv(ctx)
        except DocKVMismatch:
            pass  # made for another model or document: rebuilt below
    doc_kv = prefill_document(base, layout.context_ids)
    save_doc_kv(doc_kv, kv_url, doc_kv_meta(ctx, base))
    return doc_kv
