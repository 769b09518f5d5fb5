"""CUDA paths of the attention core (docs/design.md §2), checked against the exact torch math.

* The document-state backends that run on GPU — ``fused`` (torch's flash kernel, returning its lse)
  and ``flash`` (the flash-attn package, when installed) — give the same (out, lse) as the exact
  float32 ``torch`` backend, within bf16 rounding.
* The oracle holds on CUDA: a query-only forward with the exact document state reproduces the
  ordinary full forward (document + pair), in float32 with the torch backend and in bf16 with fused.

Skipped cleanly on machines without CUDA (``pytest -m gpu`` to select them).
"""
import copy

import pytest
import torch

from nectar.attention.doc_kv import DocKV, prefill_document
from nectar.attention.exact import ExactDocState

from nectar.attention.kernels import flash_available
from nectar.attention.forward import query_logits
from nectar.layout import build_layout

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

CUDA = torch.device("cuda")


def _random_doc_kv(layers: int, hkv: int, n: int, d: int, dtype: torch.dtype, seed: int = 0) -> DocKV:
    g = torch.Generator(device=CUDA).manual_seed(seed)
    # Keys with a spread of norms so softmax is neither flat nor one-hot; values O(1).
    keys = [(torch.randn(hkv, n, d, generator=g, device=CUDA) * 1.5).to(dtype) for _ in range(layers)]
    values = [torch.randn(hkv, n, d, generator=g, device=CUDA).to(dtype) for _ in range(layers)]
    return DocKV(keys, values)  # per layer [hkv, n, d]


