"""Asymmetric group quantization of tensors to int8 / int4 / int2, and its exact byte count.

Scheme (the one issue 30 measured kvpress with): the last dimension is cut into groups of ``group``
values (64 by default; a last dimension shorter than ``group`` is one group); each group stores one fp16
``scale`` and one fp16 ``zero`` and its values as unsigned ``bits``-bit codes,

    code = clamp(round((x - zero) / scale), 0, 2**bits - 1)        x_hat = code * scale + zero

with ``zero`` the group minimum rounded down to fp16 and ``scale`` = (max - zero) / (2**bits - 1)
rounded to the nearest fp16 (up when the top value would fall more than half a step outside the code
range), so ``|x - x_hat| <= scale / 2`` (up to float32 rounding of the arithmetic). Values already on
a grid quantize back to themselves, so a stored state re-saved or served from its codes is unchanged. Codes are packed ``8 // bits`` to a byte along the last dimension,
code ``i`` of a byte in bits ``[i*bits, (i+1)*bits)``. A last dimension that is not a multiple of the
group is padded (with the group's own last value) up to one, and the padding is counted in the bytes.

Bytes as stored (``quantized_nbytes``): codes ``rows * groups * group * bits / 8`` plus ``2 * 2`` bytes
(fp16 scale and zero) per group. For a ``[.., 64]`` row at int4 that is 32 + 4 = 36 bytes: 0.5625 bytes a
value, against 4 at fp32 and 2 at bf16. ``bits`` 16 and 32 mean plain fp16/bf16 and fp32 storage, so one
function counts every precision a system can be stored at.

Why hand-written (checked offline in a scratch folder against torch 2.13 CPU, wheels not installed):
torchao 0.18.0's compiled extensions do not load against torch 2.13 CPU and ``Int4WeightOnlyConfig``
raises "Requires mslk >= 1.0.0" (a CUDA kernel library); optimum-quanto 0.2.7 imports, but dequantizing
its packed int4 weight did not return within 120 s (it builds a C++ extension on first use), and it
quantizes ``nn.Linear`` weights along an axis rather than a KV cache; HQQ 0.2.8 is a source-only
distribution that pulls in accelerate and transformers and targets CUDA backends. None gives a plain
"tensor -> codes, scales, zeros" that another venv (kvpress's) can import by path. Group min/max
quantization is a dozen lines, so it is kept here, torch-only (no other nectar imports), and tested
against its error bound and byte count.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

QUANT_BITS = (2, 4, 8)
FLOAT_BITS = (16, 32)
DEFAULT_GROUP = 64
_META_BYTES = 2  # fp16 scale, fp16 zero: 2 bytes each
_FP16_TINY = 2.0**-24  # smallest positive fp16 (subnormal): a constant group still gets a valid scale


@dataclass(frozen=True)
class QuantizedTensor:
    """Packed codes [*lead, groups * group * bits / 8] uint8, scales/zeros [*lead, groups] fp16."""

    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    bits: int
    group: int
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        """Bytes the three stored tensors occupy (equals ``quantized_nbytes(shape, bits, group)``)."""
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales, self.zeros))


def _check(bits: int, group: int) -> None:
    if bits not in QUANT_BITS:
        raise ValueError(f"quantization bits={bits} is not supported: use one of {QUANT_BITS} (or 16/32 for float)")
    if group < 1 or (group * bits) % 8:
        raise ValueError(f"quantization group={group} at {bits} bits does not fill whole bytes: use a multiple of {8 // math.gcd(8, bits)}")


def effective_group(last_dim: int, bits: int, group: int = DEFAULT_GROUP) -> int:
    """Group actually used for a last dimension: ``group``, or the whole (byte-rounded) row if shorter."""
    _check(bits, group)
    if last_dim >= group:
        return group
    per_byte = 8 // bits
    return max(per_byte, -(-last_dim // per_byte) * per_byte)


def quantized_nbytes(shape: tuple[int, ...] | torch.Size, bits: int, group: int = DEFAULT_GROUP) -> int:
    """Exact stored bytes of a tensor of ``shape`` at ``bits`` (codes + fp16 scales + fp16 zeros).

    ``bits`` 16 or 32: plain float storage, ``numel * bits / 8`` (no scales)."""
    shape = tuple(int(s) for s in shape)
    numel = math.prod(shape)
    if bits in FLOAT_BITS:
        return numel * bits // 8
    if not shape or numel == 0:
        return 0 if numel == 0 else quantized_nbytes((1,), bits, group)
    g = effective_group(shape[-1], bits, group)
    rows, groups = numel // shape[-1], -(-shape[-1] // g)
    return rows * (groups * g * bits // 8 + 2 * _META_BYTES * groups)


def storage_bits(shape: tuple[int, ...] | torch.Size, bits: int, group: int = DEFAULT_GROUP) -> int:
    """``bits``, or 32 where quantizing would not save bytes (rows of one value: an fp16 scale and zero
    per value cost more than the float32 value itself)."""
    numel = math.prod(int(s) for s in shape)
    if bits in FLOAT_BITS or quantized_nbytes(shape, bits, group) < 4 * numel:
        return bits
    return 32


def _grouped(x: torch.Tensor, g: int) -> torch.Tensor:
    """[*lead, d] -> [*lead, groups, g], padding d with the row's last value (keeps each group's range)."""
    d = x.shape[-1]
    pad = -d % g
    if pad:
        x = torch.cat([x, x[..., -1:].expand(*x.shape[:-1], pad)], dim=-1)
    return x.reshape(*x.shape[:-1], -1, g)


def _fp16_down(v: torch.Tensor) -> torch.Tensor:
    """Largest fp16 <= v (v float32)."""
    h = v.to(torch.float16)
    return torch.where(h.float() > v, torch.nextafter(h, torch.full_like(h, -math.inf)), h)


def _fp16_up(v: torch.Tensor) -> torch.Tensor:
    """Smallest fp16 >= v (v float32)."""
    h = v.to(torch.float16)
    return torch.where(h.float() < v, torch.nextafter(h, torch.full_like(h, math.inf)), h)


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """[*lead, n] uint8 codes < 2**bits -> [*lead, n * bits / 8] uint8, code i of a byte at bits i*bits."""
    per = 8 // bits
    if per == 1:
        return codes
    c = codes.reshape(*codes.shape[:-1], -1, per).to(torch.int32)
    shifts = torch.arange(per, dtype=torch.int32, device=codes.device) * bits
    return (c << shifts).sum(dim=-1).to(torch.uint8)


def _unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of ``_pack``: [*lead, m] uint8 -> [*lead, m * 8 / bits] uint8 codes."""
    per = 8 // bits
    if per == 1:
        return packed
    # in uint8 throughout (no int32 copy): the decode step unpacks a quantized module's codes per layer
    shifts = torch.arange(per, dtype=torch.uint8, device=packed.device) * bits
    c = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return c.reshape(*packed.shape[:-1], -1)


