"""``nectar compare RUN_DIR``: every system at equal bytes, scored on the run's held-out pairs.

  0. data   the run's targets stage through the stage cache: a hit, or redone if stale
  1. plan   one job per (system, ρ); a trained job resolves to a run directory holding its train
            stage: the run itself when the settings are the run's, a variant that already trained
            the same settings (``nectar sweep``, an earlier compare), or a new variant directory
            ``RUN/sweep/<system>_rho-<ρ>/`` sharing the run's data stages (comparison/sweep.py)
  2. train  what is missing, through the train stage and its cache (a second compare trains nothing)
  3. fit    the baselines: state methods fitted at compare time (nectar.states, seconds)
  4. score  every provider on every held-out pair in one pass (evaluation/scoring.py: the full and
            no-document passes and the full model's continuations are shared by all systems), with
            one paired bootstrap over pairs per split; kvpress presses (``kvpress:<press>``) are
            scored on the same pairs in kvpress's own venv (nectar/kvpress/) and join the bootstrap
  5. write  RUN/compare/comparison.parquet (ComparisonRow), comparison.md, frontier.png, info.json
"""
from __future__ import annotations

import dataclasses
import json
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from ..attention.doc_kv import prefill_document
from ..attention.exact import ExactDocState
from ..evaluation.bootstrap import Estimate
from ..evaluation.quality import recovered_differences
from ..evaluation.questions import load_questions, with_questions
from ..evaluation.scoring import score_providers
from ..evaluation.selection import evaluated_splits, select_pairs, with_subset
from ..evaluation.teacher import EvalPair
from ..kvpress import BridgeResult, KvpressEnvError, KvpressError, PressJob, score_presses
from ..layout import build_layout
from ..modules.budget import BudgetError
from ..modules.builder import ModulePlan, plan_from_config
from ..orchestration.context import (SHARED_DATA_STAGES, RunContext, StageInputError, load_base, load_run_doc_kv,
                                     open_run)
from ..orchestration.executor import RunDir, now
from ..orchestration.document_run import RunOne, run_here
from ..schemas.artifacts import ComparisonRow, RunManifest, TargetsPairRow
from ..schemas.config import PipelineConfig
from ..schemas.presets import ConfigError
from ..stages.recon import make_recon
from ..states import FitInputs
from ..storage import atomic_write
from ..tables import ArtifactError, read_json_artifact, read_table, write_table
from ..targets.store import open_targets, targets_zarr_url
from .sweep import Variant, prepare_variant
from .systems import RUN_STATES, System, resolve, run_states, system_method, trained_config

ProgressFactory = Callable[[str], Callable[[int, int], None]]


# Pairs per teacher-forced forward and prompts per greedy batch: a decode step on CPU reads every weight
# once whatever the batch, so wider batches cut the agreement pass (a dozen systems × every prompt).
SCORE_BATCH, GEN_BATCH = 8, 16


class CompareInputError(ValueError):
    """A run directory, budget or system that ``nectar compare`` can't work with (one line)."""


KV_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def parse_bytes(text: str | None, kv_dtype: str) -> list[float]:
    """``--bytes 0.01,0.05``: budgets as fractions of the document KV's bytes at the model's KV dtype →
    the budgets ρ (shares of the float32 KV's bytes, what every system is sized by): the same at fp32,
    half at bf16 (a bf16 KV is half the bytes, so 5 % of it is 2.5 % of the float32 one)."""
    fractions = parse_rhos(text, "--bytes")
    return [f * KV_DTYPE_BYTES[kv_dtype] / 4 for f in fractions]


def parse_rhos(text: str | None, option: str = "--rho") -> list[float]:
    """``"0.02,0.05,0.10"`` → [0.02, 0.05, 0.1]; each a fraction of the document KV bytes in (0, 1)."""
    if text is None or not text.strip():
        return []
    out = []
    for item in text.split(","):
        item = item.strip()
        try:
            rho = float(item)
        except ValueError:
            raise CompareInputError(f"{option} {item!r} is not a number; give budgets as fractions of the document "
                                    f"KV cache, e.g. {option} 0.02,0.05,0.10") from None
        if not (0 < rho < 1) or math.isnan(rho):
            raise CompareInputError(f"{option} {item}: a budget is the state's share of the document KV cache bytes "
                                    "and must lie strictly between 0 and 1 (e.g. 0.05)")
        out.append(rho)
    return out


