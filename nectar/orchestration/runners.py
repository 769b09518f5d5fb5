"""Stage wiring: each ``run_<stage>`` resolves its inputs from the upstream manifests, builds the
stage's cache key and calls the pure stage function through ``executor.run_stage``."""
from __future__ import annotations

import time
from typing import Any, Callable

import fsspec

from .. import integrity
from .executor import RunDir, StageOutcome, check_stage, run_stage
from ..schemas.artifacts import ChunkRow, DatasetRow, PairRow
from ..schemas.config import STAGES
from ..states import init_method
from ..tables import ArtifactError, read_table
from .context import (SHARED_DATA_STAGES, Progress, RunContext, StageInputError, doc_kv_meta, load_base,
                      load_run_doc_kv)
from .lineage import code_version
from .readers import write_json

__all__ = ["OPTIONAL_UPSTREAM", "SHARED_DATA_STAGES", "STAGE_RUNNERS", "UPSTREAM", "available_stages",
           "plan_stages"]

UPSTREAM: dict[str, tuple[str, ...]] = {
    "chunk": (), "first": (), "synthesize": ("chunk",), "verify": ("synthesize",), "targets": ("verify",),
    "train": ("targets",), "promote": ("first", "train", "targets"),
    "evaluate": ("train", "promote", "targets", "verify", "chunk"),
}
# Upstream stages read when they completed in the run and done without when they did not. evaluate
# scores the live state (live.py): promote's choice once promote ran; a run where it never ran (a
# sweep variant, a targets → train → evaluate script) has no pointer and serves its train module.
OPTIONAL_UPSTREAM: dict[str, tuple[str, ...]] = {"evaluate": ("promote",)}


class InputChanged(ArtifactError):
    """An upstream output no longer matches the digest its manifest recorded."""


def rebuild_command(ctx: RunContext, stage: str) -> str:
    """The command that redoes ``stage`` (and what follows) in this run."""
    import shlex

    run = ctx.stage_run(stage)
    return f"nectar run {shlex.quote(ctx.info.source_uri)} --run-dir {shlex.quote(run.root)} --from {stage}"


def _upstream_outputs(ctx: RunContext, stage: str) -> dict[str, str]:
    """The content digests of the stage's inputs (its cache key's ``inputs``), after checking that
    each upstream stage's outputs still match them (cheap when this process just checked them)."""
    inputs: dict[str, str] = {"document": ctx.info.sha256}
    for up in UPSTREAM[stage]:
        run = ctx.stage_run(up)
        manifest = run.read_manifest(up)
        if manifest is None and up in OPTIONAL_UPSTREAM.get(stage, ()):
            continue
        if manifest is None:
            raise StageInputError(
                f"stage {stage!r} needs the outputs of {up!r}, which has not completed in {run.root}; "
                f"run `{rebuild_command(ctx, up)}` first")
        changes = check_stage(run, up, manifest)
        if changes:
            raise InputChanged(f"{run.root}/{integrity.summarize(up, changes)} since {up} completed; "
                               f"{stage} will not read it: rebuild it with `{rebuild_command(ctx, up)}`")
        inputs.update({f"{up}/{name}": h for name, h in manifest.outputs.items()})
    return inputs


def check_inputs_done(run: RunDir, stage: str, source_uri: str) -> None:
    """``--only STAGE``: refuse up front when a stage it reads from has not completed."""
    import shlex

    parent = None
    if run.exists("run.json"):
        from ..schemas.artifacts import RunManifest
        from ..tables import read_json_artifact

        parent_root = read_json_artifact(run.url("run.json"), RunManifest).parent_run
        parent = RunDir(parent_root) if parent_root else None
    for up in UPSTREAM[stage]:
        holder = parent if parent is not None and up in SHARED_DATA_STAGES else run
        if not holder.exists(up, "manifest.json") and up not in OPTIONAL_UPSTREAM.get(stage, ()):
            raise StageInputError(
                f"--only {stage} needs the outputs of {up}, which has not completed in {holder.root}; run "
                f"`nectar run {shlex.quote(source_uri)} --run-dir {shlex.quote(holder.root)} --from {up}` first")


