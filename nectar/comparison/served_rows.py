"""The ``served`` rows (``vllm:trained``, ``vllm:attention_matching_kv@int4``): the run's state exported for
vLLM, served by a vLLM server started and stopped here (``measured_server``: its process group, on error and
Ctrl-C too), and scored on the held-out probes through vLLM's prompt_logprobs (``probe_fidelity``).

vLLM returns only its top k log-probabilities per position, so the served row's KL is over coarse buckets
(those k tokens, the rest of the vocabulary as one): a lower bound of the full KL. The row says so
(``kl_basis``), the split tables leave it out, and its section of comparison.md puts it beside the torch
engine's figure for the same state file on the same buckets — the comparison it supports — and the torch
engine's full-vocabulary figure.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Callable

from ..evaluation.teacher import EvalPair
from ..orchestration.context import RunContext
from ..schemas.artifacts import ComparisonRow
from .inputs import CompareInputError
from .systems import System

if TYPE_CHECKING:  # jobs.py checks the served systems with check_served below
    from .jobs import Job

# vLLM's top k per position (its --max-logprobs): the fidelity benchmark's; more buckets, a tighter bound
TOP_K = 100
SPLIT = "probes"  # what the row is scored on: the held-out probes (the benchmark's figure)


def basis(top_k: int = TOP_K) -> str:
    """The row's ``kl_basis``: what its KL is over."""
    return f"top-{top_k} buckets"


def check_served(ctx: RunContext, systems: list[System]) -> None:
    """Before anything is trained or scored: a served system needs vLLM's venv, a model vLLM can load and (for
    ``vllm:trained``) the run's trained module; one line naming the problem and its fix otherwise."""
    from ..serving.engines.vllm import model_path
    from ..vllm.state import NotPlainKV
    from ..vllm.venv import VLLMError, interpreter

    served = [s for s in systems if s.kind == "served"]
    if not served:
        return
    name = served[0].name
    try:
        interpreter(build=False)
        model_path(ctx.config.model.name)
    except (VLLMError, NotPlainKV) as exc:
        raise CompareInputError(f"system {name}: {exc}") from None
    for s in served:
        if s.served == "trained" and not ctx.run.exists("train", "module.json"):
            raise CompareInputError(f"system {s.name}: {ctx.run.root} has no trained module (its train stage has "
                                    "not run); `nectar run` it first, or ask for vllm:attention_matching_kv@int4")


def probe_pairs(pairs: list[EvalPair]) -> list[EvalPair]:
    return [p for p in pairs if SPLIT in p.splits]


def score_served(ctx: RunContext, base, doc_kv, pairs: list[EvalPair], jobs: list[Job], notes: dict[str, Any],
                 log: Callable[[str], None] = print) -> list[ComparisonRow]:
    """One vLLM server per served job, scored on the probes and stopped; its row and, in ``notes['served']``,
    its figures beside the torch engine's. A job that cannot run is left out with one line (printed and in
    the notes): the comparison goes on without its row, as with kvpress."""
    from ..vllm.state import NotPlainKV
    from ..vllm.venv import VLLMError

    # what a served row can meet that is no bug here: vLLM's venv or start (VLLMError names its log), a state
    # vLLM cannot serve (NotPlainKV), the server's answers (URLError, HTTPError, timeouts: OSError)
    expected = (VLLMError, NotPlainKV, OSError)
    if not jobs:
        return []
    probes = probe_pairs(pairs)
    found: dict[str, Any] = {}
    notes["served"] = found
    rows = []
    for job in jobs:
        if not probes:
            found[job.key] = {"error": f"the run has no held-out {SPLIT} to score it on"}
        else:
            try:
                row, found[job.key] = served_row(ctx, base, doc_kv, probes, job, log)
                rows.append(row)
                continue
            except expected as exc:
                found[job.key] = {"error": " ".join(str(exc).split())}
        log(f"served row {job.key} left out: {found[job.key]['error']}")
    return rows


def served_row(ctx: RunContext, base, doc_kv, probes: list[EvalPair], job: Job,
               log: Callable[[str], None]) -> tuple[ComparisonRow, dict[str, Any]]:
    """Export the job's state, serve it, score it on ``probes`` through vLLM and the torch engine."""
    import time

    from ..evaluation.vllm_equivalence import probe_fidelity
    from ..serving.engines.vllm import VLLMOptions, measured_server
    from ..serving.engines.vllm_export import export_run_state
    from ..vllm.serve import placeholder_token

    run_dir = ctx.run.root
    t0 = time.perf_counter()
    state = export_run_state(run_dir, job.system.served, log)  # the same file the server loads (reused there)
    export_s = time.perf_counter() - t0
    longest = max(len(p.ids) for p in probes)
    opts = VLLMOptions(port=0, dtype=ctx.config.model.dtype, enforce_eager=True, source=job.system.served,
                       max_logprobs=TOP_K, max_model_len=state.m + longest + 16, startup_timeout_s=1800)
    pid, _ = placeholder_token(base.tokenizer)
    with measured_server(run_dir, opts, log) as (server, spec, doc):
        log(f"{job.key}: vLLM serving {doc.m} pairs per layer{' with β' if doc.bias else ''} "
            f"(started in {server.startup_s} s); scoring {len(probes)} {SPLIT} through it …")
        t0 = time.perf_counter()
        fid = probe_fidelity(base, doc_kv, doc.state_path, server.root_url, spec.served_name, probes, pid,
                             doc.doc_id, TOP_K, seed=ctx.config.evaluate.seed)
        score_s = time.perf_counter() - t0
        facts = {**fid.as_dict(), "source": doc.state_path, "state": state.source, "m": doc.m, "bias": doc.bias,
                 "bytes": os.path.getsize(state.path),
                 "vllm": server.version, "dtype": opts.dtype, "start_s": server.startup_s,
                 "export_s": round(export_s, 1), "score_s": round(score_s, 1), "kl_basis": basis()}
    log(f"{job.key}: {fid.line()}")
    # its bytes: the file vLLM loads (codes decoded to float: as vLLM holds the pairs), not the stored state's
    row = ComparisonRow(system=job.system.name, kind="served", rho=job.rho, state_bytes=facts["bytes"],
                        split=SPLIT, n_pairs=fid.pairs, n_tokens=fid.tokens, kl_to_full=fid.kl_vllm.value,
                        kl_ci_low=fid.kl_vllm.low, kl_ci_high=fid.kl_vllm.high,
                        recovered_kl=fid.recovered_vllm.value, recovered_kl_ci_low=fid.recovered_vllm.low,
                        recovered_kl_ci_high=fid.recovered_vllm.high,
                        source=f"vLLM {server.version or ''} serving {state.source} ({doc.state_path})".replace("  ", " "),
                        kl_basis=basis())
    return row, facts