@dataclass
class Job:
    """One system at one budget (rho None for the reference systems)."""

    system: System
    rho: float | None
    config: PipelineConfig | None = None  # trained: the variant's configuration
    ctx: RunContext | None = None  # trained: the run directory holding its train stage

    @property
    def key(self) -> str:
        return self.system.name if self.rho is None else f"{self.system.name}@{self.rho:g}"


def check_ready(ctx: RunContext) -> None:
    """The run's data stages must have completed: compare trains and scores on its targets."""
    if ctx.stage_run("targets").read_manifest("targets") is None:
        raise CompareInputError(
            f"{ctx.run.root} has no completed targets stage; compare reuses the run's data stages (chunk → targets): "
            f"run `nectar run {ctx.info.source_uri} --run-dir {ctx.run.root}` first")


def refresh_targets(ctx: RunContext, run_one: RunOne = run_here) -> None:
    """Pass the targets stage (what compare reads) through the stage cache: a hit when it is current
    with the run's configuration and the code, redone when they changed since (e.g. probe settings),
    so nothing is trained or scored on stale targets. Stages before it are the run's business."""
    if ctx.parent is not None:
        return  # a variant's data stages are its parent's
    run_one(ctx, "targets", False)


def open_for_compare(run_dir: str, progress: ProgressFactory | None = None) -> RunContext:
    """Reopen a run for comparison, with one-line errors for a folder that is not a usable run."""
    run = RunDir(run_dir)
    if not run.exists("run.json"):
        raise CompareInputError(f"{run_dir} is not a run directory (no run.json); make one with `nectar run DOC`")
    try:
        ctx = open_run(run_dir, progress) if progress else open_run(run_dir)
    except ArtifactError as exc:
        raise CompareInputError(f"{run_dir}: {exc}") from None
    check_ready(ctx)
    return ctx


def _dims(ctx: RunContext) -> dict[str, Any]:
    _, h = open_targets(targets_zarr_url(ctx.stage_run("targets").url("targets")))
    return dict(num_layers=h.num_layers, num_kv_heads=h.num_kv_heads, head_dim=h.head_dim, n_context=h.n_context,
                scaling=h.scaling)


def baseline_plan(ctx: RunContext, rho: float, dims: dict[str, Any] | None = None) -> ModulePlan:
    """The run's module plan at ``rho``: what a baseline at the same budget must fit into."""
    module_cfg = ctx.config.train.module.model_copy(update={"rho": rho})
    return plan_from_config(module_cfg, **(dims or _dims(ctx)))


def validate(ctx: RunContext, systems: list[str] | None = None,
             rhos: list[float] | None = None) -> tuple[list[System], list[float]]:
    """The systems and budgets (the run's ρ first), checked before anything is written or trained:
    unknown systems, and budgets too small to plan a module for this document, are refused."""
    try:
        chosen = resolve(systems)
    except ConfigError as exc:
        raise CompareInputError(str(exc)) from None
    budgets = list(dict.fromkeys([ctx.config.train.module.rho, *(rhos or [])]))
    dims = _dims(ctx)
    for rho in budgets:
        try:
            baseline_plan(ctx, rho, dims)
        except (BudgetError, ValueError) as exc:
            raise CompareInputError(f"--rho {rho:g}: {' '.join(str(exc).split())}") from None
    return chosen, budgets


def plan_jobs(ctx: RunContext, systems: list[str] | None = None, rhos: list[float] | None = None) -> list[Job]:
    """The jobs: references once, every other system at the run's ρ and at each of ``rhos``, and the
    run's own states (first, refined) at the run's ρ whenever it has them."""
    chosen, budgets = validate(ctx, systems, rhos)
    if ctx.parent is None:  # a variant's states are not the run's
        done = {stage for stage, _ in RUN_STATES.values() if ctx.run.exists(stage, "module.json")}
        chosen = chosen + run_states(done)
    jobs: list[Job] = []
    for s in chosen:
        if s.kind == "reference":
            jobs.append(Job(s, None))
            continue
        for rho in budgets:
            if s.kind == "trained":  # baselines and kvpress presses: one job per budget
                config = trained_config(ctx.config, s, rho)
                jobs.append(Job(s, rho, config, variant_for(ctx, f"{s.name}_rho-{rho:g}", config)))
            elif s.kind == "run":  # made by the pipeline at the run's ρ only
                if rho == ctx.config.train.module.rho:
                    jobs.append(Job(s, rho, ctx.config, ctx))
            else:
                jobs.append(Job(s, rho))
    return jobs


