"""The plain-KV state vLLM serves: RoPE shift identity (plain and YaRN), which states qualify, the
β-free refit's plan, the chat template's tokens, and refusing a state of another base model."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from nectar.base_model import _tiny
from nectar.states import FROM_TARGETS, method_plan
from nectar.modules.builder import build_module, plan_from_config
from nectar.comparison.systems import SYSTEMS
from nectar.schemas import load_config
from nectar.schemas.config import ModuleConfig
from nectar.serving.engines.vllm_export import refit_system, system_bits
from nectar.vllm.state import (NotPlainKV, check_state, plain_kv_pairs, rope_inv_freq, shift_keys, state_triples,
                               write_state)


def _rotated(model, x: torch.Tensor, positions: list[int]) -> torch.Tensor:
    """x [1, h, T, d] rotated at ``positions`` by the model's own rotary embedding (attention factor included)."""
    pos = torch.tensor([positions])
    cos, sin = model.model.rotary_emb(x, pos)
    out, _ = apply_rotary_pos_emb(x, x, cos, sin)
    return out


@pytest.mark.parametrize("rope", [None, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}])
def test_shifted_keys_give_the_same_scores_at_the_new_positions(rope):
    model, _ = _tiny("llama", rope)
    inv = next(mod.inv_freq for mod in model.modules() if hasattr(mod, "inv_freq")).float()
    g = torch.Generator().manual_seed(0)
    n, m, d = 3000, 150, 16
    q, k = torch.randn(1, 1, 4, d, generator=g), torch.randn(1, 1, 5, d, generator=g)
    doc_pos = [0, 7, 1000, 2500, n - 1]
    keys = _rotated(model, k, doc_pos)  # as captured at document positions j
    q_doc = _rotated(model, q, [n + t for t in range(4)])  # torch engine: queries at n + t
    q_vllm = _rotated(model, q, [m + t for t in range(4)])  # vLLM: queries at m + t
    want = q_doc @ keys.transpose(-1, -2)  # [1, 1, 4, 5]
    got = q_vllm @ shift_keys(keys, inv, -(n - m)).transpose(-1, -2)
    assert torch.allclose(got, want, atol=1e-4 * float(want.abs().max()), rtol=0)


def _plan():
    return plan_from_config(ModuleConfig(arch="quadrature", rho=0.1, bias=True), num_layers=4, num_kv_heads=2,
                            head_dim=16, n_context=400, scaling=0.25)


def test_attention_matching_kv_is_uniform_bias_free_and_within_the_budget():
    assert "attention_matching_kv" in FROM_TARGETS
    plan = _plan()
    kv = method_plan("attention_matching_kv", plan)
    assert len(set(kv.quad_pairs)) == 1 and not kv.quad_bias
    stored = sum(2 * p * plan.head_dim for p in kv.quad_pairs)
    assert 0.9 * sum(plan.budgets) <= stored <= sum(plan.budgets)
    keys, values = plain_kv_pairs(build_module(kv))
    assert keys[0].shape == (plan.num_kv_heads, kv.quad_pairs[0], plan.head_dim)


def test_the_cpu_default_module_is_not_plain_kv_and_its_refit_is():
    """The ``cpu`` preset's module (recon_fit_qa@int4: per-layer budgets, β, int4 codes) cannot be
    cached as tokens; ``--engine vllm`` serves its β-free refit at the same budget and bits, which can."""
    cfg = load_config("cpu").train.module
    plan = plan_from_config(cfg, num_layers=4, num_kv_heads=2, head_dim=64, n_context=1528, scaling=0.125)
    assert len(set(plan.quad_pairs)) > 1 and plan.bits == 4  # nonuniform, int4
    trained = build_module(plan)
    with torch.no_grad():
        trained.layers[0].beta.fill_(0.25)
    with pytest.raises(NotPlainKV):
        plain_kv_pairs(trained)
    system = refit_system(plan.bits)
    assert system == "attention_matching_kv@int4" and system in SYSTEMS  # a `nectar compare` row of its own
    name, bits = system_bits(system)
    assert (name, bits) == ("attention_matching_kv", SYSTEMS[system].bits)
    refit = method_plan(name, plan, bits)
    assert len(set(refit.quad_pairs)) == 1 and not refit.quad_bias and refit.bits == 4
    keys, values = plain_kv_pairs(build_module(refit))  # dequantized from the int4 codes
    assert keys[0].shape == values[0].shape == (2, refit.quad_pairs[0], 64)
    assert keys[0].dtype == torch.float32 and bool(torch.isfinite(keys[0]).all())
    # int4 buys more pairs in the same bytes than the float32 refit that compare's plain name means
    assert refit.quad_pairs[0] > method_plan("attention_matching_kv", plan, 32).quad_pairs[0]
    with pytest.raises(NotPlainKV, match="@int8 or @int4"):
        system_bits("attention_matching_kv@intx")


