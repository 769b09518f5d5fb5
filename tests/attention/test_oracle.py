"""The project's strongest correctness test: query-only forwards with the exact document state
reproduce the ordinary full forward (document + pair in one pass)."""
import pytest
import torch

from nectar.attention.doc_kv import DocKVMismatch, load_doc_kv, prefill_document, save_doc_kv
from nectar.attention.exact import ExactDocState
from nectar.attention.engine import generate
from nectar.attention.forward import query_logits
from nectar.layout import build_layout
from float_tolerance import FORWARD, close_reordered


def _check_oracle(base, document):
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
            assert close_reordered(got[i, : len(p.ids)], ref, FORWARD), (got[i, : len(p.ids)] - ref).abs().max()
    return layout, kv


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen2", "tiny_qwen3"])
def test_exact_provider_reproduces_full_forward_tiny(fixture, request, document):
    _check_oracle(request.getfixturevalue(fixture), document)


@pytest.mark.parametrize("fixture", ["tiny_llama_yarn", "tiny_qwen3_yarn"])
def test_exact_provider_reproduces_full_forward_with_rope_scaling(fixture, request, document, tiny_llama):
    """RoPE scaling on (model.yarn_factor; the paper's YaRN x4 for Qwen3): the query-only forward at
    positions n… with the exact document state still equals the ordinary full forward."""
    base = request.getfixturevalue(fixture)
    layout, kv = _check_oracle(base, document)
    if fixture == "tiny_llama_yarn":  # same weights, unscaled: the scaling must change the outputs
        p = layout.pair("Who bought the island?", "Captain Ilse Brandt bought it.")
        ids = torch.tensor([p.ids])
        with torch.no_grad():
            scaled = query_logits(base, ExactDocState(kv), ids, layout.n)
            plain = query_logits(tiny_llama, ExactDocState(prefill_document(tiny_llama, layout.context_ids)),
                                 ids, layout.n)
        assert (scaled - plain).abs().max() > 1e-3


class _RecordingProvider:
    """Wraps a provider and keeps the rotated queries it is asked about at layer 0."""

    def __init__(self, inner):
        self.inner, self.q0 = inner, []

    def __call__(self, layer, q, scaling):
        if layer == 0:
            self.q0.append(q.detach().clone())
        return self.inner(layer, q, scaling) if self.inner is not None else None