def _same_training(a: PipelineConfig, b: PipelineConfig) -> bool:
    return a.train == b.train and a.model == b.model


def variant_for(parent: RunContext, name: str, config: PipelineConfig) -> RunContext:
    """The run directory whose train stage trains ``config``: the parent itself, an existing variant
    with the same training settings, or a new variant directory (sharing the parent's data stages)."""
    if _same_training(parent.config, config):
        return parent
    fs = parent.run.fs
    for path in sorted(fs.glob(parent.run.local_path("sweep", "*", "run.json"))):
        root = parent.run.url("sweep", path.rstrip("/").split("/")[-2])
        try:
            manifest = read_json_artifact(RunDir(root).url("run.json"), RunManifest)
            if _same_training(PipelineConfig.model_validate(manifest.config), config):
                return open_run(root, parent.progress)
        except (ArtifactError, ValueError, StageInputError):
            continue  # an unreadable or foreign variant: not reused
    return prepare_variant(parent, Variant(name, {}, config))


def train_missing(jobs: list[Job], run_one: RunOne = run_here,
                  progress: Callable[[int, int], None] | None = None) -> None:
    """Run the train stage of every trained job (its run directory's): cached ones return at once."""
    trained = [j for j in jobs if j.system.kind == "trained"]
    for i, job in enumerate(trained):
        run_one(job.ctx, "train", False)
        if progress:
            progress(i + 1, len(trained))


@dataclass
class Obtained:
    provider: Any
    state_bytes: int
    seconds: float | None  # training (from its manifest), fitting or press time
    arch: str | None
    source: str
    state_seconds: float | None = None  # document → usable state (see ComparisonRow.state_seconds)
    document_only: bool = False  # a baseline that needs no captured query: its time is prefill + fit
    reads: frozenset[str] = frozenset()  # a baseline: what its state method reads (StateMethod.reads)

    @property
    def reads_document(self) -> bool:
        return "document" in self.reads


def obtain(job: Job, ctx: RunContext, base, doc_kv, dims: dict[str, Any]) -> Obtained:
    """The provider of one job and the bytes it stores."""
    s = job.system
    if s.name == "none":
        return Obtained(None, 0, None, None, "no document")
    if s.name == "full":
        return Obtained(ExactDocState(doc_kv), doc_kv.nbytes(), None, None, "document KV cache")
    if s.kind == "kvpress":
        return Obtained(None, 0, None, s.press, "kvpress")  # scored in kvpress's venv (score_kvpress)
    if s.kind == "trained":
        from ..modules.io import load_module
        from ..modules.provider import ModuleDocState

        manifest = job.ctx.run.read_manifest("train")
        if manifest is None:
            raise CompareInputError(f"{job.key}: its train stage in {job.ctx.run.root} has not completed")
        module, spec = load_module(job.ctx.run.url("train"), base, ctx.info.sha256, device=base.device)
        return Obtained(ModuleDocState(module), spec.module_bytes, manifest.duration_s, spec.arch, job.ctx.run.root)
    if s.kind == "run":
        return _run_state(job, ctx, base)
    method = system_method(s, ctx.config.train.module)
    t0 = time.perf_counter()
    inputs = FitInputs(doc_kv, ctx.stage_run("targets").url("targets"), seed=ctx.config.train.seed, bits=s.bits)
    if method.reads_document:
        inputs = _with_document(inputs, ctx, base)
    provider = method.fit(baseline_plan(ctx, job.rho, dims), inputs)
    seconds = time.perf_counter() - t0
    return Obtained(provider, int(provider.nbytes), seconds, s.method, f"fit_method({s.method!r})",
                    document_only=method.reads_document and not method.reads_train_queries, reads=method.reads)


