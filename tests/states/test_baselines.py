"""Equal-bytes baselines on real targets of the tiny model: each stores the module's budget, keeping
every key is the exact document state (oracle), and the Attention Matching fit does what it claims."""

import pytest
import torch


from nectar.attention.exact import ExactDocState  # noqa: E402
from nectar.states import FROM_TARGETS, method_plan, fit_method, training_queries  # noqa: E402
from nectar.states.matching_fit import fit_log_mass  # noqa: E402
from nectar.states.selection import attention_probs  # noqa: E402
from nectar.modules import build_module, plan_module  # noqa: E402
from nectar.modules.stored import stored_nbytes, stored_tensors  # noqa: E402


def _plan(base, n, rho, arch="mlp", **kw):
    return plan_module(arch, base.num_layers, base.num_kv_heads, base.head_dim, n, base.scaling, rho,
                       depths=(0, 2, 2), **kw)


@pytest.mark.parametrize("name", FROM_TARGETS)
def test_each_baseline_stores_the_budget_of_the_module_it_is_compared_with(tiny_targets, name):
    base, layout, kv, url = tiny_targets
    plan = _plan(base, layout.n, rho=0.2)
    fitted = fit_method(name, kv, url, plan)
    d, H, L = base.head_dim, base.num_kv_heads, base.num_layers
    per_pair = 2 * d + (1 if name == "attention_matching" else 0)
    params = fitted.module.n_params()
    if name == "truncate":  # the first ⌊ρ·n⌋ tokens in every layer (the bytes of ρ of the KV)
        p = int(0.2 * layout.n)
        assert fitted.plan.quad_pairs == (p,) * L and params == L * H * 2 * d * p
    elif name == "attention_matching_kv":  # plain KV: one count in every layer, the plan's total bytes
        p = fitted.plan.quad_pairs[0]
        assert fitted.plan.quad_pairs == (p,) * L
        assert sum(plan.budgets) - L * per_pair < L * p * per_pair <= sum(plan.budgets)
    else:  # per (layer, head): at most the budget, less than one pair under it
        for layer, budget in enumerate(plan.budgets):
            assert budget - per_pair < fitted.plan.quad_pairs[layer] * per_pair <= budget
    budget_params = H * sum(plan.budgets)  # what the module may use (an MLP's widths round down)
    assert build_module(plan).n_params() <= budget_params
    assert abs(params - budget_params) <= L * H * per_pair
    # bytes are every stored tensor: the pairs (a closed-form state needs no normalisation buffers)
    assert fitted.nbytes == stored_nbytes(fitted.module) == sum(t.numel() * 4 for t in fitted.module.parameters())


@pytest.mark.parametrize("name", FROM_TARGETS)
def test_keeping_every_key_reproduces_the_exact_document_state(tiny_targets, name):
    base, layout, kv, url = tiny_targets
    n = layout.n
    data = training_queries(url)
    assert data.q.shape[0] * (base.num_q_heads // base.num_kv_heads) > n  # enough queries to pin n masses
    plan = _plan(base, n, rho=2.0, layer_multipliers=(1.0,))  # p clamps to n: every key kept
    fitted = fit_method(name, kv, url, plan)
    assert fitted.plan.quad_pairs == (n,) * base.num_layers
    exact = ExactDocState(kv, backend="torch")
    q = torch.randn(2, base.num_q_heads, 5, base.head_dim) * 3  # [b, hq, m, d]: fresh queries
    for layer in range(base.num_layers):
        got, want = fitted(layer, q, base.scaling), exact(layer, q, base.scaling)
        assert torch.allclose(got.lse, want.lse, atol=1e-3), (name, layer)
        assert torch.allclose(got.out, want.out, atol=1e-3), (name, layer)


def test_fitted_masses_match_the_captured_log_sum_exp_better_than_plain_eviction(tiny_targets):
    base, layout, kv, url = tiny_targets
    data = training_queries(url)
    q = data.q[:, 0, 0].float()  # layer 0, query head 0 (reads KV head 0)
    probs = attention_probs(q, data.alpha[:, 0, 0].float(), kv.keys[0][0].float(), base.scaling)
    mass = probs[:, : layout.n // 4]  # keep a quarter of the keys
    beta = fit_log_mass(mass)
    fitted_err = (mass.double() @ beta.exp() - 1).pow(2).sum()
    plain_err = (mass.sum(1) - 1).pow(2).sum()  # β = 0: the kept keys' mass alone
    assert fitted_err < plain_err  # NNLS optimum <= any feasible point, here strictly
    assert bool((beta.exp() >= 0).all())


def test_baseline_plan_rejects_unknown_names(tiny_targets):
    base, layout, *_ = tiny_targets
    with pytest.raises(ValueError, match="unknown state method 'lru'"):
        method_plan("lru", _plan(base, layout.n, rho=0.2))


def test_attention_matching_init_without_a_bias_is_refused(tiny_targets):
    from nectar.states import FitInputs, get_method

    base, layout, kv, url = tiny_targets
    plan = _plan(base, layout.n, rho=0.2, arch="quadrature")
    with pytest.raises(ValueError, match="bias=true"):
        get_method("attention_matching").init(plan, build_module(plan), FitInputs(kv, url))


@pytest.mark.parametrize("name", FROM_TARGETS)
@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_baseline_keeps_more_entries_in_the_same_bytes(tiny_targets, name, bits):
    """At int8/int4 the byte budget of ρ buys more kept entries; the bytes reported are those of the
    tensors it stores (codes, fp16 scales and zeros, β), and stay within the float32 budget."""
    base, layout, kv, url = tiny_targets
    plan = _plan(base, layout.n, rho=0.1)
    f32 = fit_method(name, kv, url, plan)
    q = fit_method(name, kv, url, plan, bits=bits)
    assert q.plan.bits == bits and f32.plan.bits == 32
    assert all(pq > pf for pq, pf in zip(q.plan.quad_pairs, f32.plan.quad_pairs))
    written = stored_tensors(q.module)
    assert q.nbytes == sum(t.numel() * t.element_size() for t in written.values())
    assert {t.dtype for k, t in written.items() if k.endswith(".codes")} == {torch.uint8}
    budget_bytes = 4 * base.num_kv_heads * (sum(plan.budgets) if name != "truncate"
                                            else base.num_layers * 0.1 * layout.n * 2 * base.head_dim)
    assert budget_bytes * 0.9 < q.nbytes <= budget_bytes
    assert budget_bytes * 0.9 < f32.nbytes <= budget_bytes