def _wiring(ctx: RunContext, stage: str) -> dict[str, Any]:
    """What every runner hands ``run_stage`` besides its config, inputs and body: the stage's code
    version (its runner's imports), the run's notices, and input errors worded with the command that
    rebuilds the input."""
    return {"code": code_version(STAGE_RUNNERS[stage]), "notify": ctx.notify,
            "explain": lambda exc: _explain_input_error(ctx, stage, exc)}


def _explain_input_error(ctx: RunContext, stage: str, exc: Exception) -> Exception:
    """An unreadable input names its file: add the command that rebuilds it. A chunk that failed
    zarr's crc32c check: find the file that changed and say so."""
    if isinstance(exc, ArtifactError):
        _add_rebuild_hint(ctx, stage, exc)
        return exc
    if not isinstance(exc, ValueError) or "checksum" not in str(exc):
        return exc
    try:
        _upstream_outputs(ctx, stage)  # raises InputChanged naming the file
    except Exception as changed:  # noqa: BLE001 - what the check found is the clearer error
        return changed
    up = UPSTREAM[stage][0]
    clearer = ArtifactError(f"{stage}: an input chunk failed its crc32c check ({exc}); rebuild the "
                            f"inputs with `{rebuild_command(ctx, up)}`")
    clearer.__cause__ = exc
    return clearer


def _add_rebuild_hint(ctx: RunContext, stage: str, exc: ArtifactError) -> None:
    """An unreadable or invalid input names its file already; add the command that rebuilds it."""
    text = str(exc)
    if "rebuild it with" in text:
        return
    for up in UPSTREAM[stage]:
        if ctx.stage_run(up).url(up) + "/" in text:
            exc.args = (f"{text}; rebuild it with `{rebuild_command(ctx, up)}`",)
            return


def llm_scope(ctx: RunContext):
    """The vLLM servers' scope for a stage: the pipeline's when one is open (servers shared across
    stages), else the stage's own (stopped when it ends). Logs go to ``<run>/llm/``."""
    from ..vllm.pool import server_log_dir, server_scope

    return server_scope(server_log_dir(ctx.run.root))


def llm_record(backend: Any, llm_cfg: Any) -> dict[str, Any]:
    """For the manifest: what answered (backend, server version, model) and how it sampled."""
    describe = getattr(backend, "describe", None)
    return {**(describe() if describe else {"backend": getattr(backend, "name", "?")}),
            "sampling": {"temperature": llm_cfg.temperature, "top_p": llm_cfg.top_p, "seed": llm_cfg.seed,
                         "max_new_tokens": llm_cfg.max_new_tokens, "structured_output": llm_cfg.structured_output}}


def _init_reads_document(cfg) -> bool:
    """Whether the train stage's module starts from a state method that reads the document (recon_fit)."""
    method = init_method(cfg.train.module.init)
    return method is not None and method.reads_document


def _stage_config(ctx: RunContext, stage: str) -> dict[str, Any]:
    cfg = ctx.config
    own = getattr(cfg, stage).cache_dict() if stage in ("chunk", "synthesize", "verify", "targets",
                                                        "train", "evaluate", "first") else {}
    # Stages that run the base model depend on it too.
    out = {stage: own, "model": cfg.model.cache_dict()}
    if (stage == "train" and _init_reads_document(cfg)) or stage == "first":  # keys chosen by reconstruction
        out["recon"] = {"recon": cfg.targets.recon.cache_dict(), "probes": cfg.targets.probes.cache_dict()}
    if stage == "first":  # its bytes are the train module's
        out["module"] = cfg.train.module.cache_dict()
    if stage == "promote":  # the pairs it scores on and the interval's settings
        out[stage] = {**cfg.first.cache_dict(), "evaluate": cfg.evaluate.cache_dict()}
    return out


def run_chunk(ctx: RunContext, force: bool = False) -> StageOutcome:
    from ..stages.chunk import chunk_document
    from ..tables import write_table

    def body(url: str):
        rows = chunk_document(ctx.text, ctx.config.chunk)
        write_table(f"{url}/chunks.parquet", rows, ChunkRow)
        return ["chunks.parquet"], {"chunks": len(rows), "words": ctx.info.n_words}

    return run_stage(ctx.run, "chunk", {"chunk": ctx.config.chunk.cache_dict()}, _upstream_outputs(ctx, "chunk"),
                     body, force, **_wiring(ctx, "chunk"))


