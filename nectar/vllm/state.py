"""A run's document state for vLLM: which state, re-rotated keys, β, the versioned file.

A quadrature state with no log-mass bias (β = 0) and the same number m of (key, value) pairs in every
(layer, KV head) is exactly attention over m cached tokens. Its keys were captured rotated at their
document positions j < n and are queried from positions n + t; in vLLM the query sits at m + t, so
every key is rotated by −(n − m): RoPE scores depend only on the offset, (n + t) − j = (m + t) −
(j − (n − m)). The rotation is the pure one (cos/sin of the offset times the inverse frequencies):
under YaRN or llama3 scaling the frequencies are already the scaled ones, and the attention factor
that scales cos/sin at capture is already inside the captured keys (a rotation keeps it).

Which state (``nectar.serving.engines.vllm_export``): the run's trained module as it is — β and ragged
per-head budgets included (``state_triples``), served by the NECTAR attention backend — or, as the
named fallback for engines without that backend, the β-free refit ``attention_matching_kv``
(``nectar.states``) at the run's budget ρ, which is plain KV (``plain_kv_pairs``). The file (``nectar.vllm.format``) sits in ``<run>/vllm/`` with ``state.json`` naming its sha256.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

import fsspec
import torch

from ..base_model import BaseLM
from ..integrity import hash_file, write_stable_safetensors
from ..storage import atomic_write
from .format import STATE_FORMAT, STATE_VERSION, has_bias, read_state_meta

KV_BASELINE = "attention_matching_kv"


class NotPlainKV(ValueError):
    """A state that attention over cached tokens cannot reproduce (bias, or per-layer counts)."""


@dataclass(frozen=True)
class ExportedState:
    path: str
    sha256: str
    m: int
    n: int
    source: str
    doc_id: str = ""
    base_model: str = ""
    base_model_hash: str = ""
    bias: bool = False  # carries β: served by the NECTAR attention backend only


def state_triples(module) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """(keys, values [hkv, m, d], β [hkv, m]) per layer of a quadrature module, as the NECTAR attention backend
    serves it: every layer padded to the widest layer's m with zero keys/values and β = −inf (a slot no query
    attends to), so ragged per-head and per-layer budgets keep their exact attention. β = 0 where the module has
    none. Int4 modules are read as their decoded (dequantized) floats."""
    layers = list(module.layers)
    if not all(hasattr(net, "W") and hasattr(net, "Z") for net in layers):
        raise NotPlainKV("the module is not a quadrature module (an MLP predicts its state: no keys to cache)")
    m = max(net.W.shape[1] for net in layers)
    keys, values, betas = [], [], []
    for net in layers:
        W, Z = net.W.detach().float().cpu(), net.Z.detach().float().cpu()  # [hkv, p, d]
        hkv, p, d = W.shape
        beta = net.beta.detach().float().cpu() if getattr(net, "beta", None) is not None else torch.zeros(hkv, p)
        pad = m - p
        keys.append(torch.cat([W, W.new_zeros(hkv, pad, d)], 1))
        values.append(torch.cat([Z, Z.new_zeros(hkv, pad, d)], 1))
        betas.append(torch.cat([beta, beta.new_full((hkv, pad), float("-inf"))], 1))
    return keys, values, betas


def plain_kv_pairs(module) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(keys, values) per layer [hkv, m, d] of a bias-free quadrature module with one m in every layer."""
    layers = list(module.layers)
    if not all(hasattr(net, "W") and hasattr(net, "Z") for net in layers):
        raise NotPlainKV("the module is not a quadrature module (an MLP predicts its state: no keys to cache)")
    if any(getattr(net, "beta", None) is not None and bool(net.beta.detach().abs().max() > 0) for net in layers):
        raise NotPlainKV(f"the module has a log-mass bias β ≠ 0; serve its β-free refit {KV_BASELINE!r}")
    counts = {net.W.shape[1] for net in layers}
    if len(counts) != 1:
        raise NotPlainKV(f"the module keeps {sorted(counts)} pairs in different layers; vLLM caches one "
                         f"number of tokens per layer: serve {KV_BASELINE!r}")
    return [net.W.detach().float().cpu() for net in layers], [net.Z.detach().float().cpu() for net in layers]


