"""No silent dtype changes: flash-attn (fp16/bf16 only) is never picked for, nor forced on, a float32
model, and on CUDA the fused path keeps float32 queries in float32 (GPU figures owed: not run here)."""
import pytest
import torch

from nectar.attention import kernels
from nectar.attention.kernels import choose_backend, fused_state
from nectar.attention.state import attention_state
from float_tolerance import close_reordered

CUDA, CPU = torch.device("cuda"), torch.device("cpu")


@pytest.mark.parametrize("dtype,flash_installed,expected", [
    (torch.float32, True, "fused"),  # would have been flash (and bf16) before
    (torch.bfloat16, True, "flash"),
    (torch.float16, True, "flash"),
    (torch.bfloat16, False, "fused"),
])
def test_auto_picks_flash_only_for_half_precision_models(monkeypatch, dtype, flash_installed, expected):
    monkeypatch.setattr(kernels, "flash_available", lambda device: flash_installed and device.type == "cuda")
    assert choose_backend("auto", CUDA, dtype) == expected
    assert choose_backend("auto", CPU, dtype) == "fused"


def test_flash_on_a_float32_model_is_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"float16/bfloat16, the model runs in torch.float32.*attention_backend=fused"):
        choose_backend("flash", CUDA, torch.float32)
    with pytest.raises(ValueError, match="needs CUDA"):
        choose_backend("flash", CPU, torch.bfloat16)
    assert choose_backend("torch", CUDA, torch.float32) == "torch"


@pytest.mark.gpu
def test_fused_state_keeps_float32_on_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    g = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (torch.randn(1, 2, 64, 32, generator=g).cuda() for _ in range(3))
    for causal in (False, True):
        got = fused_state(q, k, v, 32 ** -0.5, causal=causal)
        ref = attention_state(q, k, v, 32 ** -0.5, causal_offset=0 if causal else None)
        # bf16 rounding would show as ~1e-2 differences; the float32 path agrees to float tolerance
        assert close_reordered(got.out, ref.out) and close_reordered(got.lse, ref.lse)
