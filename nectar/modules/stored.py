"""A module's parameters as stored: float32, or integer codes with per-group fp16 scales and zeros.

A module built with ``bits`` < 32 (``train.module.bits``) keeps float parameters for fitting and
training; ``quantize_module_`` rounds them onto the quantization grid (the values it will be served
with), ``stored_tensors`` gives the tensors written to disk — ``<name>.codes`` (uint8, packed),
``<name>.scales`` and ``<name>.zeros`` (fp16) for each parameter, normalisation buffers as they are —
and ``load_stored_tensors`` reverses it. ``stored_nbytes`` is the module's size as stored: the bytes
the comparison reports and the budget is set by, equal to the sum of ``stored_tensors``' bytes.

A closed-form (quadrature) module never reads the normalisation buffers, so they are not stored for it
(at 1 % of a SmolLM2 document's KV they would be 7 % of the bytes); files that hold them still load.

A quadrature module whose heads differ in width (``module.head_pairs``, recon_fit's selection) stores
each layer's REAL pairs back to back — ``layers.ℓ.W`` / ``.Z`` as [Σ_h c_h, d] rows (codes at ``bits``
< 32, each row quantized along d on its own), ``layers.ℓ.beta`` as [Σ_h c_h] (float32, or bf16 below 32
bits: ``budget.ragged_beta_bits``; left out when β only masks, ``bias_stored`` False) — so the masked
slots that pad a layer to its widest head cost nothing, and loading puts them back (W = Z = 0,
β = −inf). Its bytes are pairs × ``budget.ragged_pair_bytes``.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn
from torch.nn.utils import parametrize

from ..quantization import (QuantizedTensor, dequantize, fake_quantize, quantize, quantized_nbytes, storage_bits,
                            straight_through)
from .budget import ragged_beta_bits
from .builder import ModulePlan, NectarModule

SUFFIXES = (".codes", ".scales", ".zeros")


# ----- heads of different widths: the real pairs of each layer, back to back -----

def is_ragged(module: NectarModule) -> bool:
    return bool(module.head_pairs)


def ragged(x: torch.Tensor, counts: tuple[int, ...]) -> torch.Tensor:
    """[H, p, ...] → [Σ_h c_h, ...]: each head's first c_h slots (its real pairs), head after head."""
    return torch.cat([x[h, :c] for h, c in enumerate(counts)])


def padded(rows: torch.Tensor, counts: tuple[int, ...], width: int, fill: float) -> torch.Tensor:
    """Inverse of ``ragged``: [Σ c_h, ...] → [H, width, ...], the slots past c_h set to ``fill``."""
    out = rows.new_full((len(counts), width, *rows.shape[1:]), fill)
    start = 0
    for h, c in enumerate(counts):
        out[h, :c] = rows[start:start + c]
        start += c
    return out


def _ragged_float(module: NectarModule) -> dict[str, torch.Tensor]:
    """The real pairs of every layer as float32 tensors, named as the module's parameters."""
    out = {}
    for i, (layer, counts) in enumerate(zip(module.layers, module.head_pairs)):
        out[f"layers.{i}.W"] = ragged(layer.W.detach().float().cpu(), counts)  # [Σc, d]
        out[f"layers.{i}.Z"] = ragged(layer.Z.detach().float().cpu(), counts)  # [Σc, d]
        if layer.beta is not None and module.bias_stored:
            out[f"layers.{i}.beta"] = ragged(layer.beta.detach().float().cpu(), counts)  # [Σc]
    return out


def _ragged_bits(module: NectarModule, name: str, shape) -> int:
    if name.endswith(".beta"):
        return ragged_beta_bits(module.bits)
    return storage_bits(shape, module.bits, module.quant_group) if is_quantized(module) else 32


