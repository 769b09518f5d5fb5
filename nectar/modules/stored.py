"""A module's parameters as stored: float32, or integer codes with per-group fp16 scales and zeros.

A module built with ``bits`` < 32 (``train.module.bits``) keeps float parameters for fitting and
training; ``quantize_module_`` rounds them onto the quantization grid (the values it will be served
with), ``stored_tensors`` gives the tensors written to disk — ``<name>.codes`` (uint8, packed),
``<name>.scales`` and ``<name>.zeros`` (fp16) for each parameter, normalisation buffers as they are —
and ``load_stored_tensors`` reverses it. ``stored_nbytes`` is the module's size as stored: the bytes
the comparison reports and the budget is set by, equal to the sum of ``stored_tensors``' bytes.
"""
from __future__ import annotations

import torch

from ..quantization import QuantizedTensor, dequantize, fake_quantize, quantize, quantized_nbytes
from .builder import NectarModule

SUFFIXES = (".codes", ".scales", ".zeros")


def is_quantized(module: NectarModule) -> bool:
    return module.bits < 32


def _param_names(module: NectarModule) -> set[str]:
    return {name for name, _ in module.named_parameters()}


@torch.no_grad()
def quantize_module_(module: NectarModule) -> NectarModule:
    """Round every parameter onto its ``bits`` grid in place (no-op at 32 bits); returns ``module``."""
    if is_quantized(module):
        for p in module.parameters():
            p.copy_(fake_quantize(p.detach().float(), module.bits, module.quant_group))
    return module


def quantized_parameters(module: NectarModule) -> dict[str, QuantizedTensor]:
    """Each parameter's packed form (the module must be quantized: ``module.bits`` < 32)."""
    return {name: quantize(p.detach().float().cpu(), module.bits, module.quant_group)
            for name, p in module.named_parameters()}


def stored_tensors(module: NectarModule) -> dict[str, torch.Tensor]:
    """The tensors a module is saved as (its state dict at 32 bits)."""
    state = module.state_dict()
    if not is_quantized(module):
        return state
    out = {k: v for k, v in state.items() if k not in _param_names(module)}  # normalisation buffers
    for name, q in quantized_parameters(module).items():
        out.update({name + ".codes": q.codes, name + ".scales": q.scales, name + ".zeros": q.zeros})
    return out


def stored_nbytes(module: NectarModule) -> int:
    """Bytes of ``stored_tensors(module)``, counted from shapes (no quantization pass)."""
    names = _param_names(module)
    total = 0
    for name, t in module.state_dict().items():
        bits = module.bits if name in names else 32
        total += quantized_nbytes(t.shape, bits, module.quant_group) if bits < 32 else t.numel() * t.element_size()
    return total


@torch.no_grad()
def load_stored_tensors(module: NectarModule, tensors: dict[str, torch.Tensor]) -> None:
    """Load what ``stored_tensors`` wrote into ``module`` (built from the same plan)."""
    if not is_quantized(module):
        module.load_state_dict(tensors)
        return
    state = dict(module.state_dict())
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
