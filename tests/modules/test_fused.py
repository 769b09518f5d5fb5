"""The fused inference form of a module equals the training form (``NectarModule.predict``).

Tolerance: folding the normalisation into the weights and concatenating the q-GEMMs reorders float
sums, so in float32 the fused outputs agree to 2e-5 of the outputs' largest magnitude (measured:
at most 4e-7 over these architectures). With bfloat16 weights (the GPU form) the log-mass a, whose
output layer stays float32, agrees to 1e-2 of its magnitude and A to 2e-2 (measured 2.3e-3 and
4.2e-3: bf16 keeps 8 mantissa bits through four hidden layers).
"""
import dataclasses

import pytest
import torch

from nectar.modules import build_module, plan_module
from nectar.modules.fused import fuse_module
from nectar.modules.provider import FusedModuleDocState, ModuleDocState
from nectar.modules.stored import quantize_module_, stored_nbytes


def _module(depths=(0, 4, 4), residual=False, layer_norm=False, arch="mlp", seed=0):
    plan = plan_module(arch, num_layers=2, num_kv_heads=3, head_dim=16, n_context=600, scaling=0.25, rho=0.5,
                       layer_multipliers=(1.0, 2.0), depths=depths, residual=residual, layer_norm=layer_norm)
    g = torch.Generator().manual_seed(seed)
    kv = [torch.randn(3, 600, 16, generator=g) for _ in range(2)]
    module = build_module(plan, doc_keys=kv, doc_values=kv, seed=seed)
    with torch.no_grad():  # trained-looking weights: non-zero output layers and real statistics
        for name, p in module.named_parameters():
            p.add_(torch.randn(p.shape, generator=g) * (0.3 if "out" in name else 0.05))
        module.set_normalization({"q_mean": torch.randn(2, 3, 16, generator=g),
                                  "q_std": torch.rand(2, 3, generator=g) + 0.5,
                                  "alpha_mean": torch.randn(2, 3, generator=g) * 3,
                                  "alpha_std": torch.rand(2, 3, generator=g) + 0.5,
                                  "A_mean": torch.randn(2, 3, 16, generator=g),
                                  "A_std": torch.rand(2, 3, generator=g) + 0.5})
    return module


def _close(got: torch.Tensor, want: torch.Tensor, rel: float) -> None:
    err = (got.float() - want.float()).abs().max().item()
    scale = want.abs().max().item()
    assert err <= rel * scale, f"max abs error {err:.3g} > {rel} x {scale:.3g}"


@pytest.mark.parametrize("depths,residual,layer_norm,arch", [
    ((0, 4, 4), False, False, "mlp"),  # the default: score and target as one block-diagonal chain
    ((2, 3, 3), True, False, "mlp"),  # merged chains reading a backbone, residual hidden layers
    ((2, 2, 3), True, True, "mlp"),  # a backbone, residual hidden layers, layer norm (separate chains)
    ((0, 0, 2), False, False, "mlp"),  # an affine score head reading q
    ((1, 0, 2), False, False, "mlp"),  # an affine score head reading the backbone
    ((0, 4, 4), False, False, "quadrature"),
])
def test_fused_module_equals_training_form_float32(depths, residual, layer_norm, arch):
    module = _module(depths, residual, layer_norm, arch)
    fused = fuse_module(module)
    q = torch.randn(40, 3, 16) * 2  # [N, H, d]
    with torch.no_grad():
        for layer in range(2):
            A, a = module.predict(layer, q)
            fA, fa = fused.predict(layer, q.transpose(0, 1))  # head-major
            merged = fused.layers[layer].merged is not None if arch == "mlp" else None
            assert merged in ({(0, 4, 4): True, (2, 3, 3): True}.get(depths, False), None)
            assert fa.dtype == torch.float32
            _close(fA.transpose(0, 1), A, 2e-5)
            _close(fa.transpose(0, 1), a, 2e-5)


def test_fused_quadrature_with_a_log_mass_bias():
    plan = plan_module("quadrature", num_layers=2, num_kv_heads=3, head_dim=16, n_context=600, scaling=0.25,
                       rho=0.5, layer_multipliers=(1.0, 2.0), quad_bias=True)
    module = build_module(plan)
    with torch.no_grad():
        for layer in module.layers:
            layer.beta.normal_(0, 2.0)
    fused, q = fuse_module(module), torch.randn(40, 3, 16) * 2
    with torch.no_grad():
        A, a = module.predict(1, q)
        fA, fa = fused.predict(1, q.transpose(0, 1))
    _close(fA.transpose(0, 1), A, 2e-5)
    _close(fa.transpose(0, 1), a, 2e-5)


