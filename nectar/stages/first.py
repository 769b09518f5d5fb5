"""The first stage: a usable state from the document alone, before any LLM server starts (pure
function, no Prefect).

    first_state(base, text, cfg, doc_sha256, out_url)  →  out_url/module.safetensors
                                                          out_url/module.json   (ModuleSpec)

chunk → reconstruction targets → fit, as kvpress's KVzip needs only the document: the document is
prefilled once, its reconstruction spans (nectar/queries/recon.py) are run against its exact KV to
score every key and capture (q, α, A) of the span tokens, the best keys of all layers and KV heads are
kept under the train module's byte budget, and β and the values are fitted in closed form to the
keys as stored (the ``recon_fit`` state method, ``recon_first@int4`` of ``nectar compare``;
nectar/states/recon_fit.py). No question
about the document exists yet; the promote stage later swaps in the refined state (fitted with the
self-study questions too) when it is better on the run's held-out pairs.
"""
from __future__ import annotations

import dataclasses
import time

from ..base_model import BaseLM
from ..layout import build_layout, check_fits
from ..modules.builder import ModulePlan, plan_from_config
from ..modules.io import make_spec, save_module
from ..schemas.config import FirstConfig, ModuleConfig, ReconConfig, ProbesConfig
from ..queries.recon import make_recon
from ..states import fit_recon
from ..states.recon_refine import refine_fitted

FIRST_OUTPUTS = ["module.safetensors", "module.json"]


def first_plan(train_module: ModuleConfig, cfg: FirstConfig, base: BaseLM, n_context: int) -> ModulePlan:
    """The bytes the first state's selection allocates: the train module's plan (its ρ of the float32
    document KV), its kept pairs stored at ``cfg.bits`` — what ``nectar compare`` sizes recon_fit@int4
    by (states/recon_fit.py ``ReconFit.plan``), so the two states weigh the same."""
    plan = plan_from_config(train_module, base.num_layers, base.num_kv_heads, base.head_dim, n_context, base.scaling)
    return dataclasses.replace(plan, bits=cfg.bits)


def first_state(base: BaseLM, text: str, cfg: FirstConfig, train_module: ModuleConfig, recon: ReconConfig,
                probes: ProbesConfig, doc_sha256: str, out_url: str, max_query_tokens: int = 0) -> dict:
    """Prefill, reconstruct, select and fit; write the module and its spec into ``out_url``; return
    the stage counts with the seconds of each part (prefill_s, recon_s, allocate_s, fit_s with its
    shares fit_mass_s and fit_values_s, write_s) — the profile ``nectar run`` and benchmarks/first_state_scaling.py report."""
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
    # first.refine: gradient steps end to end on the same spans (minutes; off unless set)
    fitted = refine_fitted(base, layout, doc_kv, spans, fitted, cfg.refine, cfg.seed, timings)
    start = time.perf_counter()
    module = fitted.module.cpu().eval()
    spec = make_spec(module, fitted.plan, base.name, base.weights_hash, doc_sha256, base.num_q_heads,
                     normalization={"enabled": False, "source": "closed form (first state)"})
    save_module(module, spec, out_url)
    timings["write_s"] = time.perf_counter() - start
    kept = sum(sum(c) for c in fitted.plan.quad_head_pairs)
    return {"n_context": layout.n, "recon_spans": len(spans), "kept_keys": kept,
            "kept_share": round(kept / (layout.n * base.num_layers * base.num_kv_heads), 4),
            "module_bytes": spec.module_bytes, "kv_cache_bytes": spec.kv_cache_bytes,
            "kv_over_module": round(spec.kv_cache_bytes / spec.module_bytes, 2), "bits": cfg.bits,
            **{k: round(v, 3) for k, v in timings.items()}}