def run_synthesize(ctx: RunContext, force: bool = False) -> StageOutcome:
    from ..llm import make_backend
    from ..stages.synthesize import synthesize

    inputs = _upstream_outputs(ctx, "synthesize")

    def body(url: str):
        chunks = read_table(ctx.run.url("chunk", "chunks.parquet"), ChunkRow)
        with llm_scope(ctx):
            backend = make_backend(ctx.config.synthesize.llm, ctx.config.model)
            counts = synthesize(chunks, ctx.config.synthesize, backend, url, progress=ctx.progress("synthesize"))
        counts["llm"] = llm_record(backend, ctx.config.synthesize.llm)
        return ["pairs.parquet", "requests.json"], counts

    return run_stage(ctx.run, "synthesize", _stage_config(ctx, "synthesize"), inputs, body, force,
                     **_wiring(ctx, "synthesize"))


def run_verify(ctx: RunContext, force: bool = False) -> StageOutcome:
    from ..llm import make_backend
    from ..base_model import embedder_path
    from ..stages.verify import verify

    inputs = _upstream_outputs(ctx, "verify")

    def body(url: str):
        pairs = read_table(ctx.run.url("synthesize", "pairs.parquet"), PairRow)
        vcfg = ctx.config.verify
        evidence = vcfg.method == "evidence"  # judge-free: the base model scores each pair
        with llm_scope(ctx):
            answer = make_backend(vcfg.answer_llm, ctx.config.model)
            judge = None if evidence else answer if vcfg.judge == vcfg.answer_llm else make_backend(vcfg.judge,
                                                                                                   ctx.config.model)
            counts = verify(ctx.text, pairs, vcfg, answer, judge, embedder_path(vcfg.embedder), url,
                            progress=ctx.progress("verify"),
                            scorer=_evidence_scorer(ctx, ctx.progress("verify:evidence")) if evidence else None)
        counts["llm"] = {"answer": llm_record(answer, vcfg.answer_llm),
                         "judge": llm_record(judge, vcfg.judge) if judge is not None else None}
        return ["dataset.parquet"], counts

    return run_stage(ctx.run, "verify", _stage_config(ctx, "verify"), inputs, body, force,
                     **_wiring(ctx, "verify"))


def _evidence_scorer(ctx: RunContext, progress: Progress):
    """verify.method = evidence: each pair's document gain on the base model, over the document KV
    prefilled here once (the targets stage, later, prefills and keeps its own)."""
    from ..attention.doc_kv import prefill_document
    from ..attention.exact import ExactDocState
    from ..evaluation.evidence import document_gain
    from ..layout import build_layout

    def score(items):
        base = load_base(ctx.config)
        layout = build_layout(base.tokenizer, ctx.text)
        full = ExactDocState(prefill_document(base, layout.context_ids))
        return document_gain(base, layout, full, items, ctx.config.verify.evidence_max_tokens, progress=progress)

    return score


def _train_log(ctx: RunContext) -> list:
    from ..schemas.artifacts import TrainLogRow

    try:
        return read_table(ctx.run.url("train", "train_log.parquet"), TrainLogRow)
    except ArtifactError:
        return []


