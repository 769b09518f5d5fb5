"""Seconds from the document to a usable state, per system (``ComparisonRow.state_seconds``): what the
full KV's prefill, a press, a fit or the run's stages up to a state take.
"""
from __future__ import annotations

import time

from ..attention.doc_kv import prefill_document
from ..orchestration.context import SHARED_DATA_STAGES, RunContext
from .jobs import Job
from .obtain import Obtained


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
    if s.kind == "kvpress" or (s.kind == "method" and o.reads == frozenset({"doc_kv"})):
        return o.seconds  # from the document alone
    if o.document_only and o.seconds is not None:  # recon_fit on reconstruction alone: prefill, then its fit
        return prefill_s + o.seconds
    if o.seconds is None or data_s is None:
        return None
    return data_s + o.seconds  # trained states and the baselines that read the captured queries
