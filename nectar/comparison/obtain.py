"""Each job's state: the reference providers, a trained module, the run's own first or refined state, or a
closed-form method fitted here (kvpress presses are scored in their own venv, kvpress_rows.py).
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

from ..attention.exact import ExactDocState
from ..layout import build_layout
from ..orchestration.context import RunContext
from ..queries.recon import make_recon
from ..states import FitInputs
from .inputs import CompareInputError
from .jobs import Job, baseline_plan
from .systems import RUN_STATES, system_method


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
    if stage == "first":  # the fit timed again here, beside the presses of this compare (the same load)
        seconds = (refit_first_seconds(ctx, base) + (seconds_to(ctx.run, ("chunk",)) or 0.0)
                   + float(manifest.counts.get("refine_s", 0.0)))
    live = " (live)" if live_stage(ctx.run) == stage else ""
    return Obtained(ModuleDocState(module), spec.module_bytes, manifest.duration_s, spec.arch,
                    f"{ctx.run.url(stage)}{live}", state_seconds=seconds)


def refit_first_seconds(ctx: RunContext, base) -> float:
    """Seconds the first stage's fit takes now (prefill, reconstruction, selection, fit, write into a
    scratch folder): the run's manifest timed it under whatever load that minute had; a compare times
    it again beside kvpress's press, so the ``state_seconds`` of the two are measured side by side. Its
    end-to-end steps (``first.refine``, minutes where keys are scarce) are not run again: the caller adds
    the ``refine_s`` the run's first stage recorded."""
    import tempfile

    from ..stages.first import first_state

    cfg = ctx.config
    fit_only = cfg.first.model_copy(update={"refine": cfg.first.refine.model_copy(update={"steps": 0})})
    with tempfile.TemporaryDirectory() as scratch:
        t0 = time.perf_counter()
        first_state(base, ctx.text, fit_only, cfg.train.module, cfg.targets.recon, cfg.targets.probes,
                    ctx.info.sha256, scratch)
        return time.perf_counter() - t0


def _with_document(inputs: FitInputs, ctx: RunContext, base) -> FitInputs:
    """A method that reads the document (recon_fit): the model, the layout, the reconstruction spans."""
    tcfg = ctx.config.targets
    spans = tuple((r.instruction, r.response) for r in make_recon(ctx.text, tcfg.recon, tcfg.probes))
    return dataclasses.replace(inputs, base=base, layout=build_layout(base.tokenizer, ctx.text), document=ctx.text,
                               spans=spans)
