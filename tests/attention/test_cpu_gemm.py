"""oneDNN routing of the base model's linear layers inside the decode engine (nectar.attention.cpu_gemm):
the same logits as MKL's F.linear up to float reordering, everything restored on the way out, and a
no-op where it does not apply."""
import pytest
import torch
from torch import nn

from nectar.attention.cpu_gemm import onednn_available, onednn_linears
from nectar.attention.engine import DecodeEngine
from nectar.attention.exact import ExactDocState
from nectar.attention.doc_kv import prefill_document
from nectar.layout import build_layout
from float_tolerance import FORWARD, assert_close_reordered

pytestmark = pytest.mark.skipif(not onednn_available(), reason="this torch build has no oneDNN linear kernel")


def _linears(model):
    return [m for m in model.modules() if isinstance(m, nn.Linear)]


def test_routed_forward_gives_mkls_logits_and_is_undone(tiny_llama):
    ids = torch.tensor([[1, 5, 9, 13, 17, 21]])  # [1, 6]: six rows per linear layer
    with torch.inference_mode():
        want = tiny_llama.model(input_ids=ids, use_cache=False).logits
        with onednn_linears(tiny_llama.model) as routed:
            assert routed == len(_linears(tiny_llama.model)) > 0
            assert all("forward" in vars(m) for m in _linears(tiny_llama.model))
            got = tiny_llama.model(input_ids=ids, use_cache=False).logits
    assert not any("forward" in vars(m) for m in _linears(tiny_llama.model))
    assert_close_reordered(got, want, FORWARD)


def test_one_row_and_grad_requiring_inputs_stay_on_f_linear():
    lin = nn.Linear(8, 4)
    with onednn_linears(lin) as routed:
        assert routed == 1
        x = torch.randn(1, 8)
        assert torch.equal(lin(x), nn.functional.linear(x, lin.weight, lin.bias))  # one row: MKL, bit for bit
        xg = torch.randn(3, 8, requires_grad=True)
        lin(xg).sum().backward()  # training-side inputs keep autograd (oneDNN's kernel has none here)
        assert xg.grad is not None


def test_disabled_or_not_float32_routes_nothing(tiny_llama):
    with onednn_linears(tiny_llama.model, enabled=False) as routed:
        assert routed == 0 and not any("forward" in vars(m) for m in _linears(tiny_llama.model))
    half = nn.Linear(8, 4).to(torch.bfloat16)
    with onednn_linears(half) as routed:
        assert routed == 0


def test_engine_prefill_logits_with_and_without_onednn_agree(tiny_llama, document):
    layout = build_layout(tiny_llama.tokenizer, document)
    kv = prefill_document(tiny_llama, layout.context_ids)
    prompts = [layout.prompt(q).ids for q in ("Who bought the island?", "Cargo?")]
    on = DecodeEngine(tiny_llama, ExactDocState(kv), layout.n, stop_ids=()).prefill_logits(prompts)
    off = DecodeEngine(tiny_llama, ExactDocState(kv), layout.n, stop_ids=(), onednn=False).prefill_logits(prompts)
    assert_close_reordered(on, off, FORWARD)