def run_targets(ctx: RunContext, force: bool = False) -> StageOutcome:
    from ..layout import build_layout, check_fits
    from ..schemas.artifacts import ProbeRow
    from ..queries.probes import make_probes, probe_dataset_rows
    from ..queries.recon import make_recon, recon_dataset_rows
    from ..stages.targets import build_targets, plan_pairs, targets_size
    from ..tables import write_table
    from ..targets.size import check_budget
    from ..targets.store import STORE_NAME, repair_shards, targets_zarr_url

    inputs = _upstream_outputs(ctx, "targets")

    def body(url: str):
        base = load_base(ctx.config)
        cfg = ctx.config.targets
        layout = build_layout(base.tokenizer, ctx.text)
        check_fits(layout, cfg.max_query_tokens, base.max_context_tokens)
        rows = read_table(ctx.run.url("verify", "dataset.parquet"), DatasetRow)
        # Document probes join the verified pairs: held-out ones as split "probes", train ones
        # (when targets.probes.train) as extra training queries. Every probe is listed in probes.parquet.
        probes = make_probes(ctx.text, cfg.probes) if (cfg.probes.held_out or cfg.probes.train) else []
        write_table(f"{url}/probes.parquet", probes, ProbeRow)
        rows = rows + [r for r in probe_dataset_rows(probes, cfg.probes.train)
                       if cfg.probes.held_out or r.split == "train"]
        # Reconstruction spans (targets.recon.capture): training queries of their own split "recon".
        recon = make_recon(ctx.text, cfg.recon, cfg.probes) if cfg.recon.capture else []
        rows = rows + recon_dataset_rows(recon)
        # The size of the outputs, before the document prefill or any capture: refused over max_bytes.
        planned = plan_pairs(rows, layout, cfg)
        size = targets_size(planned, base, cfg)
        print(f"targets: {size.describe()}", flush=True)
        check_budget(size, cfg.max_bytes)
        doc_kv = _document_kv(ctx, base, layout, f"{url}/doc_kv.safetensors")
        counts = build_targets(base, layout, doc_kv, rows, cfg, url, ctx.info.sha256,
                               backend=ctx.config.model.attention_backend, progress=ctx.progress("targets"),
                               planned=planned)
        counts.update(doc_kv_bytes=doc_kv.nbytes(), estimated_bytes=size.total,
                      bytes_written=_bytes_under(targets_zarr_url(url)))
        counts["probes_held_out"] = sum(p.split == "probes" for p in probes)
        counts["probes_train"] = sum(p.split == "train" for p in probes) if cfg.probes.train else 0
        counts["recon_spans"] = len(recon)
        return [STORE_NAME, "pairs.parquet", "probes.parquet", "doc_kv.safetensors"], counts

    return run_stage(ctx.run, "targets", _stage_config(ctx, "targets"), inputs, body, force, repair=repair_shards,
                     **_wiring(ctx, "targets"))


def run_train(ctx: RunContext, force: bool = False) -> StageOutcome:
    from ..queries.recon import make_recon
    from ..stages.train import TRAIN_OUTPUTS, train

    inputs = _upstream_outputs(ctx, "train")

    def body(url: str):
        from ..targets.store import open_targets, targets_zarr_url

        base = load_base(ctx.config)
        targets = ctx.stage_run("targets").url("targets")
        online = open_targets(targets_zarr_url(targets))[1].mode == "online"
        doc_kv = load_run_doc_kv(ctx) if ctx.config.train.module.arch == "quadrature" or online else None
        spans = None
        if _init_reads_document(ctx.config):
            spans = [(r.instruction, r.response) for r in make_recon(ctx.text, ctx.config.targets.recon,
                                                                     ctx.config.targets.probes)]
        counts = train(targets, ctx.config.train, base, doc_kv, url,
                       progress=ctx.progress("train"), document=ctx.text, spans=spans)
        return list(TRAIN_OUTPUTS), counts

    return run_stage(ctx.run, "train", _stage_config(ctx, "train"), inputs, body, force,
                     **_wiring(ctx, "train"))


def run_first(ctx: RunContext, force: bool = False) -> StageOutcome:
    """A servable state from the document alone (no LLM server), published live at once unless the
    run already serves a refined state (the promote stage owns that choice)."""
    from ..stages.first import FIRST_OUTPUTS, first_state
    from .live import live_stage, publish

    inputs = _upstream_outputs(ctx, "first")

    def body(url: str):
        start = time.perf_counter()
        cfg = ctx.config
        if not cfg.first.enabled:
            return [], {"enabled": False, "live": live_stage(ctx.run)}
        base = load_base(cfg)
        announced = []

        def go_live(counts: dict, reason: str) -> None:
            if live_stage(ctx.run) not in (None, "first"):  # the promote stage chose the refined state
                return
            state = publish(ctx.run, "first", reason, {"counts": counts})
            if not announced:
                announced.append(round(time.perf_counter() - start, 3))  # the stage's seconds to a live state
                ctx.notify(f"first usable state ready after {time.perf_counter() - start:.1f} s in the first stage "
                           f"(no LLM server): {state.url}; answer from it now: nectar ask {ctx.run.root} \"…\"")
            else:
                ctx.notify(f"first state refined end to end after {time.perf_counter() - start:.1f} s "
                           f"(span KL {counts.get('span_kl_fit', 0):.4f} -> {counts.get('span_kl_refined', 0):.4f}): "
                           f"{state.url} is live")

        counts = first_state(base, ctx.text, cfg.first, cfg.train.module, cfg.targets.recon, cfg.targets.probes,
                             ctx.info.sha256, url, max_query_tokens=cfg.targets.max_query_tokens,
                             on_fitted=lambda fit: go_live(fit, "the first state (document alone), fitted: its "
                                                                "end-to-end steps are running"),
                             progress=ctx.progress("first"))
        go_live(counts, "the first state (document alone): self-study has not refined it yet"
                + (" (refined end to end on the reconstruction)" if counts.get("refined") else ""))
        counts["live"] = live_stage(ctx.run)
        if announced:
            counts["usable_s"] = announced[0]  # the fit went live then (before the steps, where they ran)
        return list(FIRST_OUTPUTS), counts

    return run_stage(ctx.run, "first", _stage_config(ctx, "first"), inputs, body, force, **_wiring(ctx, "first"))