def _run_state(job: Job, ctx: RunContext, base) -> Obtained:
    """The run's first or refined state as its stage wrote it, with the seconds the run took to it."""
    from ..modules.io import load_module
    from ..modules.provider import ModuleDocState
    from ..orchestration.live import FIRST_PATH, REFINED_PATH, live_stage, seconds_to

    stage = RUN_STATES[job.system.name][0]
    manifest = ctx.run.read_manifest(stage)
    if manifest is None:
        raise CompareInputError(f"{job.key}: the {stage} stage in {ctx.run.root} has not completed")
    module, spec = load_module(ctx.run.url(stage), base, ctx.info.sha256, device=base.device)
    path = FIRST_PATH if stage == "first" else REFINED_PATH
    seconds = seconds_to(ctx.run, path)
    if seconds is None and stage == "train":  # no promote yet: the stages up to train
        seconds = seconds_to(ctx.run, path[:-1])
    if stage == "first":  # timed again here, beside the presses of this compare (the same load)
        seconds = refit_first_seconds(ctx, base) + (seconds_to(ctx.run, ("chunk",)) or 0.0)
    live = " (live)" if live_stage(ctx.run) == stage else ""
    return Obtained(ModuleDocState(module), spec.module_bytes, manifest.duration_s, spec.arch,
                    f"{ctx.run.url(stage)}{live}", state_seconds=seconds)


def refit_first_seconds(ctx: RunContext, base) -> float:
    """Seconds the first stage's work takes now (prefill, reconstruction, selection, fit, write into a
    scratch folder): the run's manifest timed it under whatever load that minute had; a compare times
    it again beside kvpress's press, so the ``state_seconds`` of the two are measured side by side."""
    import tempfile

    from ..stages.first import first_state

    cfg = ctx.config
    with tempfile.TemporaryDirectory() as scratch:
        t0 = time.perf_counter()
        first_state(base, ctx.text, cfg.first, cfg.train.module, cfg.targets.recon, cfg.targets.probes,
                    ctx.info.sha256, scratch)
        return time.perf_counter() - t0


def _with_document(inputs: FitInputs, ctx: RunContext, base) -> FitInputs:
    """A method that reads the document (recon_fit): the model, the layout, the reconstruction spans."""
    tcfg = ctx.config.targets
    spans = tuple((r.instruction, r.response) for r in make_recon(ctx.text, tcfg.recon, tcfg.probes))
    return dataclasses.replace(inputs, base=base, layout=build_layout(base.tokenizer, ctx.text), document=ctx.text,
                               spans=spans)


def withheld_probe_ids(ctx: RunContext, targets_url: str) -> set[str]:
    """Held-out probes lying wholly in the units reconstruction leaves out (nectar/stages/recon.py)."""
    from ..schemas.artifacts import ProbeRow
    from ..stages.probes import split_units
    from ..stages.recon import withheld_units

    tcfg = ctx.config.targets
    withheld = withheld_units(len(split_units(ctx.text)), tcfg.recon, tcfg.probes)
    probes = read_table(f"{targets_url}/probes.parquet", ProbeRow)
    return {p.probe_id for p in probes if p.split == "probes"
            and all(u in withheld for u in range(p.first_unit, p.last_unit + 1))}


@dataclass
class CompareResult:
    rows: list[ComparisonRow]
    files: list[str]
    timings: dict[str, float] = field(default_factory=dict)
    markdown: str = ""


def data_stage_seconds(ctx: RunContext) -> float | None:
    """Seconds the run's data stages took (chunk → targets, from their manifests): what a state that
    reads the captured queries waits for before its own fit or training."""
    total = 0.0
    for stage in SHARED_DATA_STAGES:
        manifest = ctx.stage_run(stage).read_manifest(stage)
        if manifest is None:
            return None
        total += manifest.duration_s
    return total


def prefill_seconds(base, context_ids) -> float:
    """Seconds of one prefill of the document: the full KV cache's time to state."""
    t0 = time.perf_counter()
    prefill_document(base, context_ids)
    return time.perf_counter() - t0


def state_seconds(job: Job, o: Obtained, data_s: float | None, prefill_s: float) -> float | None:
    s = job.system
    if s.kind == "run":
        return o.state_seconds  # the run's own stages up to it (_run_state)
    if s.name == "none":
        return 0.0
    if s.name == "full":
        return prefill_s
    if s.kind == "kvpress" or (s.kind == "baseline" and o.reads == frozenset({"doc_kv"})):
        return o.seconds  # from the document alone
    if o.document_only and o.seconds is not None:  # recon_fit on reconstruction alone: prefill, then its fit
        return prefill_s + o.seconds
    if o.seconds is None or data_s is None:
        return None
    return data_s + o.seconds  # trained states and the baselines that read the captured queries


