"""A module's parameters as stored: float32, or integer codes with per-group fp16 scales and zeros.

A module built with ``bits`` < 32 (``train.module.bits``) keeps float parameters for fitting and
training; ``quantize_module_`` rounds them onto the quantization grid (the values it will be served
with), ``stored_tensors`` gives the tensors written to disk — ``<name>.codes`` (uint8, packed),
``<name>.scales`` and ``<name>.zeros`` (fp16) for each parameter, normalisation buffers as they are —
and ``load_stored_tensors`` reverses it. ``stored_nbytes`` is the module's size as stored: the bytes
the comparison reports and the budget is set by, equal to the sum of ``stored_tensors``' bytes.

A closed-form (quadrature) module never reads the normalisation buffers, so they are not stored for it
(at 1 % of a SmolLM2 document's KV they would be 7 % of the bytes); files that hold them still load.
"""
from __future__ import annotations

import torch

from ..quantization import QuantizedTensor, dequantize, fake_quantize, quantize, quantized_nbytes, storage_bits
from .builder import ModulePlan, NectarModule

SUFFIXES = (".codes", ".scales", ".zeros")


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
    """Round every parameter onto its ``bits`` grid in place (no-op at 32 bits); returns ``module``."""
    for name, p in module.named_parameters():
        if name in _param_names(module):
            p.copy_(fake_quantize(p.detach().float(), module.bits, module.quant_group))
    return module


def quantized_parameters(module: NectarModule) -> dict[str, QuantizedTensor]:
    """Each parameter's packed form (the module must be quantized: ``module.bits`` < 32)."""
    names = _param_names(module)
    return {name: quantize(p.detach().float().cpu(), module.bits, module.quant_group)
            for name, p in module.named_parameters() if name in names}


def stored_tensors(module: NectarModule) -> dict[str, torch.Tensor]:
    """The tensors a module is saved as (its state dict at 32 bits)."""
    state = _state(module)
    if not is_quantized(module):
        return state
    out = {k: v for k, v in state.items() if k not in _param_names(module)}  # float32: buffers, short rows
    for name, q in quantized_parameters(module).items():
        out.update({name + ".codes": q.codes, name + ".scales": q.scales, name + ".zeros": q.zeros})
    return out


def stored_nbytes(module: NectarModule, plan: ModulePlan | None = None) -> int:
    """Bytes of ``stored_tensors(module)``, counted from shapes (no quantization pass). With heads of
    different widths (``plan.quad_head_pairs``, KVzip-style selection) only each head's real pairs
    count, not the masked slots that pad a layer to its widest head."""
    if plan is not None and plan.quad_head_pairs:
        if is_quantized(module):
            raise ValueError("heads of different widths (kvzip selection) are stored in float32 only; "
                             "set train.module.bits=32 with init kvzip")
        buffers = 0 if module.closed_form else sum(b.numel() * b.element_size() for b in module.buffers())
        return buffers + plan.stored_params() * module.layers[0].W.element_size()
    names = _param_names(module)
    total = 0
    for name, t in _state(module).items():
        bits = module.bits if name in names else 32
        total += quantized_nbytes(t.shape, bits, module.quant_group) if bits < 32 else t.numel() * t.element_size()
    return total


@torch.no_grad()
def load_stored_tensors(module: NectarModule, tensors: dict[str, torch.Tensor]) -> None:
    """Load what ``stored_tensors`` wrote into ``module`` (built from the same plan)."""
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