def quantize(x: torch.Tensor, bits: int, group: int = DEFAULT_GROUP) -> QuantizedTensor:
    """Quantize ``x`` [*lead, d] (any float dtype) per group of ``group`` values along the last dim."""
    if x.dim() == 0:
        x = x.reshape(1)
    if not torch.isfinite(x).all():
        raise ValueError("cannot quantize a tensor with inf/nan values: clean the tensor first")
    g = effective_group(x.shape[-1], bits, group)
    xg = _grouped(x.detach().float(), g)  # [*lead, groups, g]
    qmax = (1 << bits) - 1
    zeros = _fp16_down(xg.amin(dim=-1))  # [*lead, groups]
    span = xg.amax(dim=-1) - zeros.float()
    scales = (span / qmax).clamp_min(_FP16_TINY).to(torch.float16)  # nearest: keeps on-grid values fixed
    short = span > (qmax + 0.5) * scales.float()  # top value would clamp by more than half a step
    scales = torch.where(short, _fp16_up(span / qmax), scales)
    codes = torch.round((xg - zeros.float().unsqueeze(-1)) / scales.float().unsqueeze(-1))
    codes = codes.clamp_(0, qmax).to(torch.uint8).reshape(*xg.shape[:-2], -1)  # [*lead, groups * g]
    return QuantizedTensor(_pack(codes, bits), scales, zeros, bits, group, tuple(x.shape))


def dequantize(q: QuantizedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Values of ``q`` as a ``dtype`` tensor of its original shape."""
    g = effective_group(q.shape[-1], q.bits, q.group)
    codes = _unpack(q.codes, q.bits).reshape(*q.scales.shape, g).float()  # [*lead, groups, g]
    x = codes * q.scales.float().unsqueeze(-1) + q.zeros.float().unsqueeze(-1)
    x = x.reshape(*x.shape[:-2], -1)[..., : q.shape[-1]]
    return x.reshape(q.shape).to(dtype)


def fake_quantize(x: torch.Tensor, bits: int, group: int = DEFAULT_GROUP) -> torch.Tensor:
    """Round trip ``x`` through ``bits`` storage, returned in ``x``'s dtype (and shape).

    ``bits`` 32 is the identity; 16 rounds through bf16 (the model KV dtype on GPU)."""
    if bits == 32:
        return x
    if bits == 16:
        return x.to(torch.bfloat16).to(x.dtype)
    return dequantize(quantize(x, bits, group), x.dtype)


def straight_through(x: torch.Tensor, bits: int, group: int = DEFAULT_GROUP) -> torch.Tensor:
    """``fake_quantize(x)`` in the forward, the identity's gradient in the backward (straight-through
    estimator): a loss sees the values as stored, the float ``x`` behind them takes the step.

    Non-finite entries (β = −inf of a masked slot; only at ``bits`` 16/32, where rounding keeps them)
    pass through unchanged and get no gradient."""
    if bits == 32:
        return x
    rounded = fake_quantize(x.detach(), bits, group)
    finite = torch.isfinite(x)
    return rounded + torch.where(finite, x - x.detach(), torch.zeros_like(x))