def _round_ragged(x: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    return x.to(torch.bfloat16).float() if bits == 16 else fake_quantize(x, bits, group)


def _ragged_stored(module: NectarModule) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in _ragged_float(module).items():
        bits = _ragged_bits(module, name, t.shape)
        if bits == 16:
            out[name] = t.to(torch.bfloat16)
        elif bits < 32:
            q = quantize(t, bits, module.quant_group)
            out.update({name + ".codes": q.codes, name + ".scales": q.scales, name + ".zeros": q.zeros})
        else:
            out[name] = t
    return out


def _ragged_nbytes(module: NectarModule) -> int:
    total = 0
    d = module.head_dim
    for i, (layer, counts) in enumerate(zip(module.layers, module.head_pairs)):
        rows = sum(counts)
        for name in ("W", "Z"):
            total += quantized_nbytes((rows, d), _ragged_bits(module, f"layers.{i}.{name}", (rows, d)),
                                      module.quant_group)
        if layer.beta is not None and module.bias_stored:
            total += rows * ragged_beta_bits(module.bits) // 8
    return total


@torch.no_grad()
def _load_ragged(module: NectarModule, tensors: dict[str, torch.Tensor]) -> None:
    for i, (layer, counts) in enumerate(zip(module.layers, module.head_pairs)):
        p, d = layer.W.shape[1:]
        parts = {}
        for name, shape in (("W", (sum(counts), d)), ("Z", (sum(counts), d)), ("beta", (sum(counts),))):
            key = f"layers.{i}.{name}"
            if key + ".codes" in tensors:
                parts[name] = dequantize(QuantizedTensor(tensors[key + ".codes"], tensors[key + ".scales"],
                                                         tensors[key + ".zeros"], module.bits, module.quant_group,
                                                         shape))
            elif key in tensors:
                parts[name] = tensors[key].float()
            elif name != "beta" or (layer.beta is not None and module.bias_stored):
                raise ValueError(f"stored tensors lack {key} (a {module.bits}-bit state of heads {counts})")
        layer.W.copy_(padded(parts["W"], counts, p, 0.0))
        layer.Z.copy_(padded(parts["Z"], counts, p, 0.0))
        if layer.beta is not None:
            real = parts.get("beta", torch.zeros(sum(counts)))
            layer.beta.copy_(padded(real, counts, p, float("-inf")))


def is_quantized(module: NectarModule) -> bool:
    return module.bits < 32


def _param_names(module: NectarModule) -> set[str]:
    """Parameters stored as codes: all at ``bits`` < 32 but rows too short to gain (``storage_bits``)."""
    if not is_quantized(module):
        return set()
    return {name for name, p in module.named_parameters()
            if storage_bits(p.shape, module.bits, module.quant_group) < 32}


def _state(module: NectarModule) -> dict[str, torch.Tensor]:
    """The state that is stored: parameters, and the normalisation buffers unless closed-form."""
    params = {name for name, _ in module.named_parameters()}
    return {k: v for k, v in module.state_dict().items() if k in params or not module.closed_form}


@torch.no_grad()
def quantize_module_(module: NectarModule) -> NectarModule:
    """Round every parameter onto its ``bits`` grid in place (no-op at 32 bits); returns ``module``.
    Heads of different widths: only the real pairs, as they are stored (β at bf16)."""
    if is_ragged(module):
        if is_quantized(module):
            for i, (layer, counts) in enumerate(zip(module.layers, module.head_pairs)):
                p = layer.W.shape[1]
                for name, fill in (("W", 0.0), ("Z", 0.0), ("beta", float("-inf"))):
                    param = getattr(layer, name)
                    if param is None or (name == "beta" and not module.bias_stored):
                        continue
                    rows = ragged(param.detach().float().cpu(), counts)
                    rows = _round_ragged(rows, _ragged_bits(module, f"layers.{i}.{name}", rows.shape), module.quant_group)
                    param.copy_(padded(rows, counts, p, fill).to(param.device, param.dtype))
        return module
    for name, p in module.named_parameters():
        if name in _param_names(module):
            p.copy_(fake_quantize(p.detach().float(), module.bits, module.quant_group))
    return module


def parameter_bits(module: NectarModule) -> dict[str, int]:
    """The precision ``quantize_module_`` rounds each parameter to (32: kept float32, 16: bf16, else
    codes); a padded ragged layer's rows round as its stored real rows do (each row along d on its own)."""
    if not is_ragged(module):
        names = _param_names(module)
        return {name: module.bits if name in names else 32 for name, _ in module.named_parameters()}
    out = {}
    for i, layer in enumerate(module.layers):
        for name in ("W", "Z"):
            out[f"layers.{i}.{name}"] = _ragged_bits(module, f"layers.{i}.{name}", (1, module.head_dim))
        if layer.beta is not None:
            stored = is_quantized(module) and module.bias_stored
            out[f"layers.{i}.beta"] = _ragged_bits(module, f"layers.{i}.beta", (1,)) if stored else 32
    return out


class _AsStored(nn.Module):
    """Parametrization: the parameter on its storage grid, straight-through to the float behind it."""

    def __init__(self, bits: int, group: int):
        super().__init__()
        self.bits, self.group = bits, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return straight_through(x, self.bits, self.group)


@contextlib.contextmanager
def trained_as_stored(module: NectarModule) -> Iterator[NectarModule]:
    """Quantization-aware training: inside, every read of a parameter stored below 32 bits gives its
    rounded value (what ``quantize_module_`` will store), with a straight-through gradient to the float
    parameter, which the optimizer keeps updating (sub-step moves accumulate until a code flips; a
    state re-rounded after each step would lose them). On exit the float parameters are back in place
    (``state_dict`` names unchanged); ``quantize_module_`` then stores exactly what the last forward
    used. A no-op at 32 bits. Build the optimizer inside (it holds the same Parameter objects)."""
    rounded = [(name, bits) for name, bits in parameter_bits(module).items() if bits < 32]
    for name, bits in rounded:
        owner, attr = _owner(module, name)
        parametrize.register_parametrization(owner, attr, _AsStored(bits, module.quant_group), unsafe=True)
    try:
        yield module
    finally:
        for name, _ in rounded:
            owner, attr = _owner(module, name)
            parametrize.remove_parametrizations(owner, attr, leave_parametrized=False)


def _owner(module: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, attr = name.rpartition(".")
    return (module.get_submodule(path) if path else module), attr


def quantized_parameters(module: NectarModule) -> dict[str, QuantizedTensor]:
    """Each parameter's packed form (the module must be quantized: ``module.bits`` < 32)."""
    names = _param_names(module)
    return {name: quantize(p.detach().float().cpu(), module.bits, module.quant_group)
            for name, p in module.named_parameters() if name in names}


def stored_tensors(module: NectarModule) -> dict[str, torch.Tensor]:
    """The tensors a module is saved as (its state dict at 32 bits)."""
    if is_ragged(module):
        return _ragged_stored(module)
    state = _state(module)
    if not is_quantized(module):
        return state
    out = {k: v for k, v in state.items() if k not in _param_names(module)}  # float32: buffers, short rows
    for name, q in quantized_parameters(module).items():
        out.update({name + ".codes": q.codes, name + ".scales": q.scales, name + ".zeros": q.zeros})
    return out


def stored_nbytes(module: NectarModule, plan: ModulePlan | None = None) -> int:
    """Bytes of ``stored_tensors(module)``, counted from shapes (no quantization pass). With heads of
    different widths (``module.head_pairs``, recon_fit's selection) only each head's real pairs
    count, not the masked slots that pad a layer to its widest head. (``plan``: unused, kept for
    callers that pass it; the module carries its widths.)"""
    if is_ragged(module):
        return _ragged_nbytes(module)
    names = _param_names(module)
    total = 0
    for name, t in _state(module).items():
        bits = module.bits if name in names else 32
        total += quantized_nbytes(t.shape, bits, module.quant_group) if bits < 32 else t.numel() * t.element_size()
    return total


@torch.no_grad()
def load_stored_tensors(module: NectarModule, tensors: dict[str, torch.Tensor]) -> None:
    """Load what ``stored_tensors`` wrote into ``module`` (built from the same plan)."""
    first = tensors.get("layers.0.W")
    if is_ragged(module) and not (first is not None and first.shape == module.layers[0].W.shape):
        _load_ragged(module, tensors)  # (a float32 file saved padded, before real pairs were stored alone,
        return                         # loads as any state dict below)
    state = dict(module.state_dict())
    if module.closed_form:  # buffers it never reads: stored by older versions, or not at all
        params = {name for name, _ in module.named_parameters()}
        tensors = {**{k: v for k, v in state.items() if k not in params}, **tensors}
    if not is_quantized(module):
        module.load_state_dict(tensors)
        return
    expect = {k for k in state if k not in _param_names(module)}
    expect |= {n + s for n in _param_names(module) for s in SUFFIXES}
    if set(tensors) != expect:
        diff = sorted(set(tensors) ^ expect)[:5]
        raise ValueError(f"stored tensors don't match a {module.bits}-bit module of this plan (differing: {diff})")
    for name in _param_names(module):
        q = QuantizedTensor(tensors[name + ".codes"], tensors[name + ".scales"], tensors[name + ".zeros"],
                            module.bits, module.quant_group, tuple(state[name].shape))
        state[name] = dequantize(q)
    module.load_state_dict({k: state[k] if k in _param_names(module) else tensors[k] for k in state})
