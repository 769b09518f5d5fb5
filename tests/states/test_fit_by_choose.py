"""select.fit_by "choose": each (layer, KV head) takes least squares or the merge, whichever does better on a fifth
of the fit queries held out of both (reconstruction.py _HeadFit.choose) — and the winner is made from every query,
so the chosen state equals, head by head, the least-squares state or the merged one."""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent.parent / "training"))
from targets_fixture import DOC  # noqa: E402

from nectar.modules import plan_module  # noqa: E402
from nectar.schemas.config import SelectionConfig  # noqa: E402
from nectar.states import get_method  # noqa: E402
from nectar.states.interface import FitInputs  # noqa: E402
from nectar.states.reconstruction import HELD_OUT_BLOCK, HELD_OUT_EVERY, _HeadFit, held_out_rows  # noqa: E402

FIRST = {"fit_queries": "recon", "score_queries": "recon"}
SCALING = 0.5


def _head(n=60, c=12, d=8, N=1200, seed=0, shift=0.0) -> _HeadFit:
    """A synthetic head: N queries over an n-key document, the first c keys kept (float: nothing rounded); each
    block of HELD_OUT_BLOCK queries about its own centre (``shift`` its spread), as a text's regions differ."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(-(-N // HELD_OUT_BLOCK), d, generator=g) * shift  # [blocks, d]
    q = torch.randn(N, d, generator=g) + centres.repeat_interleave(HELD_OUT_BLOCK, 0)[:N]  # [N, d]
    keys, values = torch.randn(n, d, generator=g), torch.randn(n, d, generator=g)
    logits = q @ keys.T * SCALING  # [N, n]
    alpha = torch.logsumexp(logits, dim=1)  # [N]
    A = torch.softmax(logits, dim=1) @ values  # [N, d] the document's output
    kept = torch.arange(c)
    return _HeadFit(0, 0, q, alpha, A, keys[kept], values[kept], (keys, values, kept))


def _same(x, y):
    return torch.equal(x[0], y[0]) and torch.equal(x[1], y[1])


def test_auto_by_the_share_kept():
    from nectar.states.greedy_keys import GREEDY_SHARE
    from nectar.states.recon_fit import CHOOSE_SHARE, auto_fit_by

    assert [auto_fit_by(x) for x in (0.0, GREEDY_SHARE, 0.06, CHOOSE_SHARE, 0.26, 1.0)] == [
        "least_squares", "least_squares", "choose", "choose", "merge", "merge"]


def test_held_out_rows_are_every_fifth_block():
    held = held_out_rows(HELD_OUT_BLOCK * HELD_OUT_EVERY * 3 + 7)
    assert held.sum() == 3 * HELD_OUT_BLOCK  # a fifth, in whole blocks
    blocks = held.reshape(-1)[: HELD_OUT_BLOCK * HELD_OUT_EVERY * 3].reshape(-1, HELD_OUT_BLOCK)
    assert (blocks.all(1) | ~blocks.any(1)).all()  # each block wholly held out or wholly seen
    assert not held_out_rows(HELD_OUT_BLOCK * (HELD_OUT_EVERY - 1)).any()


def test_the_held_out_error_is_zero_for_the_exact_state_and_counts_a_wrong_mass():
    t = _head(c=60)  # every key kept
    assert t.held_out_error(SCALING, torch.zeros(60), t.values) < 1e-10
    assert t.held_out_error(SCALING, torch.full((60,), 0.1), t.values) > 1e-3  # right output, 10 % too much mass
    assert t.held_out_error(SCALING, torch.zeros(60), t.values + 0.1) > 1e-3


# (n, c, N, shift, which wins): few keys for many queries, least squares; many keys for few queries from regions
# unlike the held-out ones, the merge (measured once: the cases pin that both branches run)
@pytest.mark.parametrize("n, c, N, shift, merges", [(100, 8, 960, 0.0, False), (200, 100, 480, 2.0, True)])
def test_choose_takes_what_does_better_on_the_held_out_queries_made_from_every_query(n, c, N, shift, merges):
    t = _head(n=n, c=c, N=N, shift=shift)
    held = held_out_rows(t.q.shape[0])
    seen, unseen = t.rows(~held), t.rows(held)
    errors = [unseen.held_out_error(SCALING, b, Z)
              for b, Z, *_ in (seen.fit(SCALING, lambda b: b), seen.merge(SCALING))]
    beta, Z, _, _, merged = t.choose(SCALING, lambda b: b, lambda Z: Z)
    assert merged == (errors[1] <= errors[0]) == merges
    assert _same((beta, Z), (t.merge(SCALING) if merged else t.fit(SCALING, lambda b: b))[:2])


def test_too_few_queries_to_hold_out_is_least_squares():
    t = _head(N=HELD_OUT_BLOCK * 2)
    beta, Z, _, _, merged = t.choose(SCALING, lambda b: b, lambda Z: Z)
    assert not merged and _same((beta, Z), t.fit(SCALING, lambda b: b))


@pytest.mark.parametrize("bits", [32, 4])
def test_the_chosen_state_is_head_by_head_least_squares_or_the_merge(tiny, bits):
    """Through the registry on the tiny model: the same keys and bytes as either, each head's β and values those
    of the least-squares state or of the merged one, and fit_merged_share the share of heads merged."""
    import dataclasses

    from nectar.states.recon_fit import fit_recon

    base, layout, kv, spans = tiny
    plan = plan_module("quadrature", base.num_layers, base.num_kv_heads, base.head_dim, layout.n, base.scaling, 0.1)
    inputs = FitInputs(kv, None, base=base, layout=layout, document=DOC, spans=spans, bits=bits)
    lsq, merged = (get_method("recon_fit").with_options(**FIRST, fit_by=f).fit(plan, inputs)
                   for f in ("least_squares", "merge"))
    chosen = get_method("recon_fit").with_options(**FIRST, fit_by="choose").fit(plan, inputs)
    assert chosen.nbytes == lsq.nbytes == merged.nbytes
    assert chosen.plan.quad_head_pairs == lsq.plan.quad_head_pairs
    picks = []
    for a, b, m in zip(chosen.module.layers, lsq.module.layers, merged.module.layers):
        assert torch.equal(a.W, b.W)
        for h in range(a.Z.shape[0]):
            like_lsq = torch.equal(a.Z[h], b.Z[h]) and torch.equal(a.beta[h], b.beta[h])
            like_merge = torch.equal(a.Z[h], m.Z[h]) and torch.equal(a.beta[h], m.beta[h])
            assert like_lsq or like_merge, h
            picks.append(like_merge and not like_lsq)
    timings = {}
    select = SelectionConfig(fit=True, **FIRST, fit_by="choose")
    fit_recon(base, layout, DOC, kv, None, dataclasses.replace(plan, bits=bits), select, list(spans), timings=timings)
    assert timings["fit_merged_share"] == pytest.approx(sum(picks) / len(picks))


def test_auto_is_least_squares_where_keys_are_scarce_chosen_above_and_merged_where_plentiful(tiny):
    """fit_by "auto" = least squares where the state keeps at most GREEDY_SHARE of the entries, "choose" up to
    CHOOSE_SHARE, the merge above."""
    from nectar.states.recon_fit import auto_fit_by

    base, layout, kv, spans = tiny
    inputs = FitInputs(kv, None, base=base, layout=layout, document=DOC, spans=spans, bits=32)
    for rho, like in ((0.04, "least_squares"), (0.15, "choose"), (0.5, "merge")):
        plan = plan_module("quadrature", base.num_layers, base.num_kv_heads, base.head_dim, layout.n, base.scaling, rho)
        auto, same = (get_method("recon_fit").with_options(**FIRST, fit_by=f).fit(plan, inputs) for f in ("auto", like))
        share = sum(map(sum, auto.plan.quad_head_pairs)) / (layout.n * base.num_kv_heads * base.num_layers)
        assert auto_fit_by(share) == like, share
        for a, b in zip(auto.module.layers, same.module.layers):
            assert torch.equal(a.Z, b.Z) and torch.equal(a.beta, b.beta)