def run_promote(ctx: RunContext, force: bool = False) -> StageOutcome:
    """Score the first and the refined state on the held-out pairs; publish the better one (the
    refined only when its paired interval says so). ``decision.json`` and the counts say why."""
    from ..modules.io import load_module
    from ..stages.promote import decide
    from .live import decision_record, publish

    inputs = _upstream_outputs(ctx, "promote")

    def body(url: str):
        cfg = ctx.config
        if not ctx.run.exists("first", "module.json"):
            reason, counts = "no first state in this run (first.enabled is false): the refined state is live", {}
            live = "train"
        else:
            base = load_base(cfg)
            doc_kv = load_run_doc_kv(ctx)
            first, _ = load_module(ctx.run.url("first"), base, ctx.info.sha256, device=base.device)
            refined, _ = load_module(ctx.run.url("train"), base, ctx.info.sha256, device=base.device)
            decision = decide(base, doc_kv, first, refined, ctx.stage_run("targets").url("targets"), cfg.evaluate,
                              cfg.first.confidence, progress=ctx.progress("promote"))
            live, reason, counts = decision.live, decision.reason, decision.counts
        state = publish(ctx.run, live, reason, {"decision": counts})
        write_json(f"{url}/decision.json", decision_record(ctx.run, live, reason, state, counts))  # dir: run-relative
        return ["decision.json"], {"live": live, "reason": reason, **counts}

    return run_stage(ctx.run, "promote", _stage_config(ctx, "promote"), inputs, body, force,
                     **_wiring(ctx, "promote"))


def _scored_state(ctx: RunContext):
    """The state evaluate scores: the one the run serves (live.py's reader — promote's choice once it
    ran, the train module in a run without a pointer), and the sha256 of its weights."""
    from .executor import hash_url
    from .live import read_live

    state = read_live(ctx.run)
    if state is None:  # unreachable after train completed (read_live falls back to its module)
        raise StageInputError(f"evaluate: no state to score in {ctx.run.root}; run `{rebuild_command(ctx, 'train')}`")
    return state, state.module_sha256 or hash_url(f"{state.url}/module.safetensors")