def score_kvpress(ctx: RunContext, base, context_ids, doc_kv, pairs: list[EvalPair], jobs: list[Job],
                  obtained: dict[str, "Obtained"], sums: dict, notes: dict[str, Any],
                  out: str | None = None) -> list[Job]:
    """Score the kvpress jobs in kvpress's venv; fill ``sums`` and ``obtained`` for those that ran and
    return them. Jobs that cannot run are reported (printed and in ``notes``) and left out: the
    comparison goes on without their rows."""
    if not jobs:
        return []
    press_jobs = [PressJob(j.key, j.system.press, j.rho, j.system.bits) for j in jobs]
    try:
        result: BridgeResult = score_presses(base, ctx.config.model, list(context_ids), doc_kv, pairs, press_jobs,
                                             _fs(f"{out.rstrip('/')}/kvpress")[1] if out else ctx.run.local_path("compare", "kvpress"))
    except (KvpressEnvError, KvpressError) as exc:
        print(f"kvpress rows left out: {exc}")
        notes["kvpress"] = {"error": str(exc)}
        return []
    notes["kvpress"] = {**result.facts, "guard_max_token_kl": result.guard_max_kl, "errors": result.errors}
    for key, why in result.errors.items():
        print(f"kvpress row {key} left out: {why}")
    ran = []
    for j in jobs:
        r = result.results.get(j.key)
        if r is None:
            continue
        sums[j.key] = r.sums
        precision = "fp32" if j.system.bits == 32 else f"int{j.system.bits}"
        obtained[j.key] = Obtained(None, r.state_bytes, r.press_s, j.system.press,
                                   f"kvpress {result.facts.get('kvpress_version') or ''} {j.system.press}, "
                                   f"{r.kept_entries} entries at {precision}")
        ran.append(j)
    return ran


def _fs(url: str):
    import fsspec

    return fsspec.core.url_to_fs(url)


def compare_dir(ctx: RunContext, out: str | None = None) -> str:
    """Where the comparison is written: ``--out DIR``, or RUN/compare."""
    return out.rstrip("/") if out else ctx.run.url("compare")


def score_and_write(ctx: RunContext, jobs: list[Job], progress: ProgressFactory | None = None,
                    timings: dict[str, float] | None = None, questions: str | None = None,
                    out: str | None = None) -> CompareResult:
    """Steps 3–5: fit the baselines, score every job's provider on the held-out pairs (and on the user's
    ``questions`` file, as the ``questions`` split), write the outputs (into ``out``, default RUN/compare)."""
    bar = progress or (lambda name: (lambda d, t: None))
    timings = dict(timings or {})
    cfg = ctx.config.evaluate
    base = load_base(ctx.config)
    layout = build_layout(base.tokenizer, ctx.text)
    doc_kv = load_run_doc_kv(ctx)
    dims = _dims(ctx)
    t0 = time.perf_counter()
    fit_bar = bar("compare:fit")
    obtained: dict[str, Obtained] = {}
    for i, job in enumerate(jobs):
        obtained[job.key] = obtain(job, ctx, base, doc_kv, dims)
        fit_bar(i + 1, len(jobs))
    timings["load_and_fit_s"] = time.perf_counter() - t0
    targets = ctx.stage_run("targets").url("targets")
    g, _ = open_targets(targets_zarr_url(targets))
    target_rows = read_table(f"{targets}/pairs.parquet", TargetsPairRow)
    sel = select_pairs(target_rows, g["token_ids"][:], cfg, evaluated_splits(target_rows, cfg))
    if any(o.reads_document for o in obtained.values()):  # what reconstruction saw vs what it did not
        sel = with_subset(sel, "probes", "probes_withheld", withheld_probe_ids(ctx, targets), cfg)
    notes: dict[str, Any] = {}
    if questions:  # reference answers cached in RUN/questions/<sha256[:16]>/, shared with the evaluate stage
        loaded = load_questions(questions, base, layout, ExactDocState(doc_kv), ctx.run.url("questions"), cfg,
                                bar("compare:questions"))
        sel = with_questions(sel, loaded.pairs, cfg)
        notes["questions"] = {"file": questions, **loaded.counts()}
    kv_jobs = [j for j in jobs if j.system.kind == "kvpress"]
    extra_sums: dict = {}
    t0 = time.perf_counter()
    ran = score_kvpress(ctx, base, layout.context_ids, doc_kv, sel.pairs, kv_jobs, obtained, extra_sums, notes, out)
    if kv_jobs:
        timings["kvpress_s"] = time.perf_counter() - t0
    jobs = [j for j in jobs if j.system.kind != "kvpress" or j in ran]
    providers = {"full": obtained["full"].provider if "full" in obtained else ExactDocState(doc_kv), "none": None,
                 **{k: o.provider for k, o in obtained.items()
                    if k not in ("full", "none") and k not in {j.key for j in kv_jobs}}}
    bars: dict[str, Callable[[int, int], None]] = {}

    def step(name: str, done: int, total: int) -> None:
        if name not in bars:
            bars[name] = bar(f"compare:{name}")
        bars[name](done, total)

    sums, quality = score_providers(base, layout.n, providers, sel, cfg, SCORE_BATCH, GEN_BATCH, step, timings,
                                    extra_sums)
    notes["differences"] = (differences_vs_kvpress(jobs, sums, sel, quality, cfg)
                            + differences_vs_start(jobs, sums, sel, quality, cfg))
    data_s, prefill_s = data_stage_seconds(ctx), prefill_seconds(base, layout.context_ids)
    for job in jobs:
        obtained[job.key].state_seconds = state_seconds(job, obtained[job.key], data_s, prefill_s)
    rows = comparison_rows(jobs, obtained, quality)
    timings["total_s"] = sum(v for k, v in timings.items() if k != "total_s")
    facts = {"run": ctx.run.root, "document": ctx.info.source_uri, "model": base.name, "n": layout.n,
             "kv_bytes": doc_kv.nbytes(), "kv_dtype": str(doc_kv.keys[0].dtype).removeprefix("torch."),
             "created_at": now()}
    return write_outputs(ctx.run, rows, facts, timings, notes, allocations(obtained), out)


