"""The state methods' interface: one file per method, listed by the registry; a new method written
against the interface alone plans, fits and sizes like the registered ones."""
import dataclasses

import pytest


from nectar.states import FROM_TARGETS, METHODS, StateMethod, FitInputs, fit_method, get_method  # noqa: E402
from nectar.states.evict import Evict  # noqa: E402
from nectar.modules import plan_module  # noqa: E402
from nectar.modules.stored import stored_nbytes  # noqa: E402


def _plan(base, n, rho):
    return plan_module("mlp", base.num_layers, base.num_kv_heads, base.head_dim, n, base.scaling, rho,
                       depths=(0, 2, 2))


def test_each_method_is_a_state_method_in_a_file_of_its_own():
    modules = [type(b).__module__ for b in METHODS.values()]
    assert len(set(modules)) == len(modules), modules
    for name, b in METHODS.items():
        assert isinstance(b, StateMethod) and b.name == name
        assert type(b).__module__.startswith("nectar.states.")
    assert set(FROM_TARGETS) == {"truncate", "evict", "attention_matching", "attention_matching_kv"}
    assert METHODS["recon_fit"].reads_document


def test_unknown_and_document_reading_names_are_refused_in_one_line(tiny_targets):
    base, layout, kv, url = tiny_targets
    plan = _plan(base, layout.n, 0.2)
    with pytest.raises(ValueError, match="unknown state method 'lru'; choose one of truncate, evict"):
        get_method("lru")
    with pytest.raises(ValueError, match="reads the document with the model"):
        fit_method("recon_fit", kv, url, plan)
    with pytest.raises(ValueError, match="pass base, layout, document"):
        METHODS["recon_fit"].fit(plan, FitInputs(kv, url))


class _HalfEvict(Evict):
    """A method written against the interface only: evict with half the pairs in every layer."""

    name = "half_evict"

    def plan(self, plan, bits=None):
        full = super().plan(plan, bits)
        return dataclasses.replace(full, quad_pairs=tuple(max(1, p // 2) for p in full.quad_pairs))


def test_a_new_method_plans_fits_and_sizes_through_the_interface(tiny_targets):
    base, layout, kv, url = tiny_targets
    plan = _plan(base, layout.n, 0.3)
    half = _HalfEvict().fit(plan, FitInputs(kv, url))
    full = fit_method("evict", kv, url, plan)
    assert half.plan.quad_pairs == tuple(max(1, p // 2) for p in full.plan.quad_pairs)
    assert half.nbytes == stored_nbytes(half.module, half.plan) < full.nbytes
    # the kept keys are the top half of the same ranking: each head's keys are a subset of evict's
    for layer in range(base.num_layers):
        small, large = half.module.layers[layer], full.module.layers[layer]
        for h in range(base.num_kv_heads):
            assert {tuple(k.tolist()) for k in small.W[h]} <= {tuple(k.tolist()) for k in large.W[h]}
