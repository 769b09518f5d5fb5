"""Saving and loading modules: ``module.safetensors`` + ``module.json`` (a ModuleSpec).

The spec names the base model (id and weights hash) and the document (sha256, n) the module was
trained for; loading refuses a module made for another model or document, with a clear message.
"""
from __future__ import annotations

import json
from typing import Any

import fsspec
import torch
from safetensors.torch import load as st_load

from ..integrity import write_stable_safetensors
from ..schemas.artifacts import ModuleSpec
from ..storage import atomic_write
from ..tables import read_json_artifact, write_json_artifact
from .builder import ModulePlan, NectarModule, build_module

WEIGHTS = "module.safetensors"
SPEC = "module.json"


class ModuleMismatch(ValueError):
    """A saved module was trained for another base model or document."""


def make_spec(module: NectarModule, plan: ModulePlan, base_model: str, base_model_hash: str,
              doc_sha256: str, num_q_heads: int, normalization: dict[str, Any] | None = None) -> ModuleSpec:
    """Exact parameter and byte counts next to the KV-cache bytes the module replaces.

    Bytes use the module's storage dtype for both sides (float32 here): the saved tensors
    (parameters and normalisation buffers) against 2·n·d·L·Hkv cache entries.
    """
    elem = next(module.parameters()).element_size()
    module_bytes = module.nbytes()
    kv_entries = 2 * plan.n_context * plan.head_dim * plan.num_layers * plan.num_kv_heads
    return ModuleSpec(
        base_model=base_model, base_model_hash=base_model_hash, doc_sha256=doc_sha256,
        n_context=plan.n_context, num_layers=plan.num_layers, num_kv_heads=plan.num_kv_heads,
        num_q_heads=num_q_heads, head_dim=plan.head_dim, scaling=plan.scaling, arch=plan.arch,
        module_config=json.loads(json.dumps(plan.to_dict())), rho=plan.rho,  # lists, as JSON reads back
        per_layer_params=[plan.head_params(i) for i in range(plan.num_layers)],
        n_params=module.n_params(), module_bytes=module_bytes, kv_cache_bytes=kv_entries * elem,
        normalization=normalization or {},
    )


def save_module(module: NectarModule, spec: ModuleSpec, dir_url: str) -> list[str]:
    """Write weights then spec (each atomically); returns the file names written."""
    tensors = module.state_dict()
    meta = {"base_model_hash": spec.base_model_hash, "doc_sha256": spec.doc_sha256, "arch": spec.arch}
    # same module, same bytes (the one safetensors writer, shared with the document KV)
    atomic_write(f"{dir_url.rstrip('/')}/{WEIGHTS}", lambda f: write_stable_safetensors(f, tensors, meta))
    write_json_artifact(f"{dir_url.rstrip('/')}/{SPEC}", spec)
    return [WEIGHTS, SPEC]


def read_spec(dir_url: str) -> ModuleSpec:
    return read_json_artifact(f"{dir_url.rstrip('/')}/{SPEC}", ModuleSpec)


def check_spec(spec: ModuleSpec, where: str, base_model_hash: str | None = None,
               doc_sha256: str | None = None, head_dim: int | None = None,
               num_kv_heads: int | None = None, num_layers: int | None = None) -> None:
    if base_model_hash is not None and spec.base_model_hash != base_model_hash:
        raise ModuleMismatch(
            f"{where}: module was trained for base model {spec.base_model!r} (weights hash "
            f"{spec.base_model_hash}), but the loaded model's weights hash is {base_model_hash}")
    if doc_sha256 is not None and spec.doc_sha256 != doc_sha256:
        raise ModuleMismatch(f"{where}: module was trained for document sha256 {spec.doc_sha256[:12]}…, "
                             f"not {doc_sha256[:12]}…")
    for name, want in (("head_dim", head_dim), ("num_kv_heads", num_kv_heads), ("num_layers", num_layers)):
        if want is not None and getattr(spec, name) != want:
            raise ModuleMismatch(f"{where}: module has {name}={getattr(spec, name)}, the model has {want}")


def load_module(dir_url: str, base=None, expect_doc_sha: str | None = None,
                device: str | torch.device = "cpu") -> tuple[NectarModule, ModuleSpec]:
    """Load a module, checking it matches ``base`` (a BaseLM) and the expected document."""
    spec = read_spec(dir_url)
    if base is not None:
        check_spec(spec, dir_url, base.weights_hash, expect_doc_sha, base.head_dim,
                   base.num_kv_heads, base.num_layers)
    else:
        check_spec(spec, dir_url, doc_sha256=expect_doc_sha)
    plan = ModulePlan.from_dict(spec.module_config)
    module = build_module(plan)
    fs, path = fsspec.core.url_to_fs(f"{dir_url.rstrip('/')}/{WEIGHTS}")
    with fs.open(path, "rb") as f:
        tensors = st_load(f.read())
    missing = set(module.state_dict()) ^ set(tensors)
    if missing:
        raise ModuleMismatch(f"{dir_url}/{WEIGHTS}: tensors don't match the spec's architecture "
                             f"(differing names: {sorted(missing)[:5]})")
    module.load_state_dict(tensors)
    return module.to(device).eval(), spec