def differences_vs_kvpress(jobs: list[Job], sums: dict, sel, quality, cfg) -> list[dict[str, Any]]:
    """Each system's recovered KL minus the best kvpress press's at the same budget, on every split:
    the paired bootstrap of the gap on the same pairs (nectar/evaluation/bootstrap.py). The reference
    is the press with the highest recovered KL on that split at that ρ; none without kvpress rows."""
    out = []
    for split, idx in sel.split_index().items():
        if not len(idx) or split not in quality:
            continue
        pairs = []
        for rho in sorted({j.rho for j in jobs if j.rho is not None}):
            at = [j for j in jobs if j.rho == rho]
            presses = [j for j in at if j.system.kind == "kvpress"]
            if not presses:
                continue
            ref = max(presses, key=lambda j: quality[split][j.key].recovered_kl.value)
            pairs += [(j.key, ref.key) for j in at if j.system.kind != "kvpress"]
        out += _paired(sums, idx, split, pairs, cfg)
    return out


def differences_vs_start(jobs: list[Job], sums: dict, sel, quality, cfg) -> list[dict[str, Any]]:
    """Each refined state's recovered KL minus that of the closed-form state it starts from
    (``System.refines``), at the same budget and on the same pairs, when both are in the compare:
    what the gradient steps add."""
    keys = {(j.system.name, j.rho): j.key for j in jobs}
    pairs = [(j.key, keys[(j.system.refines, j.rho)]) for j in jobs
             if j.system.refines and (j.system.refines, j.rho) in keys]
    return [d for split, idx in sel.split_index().items() if len(idx) and split in quality
            for d in _paired(sums, idx, split, pairs, cfg)]


def _paired(sums: dict, idx, split: str, pairs: list[tuple[str, str]], cfg) -> list[dict[str, Any]]:
    out = []
    if pairs:
        split_sums = {k: s.take(idx) for k, s in sums.items()}
        for (a, b), est in recovered_differences(split_sums, pairs, split, cfg.bootstrap_resamples,
                                                 cfg.seed).items():
            out.append({"split": split, "system": a, "reference": b, "n_pairs": est.n_pairs,
                        "delta_recovered_kl": est.value, "low": est.low, "high": est.high})
    return out


def differences_markdown(differences: list[dict[str, Any]]) -> str:
    """The paired gaps as a section of comparison.md ('' when there are none)."""
    if not differences:
        return ""
    lines = ["", "", "## Paired differences: recovered KL minus a reference's at the same budget", "",
             "The reference is the best kvpress press at that budget, or, for a refined state, the closed-form "
             "state its gradient steps start from. Points of recovered KL, 95 % paired bootstrap over the "
             "split's pairs (the same resamples as the intervals above): an interval wholly above 0 means the "
             "system keeps more of the document than the reference on these pairs; one containing 0 is a tie.", "",
             "| split | system | reference | pairs | Δ recovered KL, points [95% CI] |", "|---|---|---|---|---|"]
    for d in differences:
        est = Estimate(d["delta_recovered_kl"], d["low"], d["high"], d["n_pairs"])
        lines.append(f"| {d['split']} | {d['system']} | {d['reference']} | {d['n_pairs']} | "
                     f"{est.fmt(1, 100)} |")
    return "\n".join(lines) + "\n"


