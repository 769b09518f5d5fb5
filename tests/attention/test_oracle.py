"""The project's strongest correctness test: query-only forwards with the exact document state
reproduce the ordinary full forward (document + pair in one pass)."""
import pytest
import torch

from nectar.attention.doc_kv import DocKVMismatch, load_doc_kv, prefill_document, save_doc_kv
from nectar.attention.exact import ExactDocState
from nectar.attention.engine import generate
from nectar.attention.forward import query_logits
from nectar.layout import build_layout


def _check_oracle(base, document, atol):
    layout = build_layout(base.tokenizer, document)
    pairs = [layout.pair("Who bought the island?", "Captain Ilse Brandt bought it."),
             layout.pair("What cargo?", "Salt cod and lamp oil.")]
    kv = prefill_document(base, layout.context_ids, chunk_tokens=64)  # chunked prefill too
    m = max(len(p.ids) for p in pairs)
    ids = torch.zeros(2, m, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(pairs):
        ids[i, : len(p.ids)] = torch.tensor(p.ids)
        mask[i, : len(p.ids)] = 1
    with torch.no_grad():
        got = query_logits(base, ExactDocState(kv), ids, layout.n, mask)
        for i, p in enumerate(pairs):
            ref = base.model(torch.tensor([list(layout.context_ids) + p.ids])).logits[0, layout.n:]
            assert torch.allclose(got[i, : len(p.ids)], ref, atol=atol), (got[i, : len(p.ids)] - ref).abs().max()
    return layout, kv


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen2", "tiny_qwen3"])
def test_exact_provider_reproduces_full_forward_tiny(fixture, request, document):
    _check_oracle(request.getfixturevalue(fixture), document, atol=1e-4)


@pytest.mark.slow
def test_exact_provider_reproduces_full_forward_smollm2(smollm2, document):
    _check_oracle(smollm2, document, atol=2e-3)


def test_no_document_provider_differs_from_full(tiny_llama, document):
    layout = build_layout(tiny_llama.tokenizer, document)
    p = layout.pair("Who?", "Brandt.")
    kv = prefill_document(tiny_llama, layout.context_ids)
    ids = torch.tensor([p.ids])
    with torch.no_grad():
        full = query_logits(tiny_llama, ExactDocState(kv), ids, layout.n)
        none = query_logits(tiny_llama, None, ids, layout.n)
    assert (full - none).abs().max() > 1e-3


def test_generation_with_exact_provider_matches_hf_generate(tiny_qwen3, document):
    layout = build_layout(tiny_qwen3.tokenizer, document)
    prompt = layout.prompt("Who bought the island?").ids
    kv = prefill_document(tiny_qwen3, layout.context_ids)
    ours = generate(tiny_qwen3, ExactDocState(kv), layout.n, [prompt, layout.prompt("Cargo?").ids], 10, stop_ids=())
    ref = tiny_qwen3.model.generate(torch.tensor([list(layout.context_ids) + prompt]), max_new_tokens=10,
                                    do_sample=False, eos_token_id=None)[0, layout.n + len(prompt):]
    assert ours.tokens[0] == ref.tolist()


def test_doc_kv_roundtrip_and_mismatch(tiny_llama, document, tmp_path):
    layout = build_layout(tiny_llama.tokenizer, document)
    kv = prefill_document(tiny_llama, layout.context_ids)
    url = str(tmp_path / "doc_kv.safetensors")
    save_doc_kv(kv, url, {"model_hash": tiny_llama.weights_hash, "doc_sha256": "abc"})
    back = load_doc_kv(url, tiny_llama, {"model_hash": tiny_llama.weights_hash, "doc_sha256": "abc"})
    assert all(torch.equal(a, b) for a, b in zip(kv.keys, back.keys))
    with pytest.raises(DocKVMismatch, match="doc_sha256"):
        load_doc_kv(url, tiny_llama, {"doc_sha256": "other"})


def test_context_manager_restores_attention_implementation_on_error(tiny_llama):
    from nectar.attention.interface import nectar_attention

    before = tiny_llama.model.config._attn_implementation
    with pytest.raises(ZeroDivisionError):
        with nectar_attention(tiny_llama.model, None):
            1 / 0
    assert tiny_llama.model.config._attn_implementation == before


def test_fused_document_state_agrees_with_exact_torch_math(tiny_llama, document):
    layout = build_layout(tiny_llama.tokenizer, document)
    kv = prefill_document(tiny_llama, layout.context_ids)
    q = torch.randn(3, tiny_llama.num_q_heads, 7, tiny_llama.head_dim)
    for layer in range(tiny_llama.num_layers):
        fused = ExactDocState(kv, backend="fused")(layer, q, tiny_llama.scaling)
        exact = ExactDocState(kv, backend="torch")(layer, q, tiny_llama.scaling)
        assert torch.allclose(fused.out, exact.out, atol=1e-5) and torch.allclose(fused.lse, exact.lse, atol=1e-5)


def test_fused_local_causal_state_agrees_with_exact_math():
    from nectar.attention.interface import _local_state
    from nectar.attention.state import attention_state

    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 4, 9, 16, generator=g), torch.randn(2, 2, 9, 16, generator=g),
               torch.randn(2, 2, 9, 16, generator=g))
    fast = _local_state(q, k, v, None, 0.25)
    exact = attention_state(q, k, v, 0.25, causal_offset=0)
    assert torch.allclose(fast.out, exact.out, atol=1e-5) and torch.allclose(fast.lse, exact.lse, atol=1e-5)