def _queries(b: int, hq: int, m: int, d: int, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    g = torch.Generator(device=CUDA).manual_seed(seed)
    return (torch.randn(b, hq, m, d, generator=g, device=CUDA) * 1.5).to(dtype)  # [b, hq, m, d]


def _assert_states_close(got, ref, out_atol: float, lse_atol: float) -> None:
    assert got.out.shape == ref.out.shape and got.lse.shape == ref.lse.shape
    assert torch.isfinite(got.out).all() and torch.isfinite(got.lse).all()
    out_err = (got.out.float() - ref.out.float()).abs().max().item()
    lse_err = (got.lse.float() - ref.lse.float()).abs().max().item()
    assert out_err <= out_atol, f"out differs by {out_err:.3g} (limit {out_atol})"
    assert lse_err <= lse_atol, f"lse differs by {lse_err:.3g} (limit {lse_atol})"


# n = 5000 spans two chunks of the torch backend (chunk_size 4096), so its exact chunk merge is used.
@pytest.mark.parametrize("backend", ["fused", "flash"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (8, 8, 128)])
def test_cuda_backend_matches_exact_torch_backend(backend, dtype, hq, hkv, d):
    if backend == "flash" and not flash_available(CUDA):
        pytest.skip("flash-attn is not installed")
    kv = _random_doc_kv(layers=2, hkv=hkv, n=5000, d=d, dtype=dtype)
    q = _queries(b=3, hq=hq, m=37, d=d, dtype=dtype)
    scaling = d ** -0.5
    exact = ExactDocState(kv, backend="torch")
    fast = ExactDocState(kv, backend=backend)
    for layer in range(2):
        ref = exact(layer, q, scaling)
        got = fast(layer, q, scaling)
        # The kernels round P and the output to 16 bits (float32 inputs are cast to bf16 first);
        # the lse is accumulated in float32 from the same logits, so it stays much tighter.
        out_atol = 4e-3 if dtype == torch.float16 else 1.6e-2
        lse_atol = 3e-2 if dtype == torch.float32 else 2e-3
        _assert_states_close(got, ref, out_atol, lse_atol)


def test_auto_backend_on_cuda_uses_a_cuda_kernel():
    kv = _random_doc_kv(layers=1, hkv=2, n=64, d=64, dtype=torch.bfloat16)
    assert ExactDocState(kv, backend="auto").backend == ("flash" if flash_available(CUDA) else "fused")


def _pairs_batch(layout, device):
    pairs = [layout.pair("Who bought the island?", "Captain Ilse Brandt bought it."),
             layout.pair("What cargo did the Meridian carry?", "Salt cod and lamp oil.")]
    m = max(len(p.ids) for p in pairs)
    ids = torch.zeros(len(pairs), m, dtype=torch.long, device=device)  # [b, m] right-padded
    mask = torch.zeros_like(ids)
    for i, p in enumerate(pairs):
        ids[i, : len(p.ids)] = torch.tensor(p.ids, device=device)
        mask[i, : len(p.ids)] = 1
    return pairs, ids, mask


def _load_tiny(name: str, dtype: str):
    from nectar.base_model import load_base_model
    from nectar.schemas import ModelConfig

    return load_base_model(ModelConfig(name=name, dtype=dtype, device="cuda"))


@pytest.mark.parametrize("name", ["tiny:llama", "tiny:qwen2", "tiny:qwen3"])
def test_oracle_float32_torch_backend_on_cuda(name, document):
    base = _load_tiny(name, "float32")
    layout = build_layout(base.tokenizer, document)
    kv = prefill_document(base, layout.context_ids, chunk_tokens=64)
    pairs, ids, mask = _pairs_batch(layout, CUDA)
    with torch.no_grad():
        got = query_logits(base, ExactDocState(kv, backend="torch"), ids, layout.n, mask)  # [b, m, V]
        for i, p in enumerate(pairs):
            full = torch.tensor([list(layout.context_ids) + p.ids], device=CUDA)
            ref = base.model(full).logits[0, layout.n:]
            err = (got[i, : len(p.ids)] - ref).abs().max().item()
            assert err < 1e-4, f"{name}: query-only logits differ from the full forward by {err:.3g}"


@pytest.mark.parametrize("name", ["tiny:llama", "tiny:qwen2", "tiny:qwen3"])
def test_oracle_bf16_fused_backend_on_cuda(name, document):
    """bf16 has no exact answer to compare with, so both bf16 paths are measured against the float32
    forward of the same weights: ours (fused document state + merge) must be as close to it as the
    model's own bf16 full forward is, not merely 'close'."""
    base = _load_tiny(name, "bfloat16")
    ref_model = copy.deepcopy(base.model).float()  # the same bf16 weights, float32 compute
    layout = build_layout(base.tokenizer, document)
    kv = prefill_document(base, layout.context_ids, chunk_tokens=64)
    pairs, ids, mask = _pairs_batch(layout, CUDA)
    with torch.no_grad():
        got = query_logits(base, ExactDocState(kv, backend="fused"), ids, layout.n, mask).float()
        for i, p in enumerate(pairs):
            full = torch.tensor([list(layout.context_ids) + p.ids], device=CUDA)
            ref32 = ref_model(full).logits[0, layout.n:].float()
            ref16 = base.model(full).logits[0, layout.n:].float()
            ours_err = (got[i, : len(p.ids)] - ref32).abs().max().item()
            hf_err = (ref16 - ref32).abs().max().item()
            scale = ref32.abs().max().item()
            assert ours_err <= 2 * hf_err + 1e-3 * scale, (
                f"{name}: bf16 query-only logits are {ours_err:.3g} from float32, the model's own bf16 "
                f"forward {hf_err:.3g} (logit scale {scale:.3g})")


@pytest.mark.parametrize("name", ["tiny:llama", "tiny:qwen3"])
def test_cuda_graph_decode_equals_eager_decode(name, document):
    """The captured decode step (static shapes, replayed per step) decodes what the eager step does,
    with the exact document state and with a fused module, for a batch of different-length prompts."""
    from nectar.attention.engine import DecodeEngine, Request
    from nectar.modules import build_module, plan_module
    from nectar.modules.provider import inference_provider

    base = _load_tiny(name, "float32")
    layout = build_layout(base.tokenizer, document)
    kv = prefill_document(base, layout.context_ids)
    plan = plan_module("mlp", base.num_layers, base.num_kv_heads, base.head_dim, layout.n, base.scaling, 0.5,
                       depths=(0, 2, 2))
    module = build_module(plan).to(CUDA)
    prompts = [layout.prompt(q).ids for q in ("Who bought the island?", "What cargo did the Meridian carry?")]
    for provider in (ExactDocState(kv), inference_provider(module)):
        reqs = [Request(p, 12, temperature=t, top_p=0.9, seed=3) for p, t in zip(prompts, (0.0, 1.0))]
        eager = DecodeEngine(base, provider, layout.n, stop_ids=(), cuda_graphs=False).run(reqs)
        graphed = DecodeEngine(base, provider, layout.n, stop_ids=(), cuda_graphs=True, check_every=4).run(reqs)
        assert graphed.tokens == eager.tokens
