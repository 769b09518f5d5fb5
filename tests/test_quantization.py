import pytest
import torch

from nectar.quantization import (
    QuantizedTensor,
    _unpack,
    dequantize,
    effective_group,
    fake_quantize,
    quantize,
    quantized_nbytes,
)


def _bound(q: QuantizedTensor, x: torch.Tensor) -> torch.Tensor:
    """Per-value bound scale/2 (+ float32 arithmetic slack scaled to magnitude), shaped like x."""
    g = effective_group(x.shape[-1], q.bits, q.group)
    half = (q.scales.float() / 2).repeat_interleave(g, dim=-1)[..., : x.shape[-1]]
    return half * (1 + 1e-4) + 1e-6 * x.abs().amax()


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("shape", [(3, 5, 128), (7, 64), (4, 100), (2, 3, 16)])
def test_round_trip_within_half_scale(bits, shape):
    gen = torch.Generator().manual_seed(bits * 100 + len(shape))
    x = torch.randn(shape, generator=gen) * 3 + torch.rand(shape[-1], generator=gen)
    q = quantize(x, bits, 64)
    err = (dequantize(q) - x).abs()
    assert (err <= _bound(q, x)).all(), err.max()
    assert dequantize(q).shape == x.shape


def test_more_bits_less_error_and_fake_quantize_matches():
    x = torch.randn(16, 256, generator=torch.Generator().manual_seed(0))
    errs = [(fake_quantize(x, b) - x).abs().mean().item() for b in (2, 4, 8)]
    assert errs[0] > errs[1] > errs[2] > 0
    assert torch.equal(fake_quantize(x, 4), dequantize(quantize(x, 4)))
    assert fake_quantize(x, 32) is x
    assert fake_quantize(x.half(), 8).dtype == torch.float16


def test_constant_group_and_extremes_stay_in_range():
    x = torch.full((2, 64), 0.1234)
    x[1, :] = torch.linspace(-1000.0, 1000.0, 64)
    q = quantize(x, 4)
    assert (dequantize(q) - x).abs().le(_bound(q, x)).all()
    with pytest.raises(ValueError, match="inf/nan"):
        quantize(torch.tensor([[1.0, float("nan")]]), 8)
    with pytest.raises(ValueError, match="bits=3"):
        quantize(x, 3)


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("shape,group", [((3, 5, 128), 64), ((7, 64), 32), ((4, 100), 64), ((2, 3, 16), 64), ((9,), 64)])
def test_byte_count_is_exact(bits, shape, group):
    q = quantize(torch.randn(shape), bits, group)
    assert q.nbytes == quantized_nbytes(shape, bits, group)
    # by hand for the aligned case: codes bits/8 a value + fp16 scale and zero per group
    if shape[-1] % group == 0:
        n = torch.Size(shape).numel()
        assert q.nbytes == n * bits // 8 + (n // group) * 4


def test_issue_figure_int4_is_0_5625_bytes_a_value_and_float_counts():
    assert quantized_nbytes((10, 64), 4) / (10 * 64) == 0.5625
    assert quantized_nbytes((10, 64), 32) == 10 * 64 * 4
    assert quantized_nbytes((10, 64), 16) == 10 * 64 * 2


def test_int4_packs_two_codes_a_byte_low_nibble_first():
    # one group of 64: values 0..15 repeated, min 0 max 15 -> scale 1, zero 0, codes = values
    x = (torch.arange(64) % 16).float().reshape(1, 64)
    q = quantize(x, 4)
    assert q.codes.shape == (1, 32) and q.codes.dtype == torch.uint8
    assert q.scales.item() == 1.0 and q.zeros.item() == 0.0
    assert q.codes[0, 0].item() == 0 | (1 << 4)  # codes 0 and 1
    assert q.codes[0, 7].item() == 14 | (15 << 4)
    assert torch.equal(dequantize(q), x)
    q2 = quantize(torch.tensor([[0.0, 1.0, 2.0, 3.0]]), 2)
    assert q2.codes.shape == (1, 1) and q2.codes.item() == 0 | 1 << 2 | 2 << 4 | 3 << 6


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_values_on_the_grid_quantize_back_to_themselves(bits):
    x = torch.randn(6, 128, generator=torch.Generator().manual_seed(bits)) * 5
    once = fake_quantize(x, bits)
    assert torch.equal(fake_quantize(once, bits), once)


@pytest.mark.parametrize("bits", [2, 4])
def test_every_byte_unpacks_to_its_codes(bits):
    """The unpacking the decode step runs per layer (in uint8) against the arithmetic definition."""
    packed = torch.arange(256, dtype=torch.uint8).reshape(4, 64)
    per, mask = 8 // bits, (1 << bits) - 1
    want = torch.tensor([[(int(b) >> (i * bits)) & mask for b in row for i in range(per)] for row in packed],
                        dtype=torch.uint8)
    got = _unpack(packed, bits)
    assert got.dtype == torch.uint8 and torch.equal(got, want)
