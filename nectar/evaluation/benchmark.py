"""The generation benchmark (paper App. F): TTFT, decode tokens/s and peak memory against n.

Three systems answer the same prompt after a document of n tokens:
  module       the module (its fused inference form) stands in for the document; nothing is prefilled
  full_cold    the document is prefilled first (its KV computed), then the prompt is answered
  full_cached  the document's KV is already there (prefix cache); only the prompt is run
All three run on the one decode engine (nectar.attention.engine); only the document provider
differs (module vs ExactDocState over the KV cache), so the ratio isolates the document.
Decoding is greedy and never stops early, so every system decodes exactly ``new_tokens`` tokens.
Documents of each length are the run's document tokens tiled (repeated) and truncated to n.

The evaluate stage and ``benchmarks/bench_generation.py`` both call ``run_benchmark`` with the same
defaults (repeats, warm-up), so the stage's table and the script's agree up to machine noise; the
script adds the transformers baselines, batched decoding and the bandwidth bound.
"""
from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from ..attention.doc_kv import prefill_document
from ..attention.engine import DecodeEngine, GenerationResult, Request
from ..attention.exact import ExactDocState
from ..base_model import BaseLM
from ..modules.budget import BudgetError
from ..modules.builder import ModulePlan, build_module, plan_module
from ..modules.provider import inference_provider
from ..schemas.artifacts import BenchmarkRow
from .memory import track_peak_memory

BENCH_PROMPT = "Summarize the document in two sentences."
REPEATS = 3  # median of 3: one 32-token decode on a shared machine is too noisy to compare


@dataclass
class BenchModule:
    """A module to time at one document length: its provider, its size and how it was made."""

    provider: Callable
    state_bytes: int
    note: str


ModuleFactory = Callable[[int, Sequence[int]], BenchModule]  # (n, context ids) → module


class BenchmarkError(ValueError):
    pass


@dataclass
class BenchmarkResult:
    rows: list[BenchmarkRow]
    skipped: list[str]  # lengths whose module could not be built, with the reason


