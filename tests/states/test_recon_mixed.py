"""recon_mixed: bits allocated by rate and distortion across (layer, KV head) — the allocation spends the
byte budget exactly (never over, within one pair of it), follows the distortion it is given, and the
fitted state (one module per precision) is exact attention over its parts' stored pairs."""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent.parent / "training"))
from targets_fixture import DOC, make_targets  # noqa: E402

from nectar.modules import plan_module  # noqa: E402
from nectar.modules.budget import ragged_pair_bytes  # noqa: E402
from nectar.modules.provider import group_queries  # noqa: E402
from nectar.modules.stored import stored_nbytes  # noqa: E402
from nectar.queries.recon import make_recon  # noqa: E402
from nectar.schemas.config import ProbesConfig, ReconConfig  # noqa: E402
from nectar.states import METHODS, FitInputs  # noqa: E402
from nectar.states.recon_mixed import MixedState, ReconMixed, allocate_bits, rank_order, rounding_errors  # noqa: E402
from nectar.states.reconstruction import anchor_mask  # noqa: E402

CHOICES = (2, 4, 8)
D = 64
PAIR = tuple(ragged_pair_bytes(D, True, b) for b in CHOICES)  # (42, 74, 138) bytes a pair as stored


def _synthetic(L=3, H=2, n=200, seed=0):
    """Attention-like scores (a few heavy keys per head) and errors falling with the bits."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(L, H, n, generator=g) ** 8  # [L, H, n]
    base = torch.rand(L, H, n, generator=g)
    errors = torch.stack([base.clamp(max=1), base / 4, base / 64])  # [B, L, H, n]: int2 > int4 > int8
    return scores, errors


def _bytes(alloc) -> int:
    """Σ counts · one pair's bytes at each head's precision, counted independently of the allocation."""
    per = {b: p for b, p in zip(CHOICES, PAIR)}
    return sum(int(c) * per[int(b)] for c, b in zip(alloc.counts.flatten(), alloc.bits.flatten()))


@pytest.mark.parametrize("share", [0.01, 0.02, 0.1, 0.35])
def test_allocation_respects_the_byte_budget_exactly(share):
    scores, errors = _synthetic()
    L, H, n = scores.shape
    forced = anchor_mask(n, 4)
    budget = int(share * L * H * n * PAIR[-1])
    alloc = allocate_bits(scores, errors, CHOICES, PAIR, budget, forced)
    assert alloc.nbytes == _bytes(alloc)
    assert alloc.nbytes <= budget  # never over
    assert budget - alloc.nbytes < max(PAIR)  # within one pair's bytes: not even one more int2 pair fit
    assert budget - alloc.nbytes < min(PAIR[CHOICES.index(int(b))] for b in alloc.bits.flatten())
    _, c_min = rank_order(scores, forced)
    assert (alloc.counts.flatten() >= c_min).all() and set(alloc.bits.unique().tolist()) <= set(CHOICES)
    # a head keeps its first c ranked keys: the anchors, then its best-scored ones
    for layer, heads in enumerate(alloc.kept()):
        for h, idx in enumerate(heads):
            rest = scores[layer, h, 4:]
            top = (rest.argsort(descending=True)[:len(idx) - 4] + 4).tolist()
            assert set(idx.tolist()) == set(range(4)) | set(top)


def test_allocation_refuses_a_budget_below_the_anchors():
    scores, errors = _synthetic()
    with pytest.raises(ValueError, match="anchors every head keeps need"):
        allocate_bits(scores, errors, CHOICES, PAIR, 100, anchor_mask(scores.shape[-1], 4))


def test_allocation_follows_the_distortion():
    scores, errors = _synthetic()
    L, H, n = scores.shape
    budget = int(0.05 * L * H * n * PAIR[-1])
    forced = anchor_mask(n, 4)
    lossless = torch.zeros_like(errors)  # rounding costs nothing: the cheapest precision buys the most keys
    assert (allocate_bits(scores, lossless, CHOICES, PAIR, budget, forced).bits == 2).all()
    useless = errors.clone()
    useless[:2] = 1.0  # int2 and int4 keep nothing of a key: only int8 pairs remove distortion
    alloc = allocate_bits(scores, useless, CHOICES, PAIR, budget, forced)
    at8 = alloc.bits == 8  # the bytes go to int8 heads; the rest keep their anchors at the cheapest (plus
    assert at8.any() and (alloc.bits[~at8] == 2).all()  # the last few pairs that fit, removing nothing)
    assert int((alloc.counts[at8] * PAIR[-1]).sum()) > 0.8 * budget
    # the mixed allocation removes at least the distortion of any one precision at the same bytes
    mixed = allocate_bits(scores, errors, CHOICES, PAIR, budget, forced)

    def removed(alloc, errs):
        total = 0.0
        for layer, heads in enumerate(alloc.kept()):
            for h, idx in enumerate(heads):
                b = CHOICES.index(int(alloc.bits[layer, h]))
                total += float((scores[layer, h, idx] * (1 - errs[b, layer, h, idx])).sum())
        return total

    for i, b in enumerate(CHOICES):
        one = allocate_bits(scores, errors[i:i + 1], (b,), (PAIR[i],), budget, forced)
        assert removed(mixed, errors) >= removed(one, errors[i:i + 1].expand_as(errors)) - 1e-9


# ----- fitted on the tiny model -----

RECON = ReconConfig(span_words=12, withheld_fraction=0.0)
PROBES = ProbesConfig(block_units=1)


@pytest.fixture(scope="module")
def fitted(tiny_llama, tmp_path_factory):
    base = tiny_llama
    layout, kv, _ = make_targets(base, DOC, tmp_path_factory.mktemp("targets"))
    spans = tuple((s.instruction, s.response) for s in make_recon(DOC, RECON, PROBES))
    plan = plan_module("quadrature", base.num_layers, base.num_kv_heads, base.head_dim, layout.n, base.scaling, 0.1)
    inputs = FitInputs(kv, None, base=base, layout=layout, document=DOC, spans=spans)
    return base, plan, METHODS["recon_mixed"].fit(plan, inputs)


def test_rounding_errors_fall_with_the_bits_and_a_fitted_beta_absorbs_the_mean_shift(tiny_llama, tmp_path):
    base = tiny_llama
    _, kv, _ = make_targets(base, DOC, tmp_path)
    g = torch.Generator().manual_seed(0)
    q = 3.0 + torch.randn(40, base.num_layers, base.num_q_heads, base.head_dim, generator=g)  # a common mean
    err = rounding_errors(kv, q, base.scaling, (2, 4, 8, 32))  # [B, L, H, n]
    assert err.shape == (4, base.num_layers, base.num_kv_heads, kv.keys[0].shape[1])
    assert ((err >= 0) & (err <= 1)).all() and (err[3] == 0).all()  # float32: nothing lost
    assert (err[0] >= err[1]).float().mean() > 0.95 and (err[1] >= err[2]).float().mean() > 0.95
    raw = rounding_errors(kv, q, base.scaling, (4,), centred=False)
    assert (err[1] <= raw[0] + 1e-6).all() and (err[1] < raw[0]).any()  # covariance ≤ second moment


def test_registered_and_reads_the_document_alone():
    m = METHODS["recon_mixed"]
    assert isinstance(m, ReconMixed) and m.reads == {"doc_kv", "document"}
    assert m.with_options(fit_queries="recon+train").reads_train_queries
    with pytest.raises(ValueError, match="each must be one of"):
        ReconMixed(choices=(3,))


def test_fitted_state_is_in_the_budget_and_its_bytes_are_its_parts_stored_bytes(fitted):
    base, plan, state = fitted
    assert isinstance(state, MixedState)
    budget = 4 * plan.num_kv_heads * sum(plan.budgets)  # recon_fit's total: the plan's bytes
    per = {b: ragged_pair_bytes(base.head_dim, True, b) for b in CHOICES}
    counts = state.plan.quad_head_pairs
    expect = sum(c * per[b] for crow, brow in zip(counts, state.head_bits) for c, b in zip(crow, brow))
    assert state.nbytes == expect == sum(stored_nbytes(p.module) for p in state.parts)
    assert state.nbytes <= budget and budget - state.nbytes < max(per.values())
    # each part holds exactly the heads at its precision
    for part in state.parts:
        bits = part.plan.bits
        for crow, prow, brow in zip(counts, part.plan.quad_head_pairs, state.head_bits):
            assert [c if b == bits else 0 for c, b in zip(crow, brow)] == list(prow)


def test_merged_parts_are_exact_attention_over_every_stored_pair(fitted):
    base, plan, state = fitted
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, base.num_q_heads, 5, base.head_dim, generator=g)  # [b, hq, m, d]
    for layer in range(base.num_layers):
        got = state(layer, q, base.scaling)
        W, Z, beta = [], [], []  # each KV head's real pairs, gathered from the part holding them
        for h in range(base.num_kv_heads):
            bits = state.head_bits[layer][h]
            part = next(p for p in state.parts if p.plan.bits == bits)
            c = part.plan.quad_head_pairs[layer][h]
            net = part.module.layers[layer]
            W.append(net.W[h, :c])
            Z.append(net.Z[h, :c])
            beta.append(net.beta[h, :c])
        qg = group_queries(q[0].transpose(0, 1), base.num_kv_heads)  # [m·g, Hkv, d]
        for h in range(base.num_kv_heads):
            logits = base.scaling * qg[:, h] @ W[h].T + beta[h]  # [m·g, c]
            lse = torch.logsumexp(logits, -1)
            out = torch.softmax(logits, -1) @ Z[h]
            g_ = base.num_q_heads // base.num_kv_heads
            ref_lse = lse.reshape(5, g_).T  # query heads h·g … h·g+g−1
            ref_out = out.reshape(5, g_, -1).transpose(0, 1)
            assert torch.allclose(got.lse[0, h * g_:(h + 1) * g_], ref_lse, atol=1e-5)
            assert torch.allclose(got.out[0, h * g_:(h + 1) * g_], ref_out, atol=1e-5)
    assert torch.isfinite(got.out).all()