def run_evaluate(ctx: RunContext, force: bool = False) -> StageOutcome:
    from ..evaluation.judge import make_chat
    from ..layout import build_layout
    from ..llm import make_backend
    from ..modules.io import load_module
    from ..stages.evaluate import evaluate

    from ..evaluation.questions import load_questions, read_questions

    inputs = _upstream_outputs(ctx, "evaluate")
    # The scored weights are an input of their own: the pointer can move without promote's decision
    # changing (a re-run of first while it is live), and a cached evaluation must be of what is served.
    state, state_sha256 = _scored_state(ctx)
    inputs[f"live/{state.stage}"] = state_sha256
    qpath = ctx.config.evaluate.questions
    if qpath:  # the file's content, not its path, is what evaluate depends on (checked here, one line)
        inputs["questions"] = read_questions(qpath).sha256
    bars: dict[str, Progress] = {}

    def step(name: str, done: int, total: int) -> None:
        if name not in bars:
            bars[name] = ctx.progress(f"evaluate:{name}")
        bars[name](done, total)

    def body(url: str):
        base = load_base(ctx.config)
        layout = build_layout(base.tokenizer, ctx.text)
        doc_kv = load_run_doc_kv(ctx)
        module, spec = load_module(state.url, base, ctx.info.sha256, device=base.device)
        upstream = ctx.stage_run("verify")
        dataset = read_table(upstream.url("verify", "dataset.parquet"), DatasetRow)
        chunks = read_table(ctx.stage_run("chunk").url("chunk", "chunks.parquet"), ChunkRow)
        questions = None
        if qpath:  # reference answers cached per file digest in RUN/questions/, shared with `nectar compare`
            from ..attention.exact import ExactDocState

            questions = load_questions(qpath, base, layout, ExactDocState(doc_kv), ctx.run.url("questions"),
                                       ctx.config.evaluate, lambda d, t: step("questions", d, t))
        with llm_scope(ctx):
            backend = make_backend(ctx.config.evaluate.judge, ctx.config.model)
            judge = make_chat(backend, ctx.config.evaluate.judge)
            result = evaluate(ctx.config.evaluate, base, layout, doc_kv, module, spec,
                              ctx.stage_run("targets").url("targets"), dataset, chunks, judge, url,
                              train_log=_train_log(ctx),
                              title=f"NECTAR · {ctx.doc_id} · {ctx.run.root.rstrip('/').split('/')[-1]}",
                              facts={"document": ctx.info.source_uri, "run": ctx.run.root,
                                     "state": f"{state.stage} (live: {state.reason})"}, progress=step,
                              question_pairs=questions.pairs if questions else ())
        if questions:
            result["counts"].update(questions.counts())
        write_json(f"{url}/tables.json", result["tables"])  # for dashboards and sweeps
        # scored_state first: `nectar status` shows a stage's first counts
        return [*result["files"], "tables.json"], {"scored_state": state.stage, **result["counts"],
                                                   "scored_module_sha256": state_sha256,
                                                   "judge_llm": llm_record(backend, ctx.config.evaluate.judge)}

    return run_stage(ctx.run, "evaluate", _stage_config(ctx, "evaluate"), inputs, body, force,
                     **_wiring(ctx, "evaluate"))


STAGE_RUNNERS: dict[str, Callable[[RunContext, bool], StageOutcome]] = {
    "chunk": run_chunk, "first": run_first, "synthesize": run_synthesize, "verify": run_verify,
    "targets": run_targets, "train": run_train, "promote": run_promote, "evaluate": run_evaluate,
}


def available_stages() -> list[str]:
    return list(STAGES)


def plan_stages(from_stage: str | None, only_stage: str | None, force: bool) -> list[tuple[str, bool]]:
    """(stage, force) for each stage to run: --from forces it and everything after, --only one stage."""
    from ..schemas.presets import ConfigError

    for s in (from_stage, only_stage):
        if s is not None and s not in STAGES:
            raise ConfigError(f"unknown stage {s!r}; stages are {', '.join(STAGES)}")
    if from_stage and only_stage:
        raise ConfigError("use either --from or --only, not both")
    avail = available_stages()
    if only_stage:
        return [(only_stage, True)]
    start = STAGES.index(from_stage) if from_stage else 0
    # Stages before --from still run: they are cache hits when complete, and redone if not.
    return [(s, force or (from_stage is not None and i >= start)) for i, s in enumerate(STAGES) if s in avail]


def _bytes_under(url: str) -> int:
    import fsspec

    fs, path = fsspec.core.url_to_fs(url)
    return int(fs.du(path))
def _document_kv(ctx: RunContext, base, layout, kv_url: str):
    """The document KV, prefilled once per (model, document): reused from an interrupted attempt of
    this same stage when its header matches, rebuilt when it was made for another model/document."""
    from ..attention.doc_kv import DocKVMismatch, prefill_document, save_doc_kv

    if ctx.stage_run("targets").exists("targets", "doc_kv.safetensors"):
        try:
            return load_run_doc_kv(ctx)
        except DocKVMismatch:
            pass  # made for another model or document: rebuilt below
    doc_kv = prefill_document(base, layout.context_ids)
    save_doc_kv(doc_kv, kv_url, doc_kv_meta(ctx, base))
    return doc_kv