def rope_inv_freq(base: BaseLM) -> torch.Tensor:
    """The model's RoPE inverse frequencies [d/2] (scaled ones under YaRN/llama3)."""
    for mod in base.model.modules():
        inv = getattr(mod, "inv_freq", None)
        if isinstance(inv, torch.Tensor):
            return inv.detach().float().cpu()
    raise NotPlainKV(f"{base.name}: no rotary embedding found; only RoPE models can move keys")


def shift_keys(keys: torch.Tensor, inv_freq: torch.Tensor, delta: int) -> torch.Tensor:
    """Rotate RoPE'd keys [..., d] by ``delta`` positions (the rotate-half convention)."""
    angles = float(delta) * inv_freq.double()  # [d/2]
    cos = torch.cat([angles.cos(), angles.cos()])  # [d]
    sin = torch.cat([angles.sin(), angles.sin()])
    k = keys.double()
    half = k.shape[-1] // 2
    rotated_half = torch.cat([-k[..., half:], k[..., :half]], dim=-1)
    return (k * cos + rotated_half * sin).to(keys.dtype)


def write_state(path: str, keys: list[torch.Tensor], values: list[torch.Tensor], base: BaseLM, n: int,
                doc_sha256: str, source: str, betas: list[torch.Tensor] | None = None) -> None:
    """Write the vLLM state file: keys re-rotated for queries at m + t (float32; vLLM casts), β when given."""
    m = keys[0].shape[1]
    inv = rope_inv_freq(base)
    tensors = {}
    for i, (k, v) in enumerate(zip(keys, values)):
        tensors[f"k.{i}"] = shift_keys(k, inv, -(n - m)).contiguous()  # [hkv, m, d]
        tensors[f"v.{i}"] = v.contiguous()
        if betas is not None:
            tensors[f"b.{i}"] = betas[i].float().contiguous()  # [hkv, m]
    meta = {"format": STATE_FORMAT, "version": STATE_VERSION, "base_model": base.name,
            "base_model_hash": base.weights_hash, "doc_sha256": doc_sha256, "n": str(n), "m": str(m),
            "num_layers": str(len(keys)), "num_kv_heads": str(keys[0].shape[0]), "head_dim": str(keys[0].shape[2]),
            "source": source, "dtype": "float32", "bias": "1" if betas is not None else "0"}
    atomic_write(path, lambda f: write_stable_safetensors(f, tensors, meta))


def check_state(path: str, base_model_hash: str, doc_sha256: str | None = None) -> dict[str, str]:
    """The state file's metadata; refuses a state made for another base model (or document)."""
    meta = read_state_meta(path)
    if meta.get("base_model_hash") != base_model_hash:
        raise NotPlainKV(f"{path}: the state was made for base model {meta.get('base_model')!r} (weights "
                         f"{meta.get('base_model_hash', '?')[:12]}), the server runs weights {base_model_hash[:12]}; "
                         "serve it with the model it was made for")
    if doc_sha256 is not None and meta.get("doc_sha256") != doc_sha256:
        raise NotPlainKV(f"{path}: the state is of another document (sha256 {meta.get('doc_sha256', '?')[:12]})")
    return meta


def reusable_state(path: str, record: str, model_hash: str, doc_sha: str, source: str | None) -> ExportedState | None:
    if not (os.path.exists(path) and os.path.exists(record)):
        return None
    with open(record) as f:
        rec = json.load(f)
    digest, _ = hash_file(fsspec.filesystem("file"), path)
    if digest != rec.get("sha256"):
        return None  # changed on disk: export again
    try:
        meta = check_state(path, model_hash, doc_sha)
    except ValueError:
        return None
    if source is not None and meta["source"] != source:
        return None
    return ExportedState(os.path.abspath(path), digest, int(meta["m"]), int(meta["n"]), meta["source"], "", meta["base_model"],
                         meta["base_model_hash"], has_bias(meta))


def verify_state(path: str) -> str:
    """The file's sha256 checked against the ``state.json`` beside it (the server loads only that)."""
    record = os.path.join(os.path.dirname(path), "state.json")
    digest, _ = hash_file(fsspec.filesystem("file"), path)
    if os.path.exists(record):
        with open(record) as f:
            want = json.load(f).get("sha256")
        if want != digest:
            raise NotPlainKV(f"{path}: sha256 {digest[:12]} differs from {want[:12]} in {record}: the file changed "
                             "after export; export it again")
    return digest
