"""MLP and Quadrature modules: the batched-head math equals a per-head reference, the quadrature
with p = n initialised from the document KV is the exact document state (oracle), save/load checks."""
import pytest
import torch
import torch.nn.functional as F

from nectar.attention.doc_kv import prefill_document
from nectar.attention.exact import ExactDocState
from nectar.attention.forward import query_logits
from nectar.attention.state import attention_state
from nectar.layout import build_layout
from nectar.modules import ModuleMismatch, build_module, load_module, make_spec, plan_module, save_module
from nectar.modules.provider import ModuleDocState, group_queries, ungroup
from float_tolerance import FORWARD, close_reordered


def _mlp_plan(**kw):
    args = dict(arch="mlp", num_layers=2, num_kv_heads=3, head_dim=8, n_context=400, scaling=8 ** -0.5,
                rho=0.5, layer_multipliers=(1.0, 1.0), depths=(0, 3, 2))
    args.update(kw)
    return plan_module(**args)


def _reference_head(layer, prefix, shape, h_in, q, head, residual):
    """eq. mlp-backbone for one head with explicit matrices (no batching over heads)."""
    p = dict(layer.named_parameters())
    h = h_in
    for k in range(shape.depth):
        if k == 0:
            pre = h_in @ p[f"{prefix}_U0"][head] + p[f"{prefix}_b0"][head]
        else:
            pre = q @ p[f"{prefix}_V{k}"][head] + h @ p[f"{prefix}_U{k}"][head] + p[f"{prefix}_b{k}"][head]
        if shape.layer_norm:
            pre = F.layer_norm(pre, (shape.width,)) * p[f"{prefix}_ln{k}_g"][head] + p[f"{prefix}_ln{k}_b"][head]
        h = h + F.silu(pre) if (residual and k > 0) else F.silu(pre)
    if shape.out_dim is None:
        return h
    return h @ p[f"{prefix}_Wout"][head] + p[f"{prefix}_bout"][head]


@pytest.mark.parametrize("depths,residual,layer_norm", [((0, 3, 2), False, False), ((2, 2, 3), True, True)])
def test_batched_heads_equal_per_head_reference(depths, residual, layer_norm):
    plan = _mlp_plan(depths=depths, residual=residual, layer_norm=layer_norm)
    module = build_module(plan, seed=1)
    with torch.no_grad():  # non-zero output layers so the check is not trivially 0 == 0
        for name, p in module.named_parameters():
            if "out" in name:
                p.normal_(0, 0.3)
    q = torch.randn(5, 3, 8)
    layer = module.layers[1]
    A, a = layer(q)  # [5, 3, 8], [5, 3]
    s = plan.mlp_shapes(1)
    for head in range(3):
        qh = q[:, head]
        h = _reference_head(layer, "backbone", s.backbone, qh, qh, head, residual) if depths[0] else qh
        assert close_reordered(a[:, head], _reference_head(layer, "score", s.score, h, qh, head, residual)[:, 0])
        assert close_reordered(A[:, head], _reference_head(layer, "target", s.target, h, qh, head, residual))


def test_parameter_count_matches_the_plan_exactly():
    for plan in (_mlp_plan(), _mlp_plan(depths=(2, 2, 3), layer_norm=True), _mlp_plan(arch="quadrature")):
        module = build_module(plan, doc_keys=[torch.randn(3, 400, 8)] * 2, doc_values=[torch.randn(3, 400, 8)] * 2)
        assert module.n_params() == 3 * sum(plan.head_params(i) for i in range(2))


def test_untrained_mlp_predicts_the_normalisation_mean():
    module = build_module(_mlp_plan())
    stats = {"alpha_mean": torch.randn(2, 3), "A_mean": torch.randn(2, 3, 8),
             "alpha_std": torch.rand(2, 3) + 0.5, "A_std": torch.rand(2, 3) + 0.5}
    module.set_normalization(stats)
    A, a = module.predict(1, torch.randn(4, 3, 8) * 10)
    assert torch.allclose(a, stats["alpha_mean"][1].expand(4, 3))
    assert torch.allclose(A, stats["A_mean"][1].expand(4, 3, 8))


def test_quadrature_is_attention_over_its_pairs():
    plan = _mlp_plan(arch="quadrature", rho=0.05)
    k, v = torch.randn(3, 400, 8), torch.randn(3, 400, 8)
    module = build_module(plan, doc_keys=[k, k], doc_values=[v, v])
    p = plan.quad_pairs[0]
    q = torch.randn(6, 3, 8)
    A, a = module.predict(0, q)
    ref = attention_state(q.permute(1, 0, 2)[None], k[None, :, :p], v[None, :, :p], plan.scaling)
    assert close_reordered(A, ref.out[0].permute(1, 0, 2))
    assert close_reordered(a, ref.lse[0].T)


