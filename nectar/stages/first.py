"""The first stage: a usable state from the document alone, before any LLM server starts (pure
function, no Prefect).

    first_state(base, text, cfg, doc_sha256, out_url)  →  out_url/module.safetensors
                                                          out_url/module.json   (ModuleSpec)

chunk → reconstruction targets → fit, as kvpress's KVzip needs only the document: the document is
prefilled once, its reconstruction spans (nectar/queries/recon.py) are run against its exact KV to
score every key and capture (q, α, A) of the span tokens, the best keys of all layers and KV heads are
kept under the train module's byte budget, and β and the values are fitted in closed form to the
keys as stored (the ``recon_fit`` state method, ``recon_first@int4`` of ``nectar compare``;
nectar/states/recon_fit.py). Where that leaves keys scarce (at most 5 % of the document's entries: ~0.7 % of
the float32 bytes at int4 and below) the fit is published first and then refined end to end on the same
reconstruction (``first.refine``, nectar/states/recon_refine.py: minutes). No question
about the document exists yet; the promote stage later swaps in the refined state (fitted with the
self-study questions too) when it is better on the run's held-out pairs.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable

from ..base_model import BaseLM
from ..layout import build_layout, check_fits
from ..modules.builder import ModulePlan, plan_from_config
from ..modules.io import make_spec, save_module
from ..schemas.config import FirstConfig, ModuleConfig, ReconConfig, ProbesConfig
from ..queries.recon import make_recon
from ..states import fit_recon
from ..states.recon_refine import refine_fitted, refines

FIRST_OUTPUTS = ["module.safetensors", "module.json"]


def first_plan(train_module: ModuleConfig, cfg: FirstConfig, base: BaseLM, n_context: int) -> ModulePlan:
    """The bytes the first state's selection allocates: the train module's plan (its ρ of the float32
    document KV), its kept pairs stored at ``cfg.bits`` — what ``nectar compare`` sizes recon_fit@int4
    by (states/recon_fit.py ``ReconFit.plan``), so the two states weigh the same."""
    plan = plan_from_config(train_module, base.num_layers, base.num_kv_heads, base.head_dim, n_context, base.scaling)
    return dataclasses.replace(plan, bits=cfg.bits)


def first_state(base: BaseLM, text: str, cfg: FirstConfig, train_module: ModuleConfig, recon: ReconConfig,
                probes: ProbesConfig, doc_sha256: str, out_url: str, max_query_tokens: int = 0,
                on_fitted: Callable[[dict], None] | None = None,
                progress: Callable[[int, int], None] | None = None) -> dict:
    """Prefill, reconstruct, select and fit; write the module and its spec into ``out_url``; return
    the stage counts with the seconds of each part (prefill_s, recon_s, allocate_s, fit_s with its
    shares fit_mass_s and fit_values_s, write_s) — the profile ``nectar run`` and benchmarks/first_state_scaling.py report.

    Where ``first.refine`` steps follow (keys scarce, or ``when: always``), the fitted state is written first and
    ``on_fitted(counts)`` called — the stage publishes it live, so the minutes of steps do not delay the first
    answer — and then the refined state replaces it in ``out_url`` (``progress(done, total)`` after each step)."""
    from ..attention.doc_kv import prefill_document

    timings: dict[str, float] = {}
    layout = build_layout(base.tokenizer, text)
    check_fits(layout, max_query_tokens, base.max_context_tokens)
    start = time.perf_counter()
    doc_kv = prefill_document(base, layout.context_ids)  # keys/values [Hkv, n, d] per layer
    timings["prefill_s"] = time.perf_counter() - start
    # the spans the train stage's recon_fit state reconstructs (the same withheld blocks, if any)
    spans = [(s.instruction, s.response) for s in make_recon(text, recon, probes)]
    plan = first_plan(train_module, cfg, base, layout.n)
    fitted = fit_recon(base, layout, text, doc_kv, None, plan, cfg.select, spans, cfg.seed, timings=timings)
    refined = refines(cfg.refine, fitted.plan, layout.n)
    if refined and on_fitted is not None:  # the fit answers while the steps run
        on_fitted(_write(base, fitted, doc_sha256, out_url, layout.n, cfg.bits, len(spans), timings, refined=False))
    # first.refine: gradient steps end to end on the same spans (minutes; where keys are scarce)
    fitted = refine_fitted(base, layout, doc_kv, spans, fitted, cfg.refine, cfg.seed, timings, progress)
    return _write(base, fitted, doc_sha256, out_url, layout.n, cfg.bits, len(spans), timings, refined)


def _write(base: BaseLM, fitted, doc_sha256: str, out_url: str, n: int, bits: int, n_spans: int,
           timings: dict[str, float], refined: bool) -> dict:
    """Save ``fitted`` as the stage's module and spec; the stage counts (``refined``: the steps ran on it)."""
    start = time.perf_counter()
    module = fitted.module.cpu().eval()
    spec = make_spec(module, fitted.plan, base.name, base.weights_hash, doc_sha256, base.num_q_heads,
                     normalization={"enabled": False, "source": "closed form (first state)"})
    save_module(module, spec, out_url)
    timings["write_s"] = timings.get("write_s", 0.0) + time.perf_counter() - start
    kept = sum(sum(c) for c in fitted.plan.quad_head_pairs)
    return {"n_context": n, "recon_spans": n_spans, "kept_keys": kept,
            "kept_share": round(kept / (n * base.num_layers * base.num_kv_heads), 4),
            "module_bytes": spec.module_bytes, "kv_cache_bytes": spec.kv_cache_bytes,
            "kv_over_module": round(spec.kv_cache_bytes / spec.module_bytes, 2), "bits": bits, "refined": refined,
            **{k: round(v, 3) for k, v in timings.items()}}
