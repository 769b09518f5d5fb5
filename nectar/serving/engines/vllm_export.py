"""Export a run's document state for vLLM (``nectar serve --engine vllm``): the trained module as it is —
β and ragged per-head budgets, served by the NECTAR attention backend (``nectar.vllm.backend``) — or, named
(``--state attention_matching_kv@int4``), the β-free refit at the run's budget ρ (closed form, seconds)
for a vLLM without the plugin. The file is written beside the run's stages in ``<run>/vllm/``
(``state.v2.safetensors`` + ``state.json`` with its sha256) and reused while its digest, base model,
document and source still match.

It opens a run directory (``nectar.orchestration.context``), so it sits with the vLLM engine here, in
the orchestration layer, not in ``nectar.vllm`` (core: no run directories); the file format, the
re-rotated keys and the checks it uses are ``nectar.vllm.format`` and ``nectar.vllm.state``.
"""
from __future__ import annotations

import dataclasses
import json
import os

import fsspec
import torch

from ...states import fit_method
from ...integrity import hash_file
from ...modules.builder import plan_from_config
from ...modules.io import load_module
from ...orchestration.context import load_base, load_run_doc_kv, open_run
from ...vllm.format import STATE_FILE
from ...vllm.state import KV_BASELINE, ExportedState, NotPlainKV, plain_kv_pairs, reusable_state, state_triples, write_state


def refit_system(bits: int) -> str:
    """The default refit at the run's storage bits, named as ``nectar compare`` names that system
    (``attention_matching_kv`` is float32 there; ``attention_matching_kv@int4`` as many pairs as int4 buys)."""
    return KV_BASELINE if bits >= 32 else f"{KV_BASELINE}@int{bits}"


def system_bits(system: str) -> tuple[str, int]:
    """``name[@intN]`` → (baseline name, storage bits): ``nectar compare``'s convention (no suffix: float32)."""
    name, _, suffix = system.partition("@int")
    if suffix and not suffix.isdigit():
        raise NotPlainKV(f"--state {system!r}: the precision suffix is @int8 or @int4 (as in `nectar compare`)")
    return name, int(suffix) if suffix else 32


def export_run_state(run_dir: str, source: str | None = None, log=print) -> ExportedState:
    """Export (or reuse, when its digest and metadata still match) the run's state for vLLM.

    ``source`` None or "trained": the trained module as it is (β, ragged budgets: the NECTAR attention
    backend serves it); ``attention_matching_kv[@intN]``: the β-free refit, plain KV, for a vLLM without
    the plugin. A trained module that is not a quadrature (an MLP) falls back to the refit when no
    source was asked for."""
    ctx = open_run(run_dir)
    base = load_base(ctx.config)
    out_dir = os.path.abspath(os.path.join(ctx.run.root, "vllm"))
    path, record = os.path.join(out_dir, STATE_FILE), os.path.join(out_dir, "state.json")
    trained = ctx.run.exists("train", "module.json")
    default_refit = refit_system(ctx.config.train.module.bits)
    wanted = source or ("trained" if trained else default_refit)
    reused = reusable_state(path, record, base.weights_hash, ctx.info.sha256, source)  # None: any verified one
    if source is None and reused is not None and system_bits(reused.source)[0] == KV_BASELINE \
            and (trained or reused.source != default_refit):
        reused = None  # a refit exported before the trained module was served as it is, or at other bits: again
    if reused is not None:
        return dataclasses.replace(reused, doc_id=ctx.info.doc_id)
    doc_kv = load_run_doc_kv(ctx)
    keys = values = betas = None
    if wanted == "trained":
        if not trained:
            raise NotPlainKV(f"{run_dir}: no trained module (train has not run); `nectar run` it first, or serve "
                             f"the refit with --state {default_refit}")
        module, _ = load_module(ctx.run.url("train"), base, ctx.info.sha256, device=torch.device("cpu"))
        try:
            keys, values, betas = state_triples(module)
        except NotPlainKV as exc:
            if source == "trained":
                raise
            wanted = default_refit
            log(f"{run_dir}: the trained module has no keys to serve ({exc}); serving its β-free refit {wanted!r} at "
                f"the same budget instead (its quality: `nectar compare {run_dir} --systems none,full,{wanted}`)")
    if keys is None:
        plan = plan_from_config(ctx.config.train.module, num_layers=base.num_layers, num_kv_heads=base.num_kv_heads,
                                head_dim=base.head_dim, n_context=doc_kv.n, scaling=base.scaling)
        name, bits = system_bits(wanted)
        fitted = fit_method(name, doc_kv, ctx.stage_run("targets").url("targets"), plan, seed=ctx.config.train.seed,
                            bits=bits)
        keys, values = plain_kv_pairs(fitted.module)
    os.makedirs(out_dir, exist_ok=True)
    write_state(path, keys, values, base, doc_kv.n, ctx.info.sha256, wanted, betas)
    digest, size = hash_file(fsspec.filesystem("file"), path)
    with open(record, "w") as f:
        json.dump({"file": STATE_FILE, "sha256": digest, "bytes": size, "source": wanted}, f, indent=1)
    return ExportedState(os.path.abspath(path), digest, keys[0].shape[1], doc_kv.n, wanted, ctx.info.doc_id,
                         base.name, base.weights_hash, betas is not None)