def test_group_queries_follows_gqa_head_mapping():
    q = torch.arange(2 * 6 * 1).float().reshape(2, 6, 1)  # [T, Hq=6, d=1], Hkv = 2 → g = 3
    grouped = group_queries(q, 2)  # [T·g, Hkv, d]
    # query head h reads KV head h // 3: heads 0-2 → KV 0, heads 3-5 → KV 1
    assert set(grouped[:, 0, 0].tolist()) == {0, 1, 2, 6, 7, 8}
    assert torch.equal(ungroup(grouped, 6), q)


def _full_quadrature(base, kv, scaling):
    """Quadrature with p = n at every layer: ρ_ℓ = 1 (a module exactly as big as the KV cache)."""
    plan = plan_module("quadrature", base.num_layers, base.num_kv_heads, base.head_dim, kv.n, scaling,
                       rho=1.0, layer_multipliers=(1.0,))
    assert plan.quad_pairs == (kv.n,) * base.num_layers
    return build_module(plan, doc_keys=kv.keys, doc_values=kv.values), plan


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen3"])
def test_oracle_quadrature_with_p_equal_n_reproduces_exact_state_and_logits(fixture, request, document):
    base = request.getfixturevalue(fixture)
    layout = build_layout(base.tokenizer, document)
    kv = prefill_document(base, layout.context_ids)
    module, _ = _full_quadrature(base, kv, base.scaling)
    pair = layout.pair("Who bought the island?", "Captain Ilse Brandt.")
    ids = torch.tensor([pair.ids])
    q = torch.randn(1, base.num_q_heads, 5, base.head_dim)
    with torch.no_grad():
        got, want = ModuleDocState(module)(1, q, base.scaling), ExactDocState(kv)(1, q, base.scaling)
        assert close_reordered(got.out, want.out) and close_reordered(got.lse, want.lse)
        logits = query_logits(base, ModuleDocState(module), ids, layout.n)[0]
        full = base.model(torch.tensor([list(layout.context_ids) + pair.ids])).logits[0, layout.n:]
        none = query_logits(base, None, ids, layout.n)[0]
    assert close_reordered(logits, full, FORWARD), (logits - full).abs().max()
    assert (none - full).abs().max() > 1e-3  # the document matters, so the check is not vacuous


def test_module_provider_is_differentiable_through_the_base_model(tiny_llama, document):
    layout = build_layout(tiny_llama.tokenizer, document)
    module = build_module(plan_module("mlp", 2, 2, 16, layout.n, tiny_llama.scaling, 0.5, depths=(0, 2, 2)))
    ids = torch.tensor([layout.pair("Who?", "Brandt.").ids])
    logits = query_logits(tiny_llama, ModuleDocState(module), ids, layout.n)
    logits.logsumexp(-1).sum().backward()
    grads = [p.grad for p in module.parameters()]
    assert all(g is not None for g in grads) and any(g.abs().sum() > 0 for g in grads)
    assert all(p.grad is None for p in tiny_llama.model.parameters())  # base model stays frozen


def test_provider_rejects_a_module_for_another_scaling(tiny_llama):
    module = build_module(_mlp_plan(num_kv_heads=2, head_dim=16))
    with pytest.raises(ValueError, match="scaling"):
        ModuleDocState(module)(0, torch.randn(1, 4, 3, 16), 0.5)


def test_save_load_roundtrip_and_mismatch_errors(tiny_llama, tmp_path):
    plan = plan_module("mlp", 2, 2, 16, 300, tiny_llama.scaling, 0.5, depths=(1, 2, 2))
    module = build_module(plan, seed=3)
    module.set_normalization({"A_std": torch.rand(2, 2) + 1})
    spec = make_spec(module, plan, tiny_llama.name, tiny_llama.weights_hash, "d" * 64, tiny_llama.num_q_heads)
    assert spec.n_params == module.n_params()
    assert spec.kv_cache_bytes == 2 * 300 * 16 * 2 * 2 * 4
    assert spec.module_bytes >= 4 * spec.n_params
    save_module(module, spec, str(tmp_path))
    back, spec2 = load_module(str(tmp_path), tiny_llama, expect_doc_sha="d" * 64)
    q = torch.randn(4, 2, 16)
    assert all(torch.equal(x, y) for x, y in zip(module.predict(1, q), back.predict(1, q)))
    assert spec2 == spec
    from nectar.modules import ModulePlan

    assert ModulePlan.from_dict(spec2.module_config) == plan
    with pytest.raises(ModuleMismatch, match="document sha256"):
        load_module(str(tmp_path), tiny_llama, expect_doc_sha="e" * 64)
    other = spec.model_copy(update={"base_model_hash": "0" * 16})
    from nectar.tables import write_json_artifact

    write_json_artifact(str(tmp_path / "module.json"), other)
    with pytest.raises(ModuleMismatch, match="weights hash"):
        load_module(str(tmp_path), tiny_llama)
