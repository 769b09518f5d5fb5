"""Merging (select.fit_by "merge"): evicted keys merged into kept ones keep the fit queries' total attention mass
and mass-weighted value; on the tiny model recon_fit merging holds least squares' keys in its bytes; "auto"
chooses head by head unless keys are scarce (tests/states/test_fit_by_choose.py)."""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent.parent / "training"))
from targets_fixture import DOC  # noqa: E402

from nectar.modules import plan_module  # noqa: E402
from nectar.modules.provider import grouped_targets  # noqa: E402
from nectar.schemas.config import SelectionConfig  # noqa: E402
from nectar.states import get_method  # noqa: E402
from nectar.states.interface import FitInputs  # noqa: E402
from nectar.states.recon_fit import select_recon  # noqa: E402
from nectar.states.merging import merge_head, nearest_kept  # noqa: E402

FIRST = {"fit_queries": "recon", "score_queries": "recon"}


def _head(n=40, d=8, N=30, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, keys, values = (torch.randn(x, d, generator=g) for x in (N, n, n))
    alpha = torch.logsumexp(q @ keys.T * 0.5, dim=1)  # [N] each query's log-sum-exp over the document
    return q, alpha, keys, values


def _mass(q, alpha, keys, beta=None):  # [N, c] exp(s·q·k − α + β)
    logits = q.double() @ keys.double().T * 0.5 - alpha.double().unsqueeze(1)
    return (logits + (0 if beta is None else beta.double())).exp()


def test_merging_keeps_the_total_mass_and_the_mass_weighted_value():
    q, alpha, keys, values = _head()
    kept = torch.tensor([0, 3, 7, 12, 30])
    stored = keys[kept] + 0.01  # the kept keys as stored (a rounding): β makes up for it as well
    beta, Z = merge_head(q, alpha, keys, values, kept, stored, 0.5)
    state = _mass(q, alpha, stored, beta)  # [N, c]
    document = _mass(q, alpha, keys)  # [N, n]
    torch.testing.assert_close(state.sum(), document.sum(), rtol=1e-5, atol=0)  # = N: rows of the document sum to 1
    torch.testing.assert_close(state.sum(0) @ Z.double(), document.sum(0) @ values.double(), rtol=1e-5, atol=1e-6)
    owner = nearest_kept(keys, kept)
    for i, k in enumerate(kept):  # each kept key carries exactly the mass of the keys merged into it
        torch.testing.assert_close(state[:, i].sum(), document[:, owner == i].sum(), rtol=1e-5, atol=0)


def test_a_key_merges_into_its_most_similar_kept_key():
    keys = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.9, 0.1], [0.1, 2.0]])
    assert nearest_kept(keys, torch.tensor([0, 1])).tolist() == [0, 1, 0, 1]


def test_nothing_evicted_is_the_exact_kv():
    q, alpha, keys, values = _head(n=6)
    kept = torch.arange(6)
    beta, Z = merge_head(q, alpha, keys, values, kept, keys[kept], 0.5)
    torch.testing.assert_close(beta, torch.zeros(6), atol=1e-5, rtol=0)
    torch.testing.assert_close(Z, values, atol=1e-5, rtol=1e-5)


def test_the_method_merges_recon_fits_keys_in_its_bytes(tiny):
    """Through the registry on the tiny model (float32: no rounding): recon_fit's keys and bytes, the document's
    total mass on the fit queries held head by head, masked slots masked."""
    base, layout, kv, spans = tiny
    plan = plan_module("quadrature", base.num_layers, base.num_kv_heads, base.head_dim, layout.n, base.scaling, 0.05)
    inputs = FitInputs(kv, None, base=base, layout=layout, document=DOC, spans=spans, bits=32)
    merged = get_method("recon_fit").with_options(**FIRST, fit_by="merge").fit(plan, inputs)
    fitted = get_method("recon_fit").with_options(**FIRST).fit(plan, inputs)
    assert merged.nbytes == fitted.nbytes
    assert any(not torch.equal(a.Z, b.Z) for a, b in zip(merged.module.layers, fitted.module.layers))
    assert merged.plan.quad_head_pairs == fitted.plan.quad_head_pairs
    s = select_recon(base, layout, DOC, kv, None, plan, SelectionConfig(fit=True, **FIRST), list(spans))
    for layer, (net, heads) in enumerate(zip(merged.module.layers, s.kept)):
        q, alpha, _ = grouped_targets(s.queries, layer, base.num_kv_heads)
        for h, idx in enumerate(heads):
            c = idx.numel()
            assert torch.isinf(net.beta[h, c:]).all() and torch.isfinite(net.beta[h, :c]).all()
            state = _scaled_mass(q[:, h], alpha[:, h], net.W[h, :c], net.beta[h, :c], base.scaling)
            document = _scaled_mass(q[:, h], alpha[:, h], kv.keys[layer][h].float(), None, base.scaling)
            torch.testing.assert_close(state, document, rtol=1e-4, atol=0)


def _scaled_mass(q, alpha, keys, beta, scaling):
    logits = q.double() @ keys.double().T * scaling - alpha.double().unsqueeze(1)
    return (logits + (0 if beta is None else beta.double())).exp().sum()


def test_merging_needs_the_fit_queries():
    with pytest.raises(ValueError, match="set select.fit=true or fit_by=least_squares"):
        SelectionConfig(fit=False, fit_by="merge")


def test_the_fits_ridge_pulls_toward_its_prior_where_no_query_decides():
    """select.fit_prior: a key no fit query reaches is set by the ridge alone — to the prior's weight and value
    (the merge's), where the plain fit leaves β = 0 and the kept value."""
    from nectar.states.matching_fit import fit_log_mass, fit_values

    g = torch.Generator().manual_seed(1)
    mass = torch.rand(50, 4, generator=g) * 0.3
    mass[:, 2] = 0.0  # no query attends key 2
    prior_w = torch.tensor([1.0, 2.0, 5.0, 0.5], dtype=torch.float64)
    plain, pulled = fit_log_mass(mass), fit_log_mass(mass, prior=prior_w)
    assert plain[2].item() == pytest.approx(0.0, abs=1e-9)
    assert pulled[2].item() == pytest.approx(float(torch.log(prior_w[2])), abs=1e-6)
    prior_values = torch.randn(4, 8, generator=g)
    Z = fit_values(mass, pulled, torch.randn(50, 8, generator=g), prior_values)
    torch.testing.assert_close(Z[2].float(), prior_values[2], rtol=1e-5, atol=1e-5)