def context_of_length(context_ids: Sequence[int], n: int) -> list[int]:
    """The document's token ids repeated and truncated to exactly n tokens."""
    if not context_ids:
        raise BenchmarkError("the run's document has no tokens to build benchmark contexts from")
    reps = -(-n // len(context_ids))
    return (list(context_ids) * reps)[:n]


def same_architecture(base: BaseLM, plan: ModulePlan, seed: int = 0) -> ModuleFactory:
    """Modules of ``plan``'s architecture re-planned for each n (the per-layer ρ_ℓ kept, so the
    budget scales with n), with *random* initial weights: their cost is what is timed, not their
    answers. Quadrature modules start from the first p document keys/values, as in training."""

    def make(n: int, context_ids: Sequence[int]) -> BenchModule:
        # One "group" per layer with the trained per-layer rho as multiplier reproduces rho_l exactly.
        p = plan_module(plan.arch, plan.num_layers, plan.num_kv_heads, plan.head_dim, n, plan.scaling,
                        plan.rho, tuple(plan.layer_rhos), plan.score_fraction, tuple(plan.depths),
                        plan.residual, plan.layer_norm, plan.normalize_targets, plan.quad_bias)
        keys = values = None
        if p.arch == "quadrature":
            kv = prefill_document(base, list(context_ids)[: max(p.quad_pairs)])
            keys, values = kv.keys, kv.values
        module = build_module(p, keys, values, seed=seed).to(device=base.device, dtype=base.dtype).eval()
        nbytes = module.nbytes()
        note = f"random-init {p.arch} module of the same architecture (rho={p.rho:g}); timing only"
        return BenchModule(inference_provider(module, base.dtype), nbytes, note)

    return make


def _timed_generate(engine: DecodeEngine, prompt: list[int], new_tokens: int) -> GenerationResult:
    return engine.run([Request(prompt, new_tokens)])


def timed_batch(base: BaseLM, provider, n: int, prompts: Sequence[list[int]], new_tokens: int,
                repeats: int = REPEATS) -> tuple[float, float]:
    """Median TTFT (s) and median aggregate decode tokens/s of ``prompts`` decoded as one batch."""
    ttfts, rates = [], []
    engine = DecodeEngine(base, provider, n, stop_ids=())
    requests = [Request(p, new_tokens) for p in prompts]
    if engine.cuda_graphs:  # capture the decode graph outside the timed runs
        engine.run(requests)
    for _ in range(repeats):
        res = engine.run(requests)
        ttfts.append(res.ttft_s)
        rates.append(res.decode_tok_s)
    return statistics.median(ttfts), statistics.median(rates)


def _row(n, system, ttfts, rates, peak, method, state_bytes, prompt, new_tokens, device, note):
    return BenchmarkRow(n_context=n, system=system, ttft_s=statistics.median(ttfts),
                        decode_tok_s=statistics.median(rates), peak_memory_bytes=peak,
                        memory_method=method, state_bytes=state_bytes, prompt_tokens=len(prompt),
                        new_tokens=new_tokens, repeats=len(ttfts), device=str(device), note=note)


def bench_length(base: BaseLM, context_ids: Sequence[int], n: int, prompt: list[int],
                 module_for: ModuleFactory, new_tokens: int, repeats: int = REPEATS) -> list[BenchmarkRow]:
    """Measure the three systems at document length n.

    The repeats run in rounds that alternate the systems (module, cold, cached), so a machine whose
    speed drifts — a shared host — slows all three alike instead of whichever ran last. Each round
    drops the document KV before the module runs, so its peak memory holds no KV. One engine per
    provider (its buffers and, on CUDA, its captured decode graphs are reused across runs): the
    cold run is the first over its freshly prefilled KV, the cached run the second."""
    if n + len(prompt) + new_tokens > base.max_context_tokens:
        raise BenchmarkError(
            f"benchmark length n={n} plus {len(prompt)} prompt and {new_tokens} new tokens exceeds the "
            f"model's window of {base.max_context_tokens} tokens; lower evaluate.benchmark_lengths")
    ctx = context_of_length(context_ids, n)
    dev = base.device
    mod = module_for(n, ctx)
    module_engine = DecodeEngine(base, mod.provider, n, stop_ids=())
    if module_engine.cuda_graphs:  # capture its decode graph outside the timed rounds
        _timed_generate(module_engine, prompt, new_tokens)
    systems = ("module", "full_cold", "full_cached")
    ttfts: dict[str, list[float]] = {s: [] for s in systems}
    rates: dict[str, list[float]] = {s: [] for s in systems}
    peaks, method, kv_bytes = dict.fromkeys(systems, 0), "", 0

    def record(system: str, res: GenerationResult, pm, extra_s: float = 0.0) -> None:
        ttfts[system].append(extra_s + res.ttft_s)
        rates[system].append(res.decode_tok_s)
        peaks[system] = max(peaks[system], pm.peak_bytes)

    for _ in range(repeats):
        kv = None
        full_engine = None
        with track_peak_memory(dev) as pm:
            res = _timed_generate(module_engine, prompt, new_tokens)
        record("module", res, pm)
        with track_peak_memory(dev) as pm:
            t0 = time.perf_counter()
            kv = prefill_document(base, ctx)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            prefill_s = time.perf_counter() - t0
            full_engine = DecodeEngine(base, ExactDocState(kv), n, stop_ids=())
            res = _timed_generate(full_engine, prompt, new_tokens)
        record("full_cold", res, pm, prefill_s)
        with track_peak_memory(dev) as pm:
            res = _timed_generate(full_engine, prompt, new_tokens)
        record("full_cached", res, pm)
        kv_bytes, method = kv.nbytes(), pm.method
        del full_engine  # holds the KV
    notes = {"module": mod.note, "full_cold": "document prefilled, then the prompt",
             "full_cached": "document KV already computed (prefix cache)"}
    sizes = {"module": mod.state_bytes, "full_cold": kv_bytes, "full_cached": kv_bytes}
    return [_row(n, s, ttfts[s], rates[s], peaks[s], method, sizes[s], prompt, new_tokens, dev, notes[s])
            for s in systems]


def run_benchmark(base: BaseLM, context_ids: Sequence[int], prompt: list[int],
                  lengths: Sequence[int], module_for: ModuleFactory, new_tokens: int,
                  repeats: int = REPEATS, progress: Callable[[int, int], None] | None = None
                  ) -> "BenchmarkResult":
    """All systems at every length, after an untimed warm-up pass of every system at the smallest
    length (first-call costs — kernel selection, allocator growth, lazy init — are not measured)."""
    if new_tokens < 2:
        raise BenchmarkError(f"benchmark_new_tokens must be >= 2 to measure decoding, got {new_tokens}")
    with contextlib.suppress(BudgetError):
        bench_length(base, context_ids, min(lengths), prompt, module_for, 2, 1)  # warm-up, discarded
    rows: list[BenchmarkRow] = []
    skipped: list[str] = []
    for i, n in enumerate(sorted(lengths)):
        try:
            rows += bench_length(base, context_ids, n, prompt, module_for, new_tokens, repeats)
        except BudgetError as exc:  # too small a document for this architecture: say so, go on
            skipped.append(f"n={n}: {exc}")
        if progress:
            progress(i + 1, len(lengths))
    return BenchmarkResult(rows, skipped)


def ratios(rows: Sequence[BenchmarkRow]) -> list[dict[str, float | int]]:
    """Per n: module vs full cache speed-ups (TTFT: full/module; tok/s and memory: module/full)."""
    by = {(r.n_context, r.system): r for r in rows}
    out = []
    for n in sorted({r.n_context for r in rows}):
        mod = by.get((n, "module"))
        if mod is None:
            continue
        entry: dict[str, float | int] = {"n_context": n}
        for sysname in ("full_cold", "full_cached"):
            full = by.get((n, sysname))
            if full is None:
                continue
            tag = sysname.removeprefix("full_")
            entry[f"ttft_speedup_vs_{tag}"] = full.ttft_s / mod.ttft_s if mod.ttft_s > 0 else float("nan")
            entry[f"decode_speedup_vs_{tag}"] = (mod.decode_tok_s / full.decode_tok_s
                                                  if full.decode_tok_s > 0 else float("nan"))
            entry[f"peak_memory_ratio_vs_{tag}"] = (full.peak_memory_bytes / mod.peak_memory_bytes
                                                     if mod.peak_memory_bytes > 0 else float("nan"))
        entry["state_bytes_ratio"] = (by[(n, "full_cached")].state_bytes / mod.state_bytes
                                      if (n, "full_cached") in by and mod.state_bytes else float("nan"))
        out.append(entry)
    return out