def test_states_that_are_not_plain_kv_are_refused():
    plan = _plan()
    evict = build_module(method_plan("evict", plan))  # per-layer counts follow the layer multipliers
    with pytest.raises(NotPlainKV, match="different layers"):
        plain_kv_pairs(evict)
    uniform = dataclasses.replace(method_plan("truncate", plan), quad_bias=True)
    biased = build_module(uniform)
    with torch.no_grad():
        biased.layers[1].beta.fill_(0.5)
    with pytest.raises(NotPlainKV, match="β"):
        plain_kv_pairs(biased)
    with pytest.raises(NotPlainKV, match="not a quadrature"):
        plain_kv_pairs(build_module(plan_from_config(ModuleConfig(arch="mlp", rho=0.1), num_layers=4, num_kv_heads=2,
                                                     head_dim=16, n_context=4000, scaling=0.25)))


class _Base:
    def __init__(self, model, name, weights_hash):
        self.model, self.name, self.weights_hash = model, name, weights_hash


def test_a_state_of_another_base_model_is_refused(tmp_path):
    model, _ = _tiny("llama")
    base = _Base(model, "tiny:llama", "a" * 64)
    keys = [torch.randn(2, 8, 16) for _ in range(2)]
    path = str(tmp_path / "state.v1.safetensors")
    write_state(path, keys, keys, base, n=100, doc_sha256="d" * 64, source="truncate")
    assert check_state(path, "a" * 64, "d" * 64)["m"] == "8"
    with pytest.raises(NotPlainKV, match="base model 'tiny:llama'"):
        check_state(path, "b" * 64)
    with pytest.raises(NotPlainKV, match="another document"):
        check_state(path, "a" * 64, "e" * 64)
    assert torch.equal(rope_inv_freq(base), next(m.inv_freq for m in model.modules() if hasattr(m, "inv_freq")).float())


def test_the_default_module_exports_with_its_beta_and_ragged_heads_and_reads_back_as_itself(tiny_llama, tmp_path):
    """The ``cpu`` default (β, ragged per-head budgets, int4) → the v2 state file → the provider the vLLM
    equivalence check uses: the same attention as the module itself, at the document's positions."""
    from nectar.evaluation.vllm_equivalence import BiasedKVState, torch_provider
    from nectar.modules.provider import ModuleDocState

    base = tiny_llama
    cfg = load_config("cpu").train.module
    n = 600
    plan = plan_from_config(cfg, num_layers=base.num_layers, num_kv_heads=base.num_kv_heads, head_dim=base.head_dim,
                            n_context=n, scaling=base.scaling)
    module = build_module(plan)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for layer in module.layers:
            layer.W.normal_(generator=g)
            layer.Z.normal_(generator=g)
            layer.beta.copy_(torch.randn(layer.beta.shape, generator=g))
            layer.beta[0, -3:] = float("-inf")  # head 0 keeps 3 pairs fewer: ragged, as recon_fit's selection pads
    assert len({layer.W.shape[1] for layer in module.layers}) > 1  # per-layer budgets differ too
    keys, values, betas = state_triples(module)
    assert len({k.shape[1] for k in keys}) == 1  # one m for every layer
    path = str(tmp_path / "state.v2.safetensors")
    write_state(path, keys, values, base, n, "d" * 64, "trained", betas)
    provider, n_read = torch_provider(path, base)
    assert isinstance(provider, BiasedKVState) and n_read == n
    q = torch.randn(2, base.num_q_heads, 3, base.head_dim, generator=g)
    for layer in range(base.num_layers):
        got = provider(layer, q, base.scaling)
        want = ModuleDocState(module)(layer, q, base.scaling)
        torch.testing.assert_close(got.out, want.out, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got.lse, want.lse, rtol=1e-4, atol=1e-4)
    dropped, _ = torch_provider(path, base, drop_bias=True)
    assert (dropped(0, q, base.scaling).out - ModuleDocState(module)(0, q, base.scaling).out).abs().max() > 1e-2


def test_a_truncated_state_file_is_refused_in_one_line_naming_it(tmp_path):
    from nectar.vllm.format import read_state_meta

    path = tmp_path / "state.v2.safetensors"
    path.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{\"__metadata")
    with pytest.raises(ValueError, match=f"{path}: not a readable state file") as exc:
        read_state_meta(str(path))
    assert "\n" not in str(exc.value)