def test_fused_provider_equals_module_provider_with_gqa():
    module = _module()
    q = torch.randn(2, 9, 5, 16)  # [b, hq = 3 groups of 3, m, d]
    with torch.no_grad():
        want = ModuleDocState(module)(1, q, 0.25)
        got = FusedModuleDocState(module)(1, q, 0.25)
    _close(got.out, want.out, 2e-5)
    _close(got.lse, want.lse, 2e-5)


def test_fused_bfloat16_weights_keep_float32_outputs():
    module = _module()
    fused = fuse_module(module, dtype=torch.bfloat16)
    q = torch.randn(3, 32, 16)
    with torch.no_grad():
        A, a = module.predict(0, q.transpose(0, 1))
        fA, fa = fused.predict(0, q)
    assert fa.dtype == torch.float32 and fA.dtype == torch.float32  # output layers run in float32
    _close(fa.transpose(0, 1), a, 1e-2)
    _close(fA.transpose(0, 1), A, 2e-2)


def _quantized_quadrature(bits: int, ragged: bool = False):
    plan = plan_module("quadrature", num_layers=2, num_kv_heads=3, head_dim=64, n_context=600, scaling=0.125,
                       rho=0.1, layer_multipliers=(1.0, 2.0), quad_bias=True, bits=bits)
    if ragged:  # heads of different widths, as KVzip's selection leaves them (modules/stored.py)
        plan = dataclasses.replace(plan, quad_head_pairs=tuple((p, p - 7, p - 20) for p in plan.quad_pairs))
    module = build_module(plan)
    with torch.no_grad():
        for layer in module.layers:
            layer.beta.normal_(0, 2.0)
            layer.Z.normal_(0, 1.0)
    quantize_module_(module)
    return module


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_quadrature_served_from_its_codes_matches_its_dequantized_float_copy(bits):
    """A state stored at int8/int4, fused with ``keep_dequantized=False``: the layer keeps only packed
    codes + fp16 scales and zeros (its bytes are the stored bytes) and dequantizes per call; the
    training form holds the same values as floats. Same tolerance as the float32 fusion (the values are
    identical, only sums reorder)."""
    module = _quantized_quadrature(bits)
    fused, q = fuse_module(module, keep_dequantized=False), torch.randn(40, 3, 64) * 2
    assert fused.layers[0].packed is not None and fused.layers[0].Wt is None
    assert fused.nbytes == fused.resident_bytes == stored_nbytes(module)  # the stored codes, not a float copy
    with torch.no_grad():
        for layer in range(2):
            A, a = module.predict(layer, q)
            fA, fa = fused.predict(layer, q.transpose(0, 1))
            _close(fA.transpose(0, 1), A, 2e-5)
            _close(fa.transpose(0, 1), a, 2e-5)
    assert fused.dequantizations == 2  # one per call


@pytest.mark.parametrize("ragged", [False, True])
def test_kept_dequantized_weights_are_computed_once_and_give_the_codes_answers(ragged):
    """The default fused form dequantizes each layer's codes once, at fusion, and keeps the floats:
    calls read them (no dequantization per call) and answer exactly what dequantizing per call does;
    it holds the codes and the floats (``resident_bytes``), and a call reads the floats (``nbytes``)."""
    module = _quantized_quadrature(4, ragged)
    kept, codes = fuse_module(module), fuse_module(module, keep_dequantized=False)
    assert kept.dequantizations == 2  # one per layer, at fusion
    q = torch.randn(3, 40, 64) * 2  # [H, N, d] head-major
    with torch.no_grad():
        for _ in range(3):
            for layer in range(2):
                (A, a), (cA, ca) = kept.predict(layer, q), codes.predict(layer, q)
                assert torch.equal(A, cA) and torch.equal(a, ca)
    assert kept.dequantizations == 2 and codes.dequantizations == 6
    floats = sum(t.numel() * t.element_size() for layer in kept.layers for t in layer.dequantized)
    assert kept.nbytes == floats and kept.resident_bytes == stored_nbytes(module) + floats
    assert floats > 4 * stored_nbytes(module)  # int4 codes: the kept floats are the larger part