def _full_forward_q0(base, layout, ids):
    """Layer-0 rotated queries of the ordinary full forward (document + pair), at the pair's positions."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    attn = base.model.model.layers[0].self_attn
    seen = {}
    hook = attn.register_forward_pre_hook(lambda m, a, kw: seen.update(kw), with_kwargs=True)
    with torch.no_grad():
        base.model(torch.tensor([list(layout.context_ids) + ids]))
    hook.remove()
    hs = seen["hidden_states"]
    q = attn.q_proj(hs).view(1, hs.shape[1], -1, base.head_dim)
    if hasattr(attn, "q_norm"):
        q = attn.q_norm(q)
    cos, sin = seen["position_embeddings"]
    q, _ = apply_rotary_pos_emb(q.transpose(1, 2), q.transpose(1, 2), cos, sin)
    return q[:, :, layout.n:]  # [1, hq, m, d]


@pytest.mark.parametrize("fixture", ["tiny_llama_yarn", "tiny_qwen3_yarn"])
def test_module_and_full_context_paths_rotate_queries_identically(fixture, request, document):
    """Every path that runs query tokens — capture (targets), teacher forcing with the module
    (training, evaluation), with the exact document (full-context reference), and generation with
    the module (prompt prefill, then decode steps) — hands the provider the same scaled-RoPE queries
    as the ordinary full forward rotates at those positions."""
    from nectar.modules.builder import build_module, plan_from_config
    from nectar.modules.provider import ModuleDocState
    from nectar.schemas.config import ModuleConfig
    from nectar.targets.capture import capture_packed

    base = request.getfixturevalue(fixture)
    layout = build_layout(base.tokenizer, document)
    kv = prefill_document(base, layout.context_ids)
    pair = layout.pair("Who bought the island?", "Captain Ilse Brandt bought it.")
    ref = _full_forward_q0(base, layout, pair.ids)  # [1, hq, m, d]
    plan = plan_from_config(ModuleConfig(rho=0.25, depths=(0, 2, 2)), base.num_layers, base.num_kv_heads,
                            base.head_dim, layout.n, base.scaling)
    module = ModuleDocState(build_module(plan, None, None, seed=0))

    exact = _RecordingProvider(ExactDocState(kv))
    capture_packed(base, exact, [pair.ids], layout.n, top_k=4)
    paths = {"capture": exact.q0[0]}
    for name, inner in (("module", module), ("full", ExactDocState(kv))):
        rec = _RecordingProvider(inner)
        with torch.no_grad():
            query_logits(base, rec, torch.tensor([pair.ids]), layout.n)
        paths[name] = rec.q0[0]
    rec = _RecordingProvider(module)
    prompt = pair.ids[: pair.response_start]
    generate(base, rec, layout.n, [prompt], max_new_tokens=3, stop_ids=())
    paths["generate_prompt"] = rec.q0[0]
    for name, q in paths.items():
        got = q[..., : q.shape[2], :] if name != "generate_prompt" else q
        want = ref[:, :, : got.shape[2]]
        assert close_reordered(got, want), (name, (got - want).abs().max())
    # decode steps: one query each, at positions n + len(prompt), n + len(prompt) + 1
    steps = rec.q0[1:]
    assert len(steps) == 2 and all(s.shape[2] == 1 for s in steps)
    gen_ids = prompt + []
    logits = query_logits(base, module, torch.tensor([prompt]), layout.n)[0, -1]
    gen_ids.append(int(logits.argmax()))
    ref_gen = _full_forward_q0(base, layout, gen_ids)
    assert close_reordered(steps[0], ref_gen[:, :, -1:])


@pytest.mark.slow
def test_exact_provider_reproduces_full_forward_smollm2(smollm2, document):
    _check_oracle(smollm2, document)


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
        assert close_reordered(fused.out, exact.out) and close_reordered(fused.lse, exact.lse)


def test_fused_local_causal_state_agrees_with_exact_math():
    from nectar.attention.interface import _local_state
    from nectar.attention.state import attention_state

    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 4, 9, 16, generator=g), torch.randn(2, 2, 9, 16, generator=g),
               torch.randn(2, 2, 9, 16, generator=g))
    fast = _local_state(q, k, v, None, 0.25)
    exact = attention_state(q, k, v, 0.25, causal_offset=0)
    assert close_reordered(fast.out, exact.out) and close_reordered(fast.lse, exact.lse)


def test_prefill_chunk_follows_the_mlp_width_and_chunks_give_the_same_kv(tiny_llama):
    """The default chunk keeps the MLP activation near 256 MB (at least 2,048 tokens); a document
    prefilled in chunks of 16 and in one forward gives the same KV."""
    from types import SimpleNamespace

    from nectar.attention.doc_kv import prefill_chunk

    assert prefill_chunk(SimpleNamespace(intermediate_size=1536, hidden_size=576)) == 43690  # SmolLM2-135M
    assert prefill_chunk(SimpleNamespace(intermediate_size=6144, hidden_size=2048)) == 10922  # Qwen3-1.7B
    assert prefill_chunk(SimpleNamespace(intermediate_size=None, hidden_size=10 ** 6)) == 2048
    layout = build_layout(tiny_llama.tokenizer, "The island was bought by Captain Ilse Brandt in 1871. " * 4)
    whole = prefill_document(tiny_llama, layout.context_ids)
    chunked = prefill_document(tiny_llama, layout.context_ids, chunk_tokens=16)
    assert layout.n > 32
    for a, b in zip(whole.keys + whole.values, chunked.keys + chunked.values):
        assert close_reordered(b, a, FORWARD, name="chunked prefill")
