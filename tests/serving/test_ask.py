"""Answering without the document: the streaming loop agrees with the core's ``generate``, the
streamed text is the answer, and with the exact-size quadrature module (p = n, the oracle) the
answer is the full-context model's own greedy answer. ``ask`` works on a run directory."""
import pytest
import torch

from nectar.serving.ask import answer, ask
from nectar.attention.doc_kv import prefill_document
from nectar.attention.exact import ExactDocState
from nectar.attention.engine import generate
from nectar.layout import build_layout
from nectar.modules import ModuleMismatch, build_module, make_spec, plan_module, save_module
from nectar.modules.provider import ModuleDocState


def _full_quadrature(base, kv):
    plan = plan_module("quadrature", base.num_layers, base.num_kv_heads, base.head_dim, kv.n, base.scaling,
                       rho=1.0, layer_multipliers=(1.0,))
    return build_module(plan, kv.keys, kv.values), plan


@pytest.mark.slow
def test_streamed_greedy_answer_matches_generate_and_the_full_context_model(tiny_qwen3, document):
    base = tiny_qwen3
    layout = build_layout(base.tokenizer, document)
    kv = prefill_document(base, layout.context_ids)
    module, _ = _full_quadrature(base, kv)
    chunks: list[str] = []
    got = answer(base, module, layout, layout.n, "Who bought the island?", stream=chunks.append,
                 max_new_tokens=12, temperature=0.0)
    prompt = layout.prompt("Who bought the island?").ids
    core = generate(base, ModuleDocState(module), layout.n, [prompt], 12)
    assert got.token_ids == core.tokens[0] and len(got.token_ids) > 0
    assert "".join(chunks) == got.text and len(chunks) > 1
    full = generate(base, ExactDocState(kv), layout.n, [prompt], 12)  # document KV, exact
    assert got.token_ids == full.tokens[0]
    hf = base.model.generate(torch.tensor([list(layout.context_ids) + prompt]), max_new_tokens=len(got.token_ids),
                             do_sample=False)[0, layout.n + len(prompt):]
    assert got.token_ids == hf.tolist()


@pytest.mark.slow
def test_sampling_is_seeded(tiny_qwen3, document):
    layout = build_layout(tiny_qwen3.tokenizer, document)
    module = build_module(plan_module("mlp", 2, 2, 16, layout.n, tiny_qwen3.scaling, 0.5, depths=(0, 2, 2)))
    kw = dict(max_new_tokens=8, temperature=1.0, top_p=0.9)
    a = answer(tiny_qwen3, module, layout, layout.n, "Cargo?", seed=1, **kw)
    b = answer(tiny_qwen3, module, layout, layout.n, "Cargo?", seed=1, **kw)
    assert a.token_ids == b.token_ids
    with pytest.raises(ValueError, match="empty"):
        answer(tiny_qwen3, module, layout, layout.n, "  ")


def test_ask_on_a_run_directory_checks_the_document(tiny_llama, document, tmp_path):
    from nectar.orchestration import prepare_run
    from nectar.schemas.presets import load_config

    doc = tmp_path / "lighthouse.txt"
    doc.write_text(document)
    cfg = load_config("tiny")
    ctx = prepare_run(str(doc), cfg, str(tmp_path / "run"))
    layout = build_layout(tiny_llama.tokenizer, ctx.text)
    kv = prefill_document(tiny_llama, layout.context_ids)
    module, plan = _full_quadrature(tiny_llama, kv)
    spec = make_spec(module, plan, tiny_llama.name, tiny_llama.weights_hash, ctx.info.sha256, tiny_llama.num_q_heads)
    save_module(module, spec, ctx.run.url("train"))
    streamed: list[str] = []
    got = ask(ctx.run.root, "Who bought the island?", stream=streamed.append, max_new_tokens=6, temperature=0.0)
    want = generate(tiny_llama, ExactDocState(kv), layout.n, [layout.prompt("Who bought the island?").ids], 6)
    assert got.token_ids == want.tokens[0] and "".join(streamed) == got.text
    save_module(module, spec.model_copy(update={"doc_sha256": "0" * 64}), ctx.run.url("train"))
    with pytest.raises(ModuleMismatch, match="document"):
        ask(ctx.run.root, "Who?", max_new_tokens=2)