def allocations(obtained: dict[str, Obtained]) -> dict[str, list[list[int]]]:
    """Kept pairs per (layer, KV head) of every state whose heads differ in width (the heat map)."""
    out = {}
    for key, o in obtained.items():
        plan = getattr(o.provider, "plan", None)
        if plan is not None and plan.quad_head_pairs:
            out[key] = [list(h) for h in plan.quad_head_pairs]
    return out


def comparison_rows(jobs: list[Job], obtained: dict[str, Obtained], quality) -> list[ComparisonRow]:
    rows = []
    for split, by_system in quality.items():
        for job in jobs:
            o = obtained[job.key]
            cols = by_system[job.key].columns()
            rows.append(ComparisonRow(
                system=job.system.name, kind=job.system.kind, regime=job.system.regime, arch=o.arch, rho=job.rho,
                state_bytes=o.state_bytes, split=split, train_seconds=o.seconds, state_seconds=o.state_seconds,
                source=o.source, **ComparisonRow.quality(cols)))
    return rows


def write_outputs(run: RunDir, rows: list[ComparisonRow], facts: dict[str, Any],
                  timings: dict[str, float], notes: dict[str, Any] | None = None,
                  allocation: dict[str, list[list[int]]] | None = None, out: str | None = None) -> CompareResult:
    from ..evaluation.plots import allocation_heatmap, frontier
    from .table import comparison_markdown

    if out:
        fs, path = _fs(out)
        fs.makedirs(path, exist_ok=True)
        out = out.rstrip("/")
    else:
        out = run.makedirs("compare")
    write_table(f"{out}/comparison.parquet", rows, ComparisonRow)
    data = [r.model_dump(exclude={"schema_version"}) for r in rows]
    png = frontier(data)
    files = ["comparison.parquet", "comparison.md", "info.json"]
    if png is not None:
        atomic_write(f"{out}/frontier.png", png)
        files.append("frontier.png")
    md = comparison_markdown(data, facts, "frontier.png" if png is not None else None)
    md += differences_markdown((notes or {}).get("differences", []))
    heat = allocation_heatmap(allocation or {})
    if heat is not None:  # where one budget across layers and heads put the bytes
        atomic_write(f"{out}/allocation.png", heat)
        atomic_write(f"{out}/allocation.json", json.dumps(allocation))
        files += ["allocation.png", "allocation.json"]
        md += ("\n\n## Kept pairs per layer × KV head\n\n![allocation](allocation.png)\n\n"
               "(counts in allocation.json; a per-head budget would put the same number in every cell)\n")
    atomic_write(f"{out}/comparison.md", md)
    info = {**facts, "timings_s": {k: round(v, 2) for k, v in timings.items()},
            "systems": list(dict.fromkeys(r.system for r in rows)),
            "rhos": sorted({r.rho for r in rows if r.rho is not None}),
            "splits": {s: next(r.n_pairs for r in rows if r.split == s) for s in dict.fromkeys(r.split for r in rows)},
            **(notes or {})}
    atomic_write(f"{out}/info.json", json.dumps(info, indent=1, default=str))
    return CompareResult(rows, files, info["timings_s"], md)


def compare(ctx: RunContext, systems: list[str] | None = None, rhos: list[float] | None = None,
            run_one: RunOne = run_here, progress: ProgressFactory | None = None, questions: str | None = None,
            out: str | None = None) -> CompareResult:
    """Plan, train what is missing, score and write (into ``out``, or RUN/compare); ``run_one`` runs a
    stage (the Prefect flow's runs it as a subflow)."""
    check_ready(ctx)
    refresh_targets(ctx, run_one)
    jobs = plan_jobs(ctx, systems, rhos)
    t0 = time.perf_counter()
    train_missing(jobs, run_one, progress("compare:train") if progress else None)
    return score_and_write(ctx, jobs, progress, {"train_s": time.perf_counter() - t0}, questions, out)
