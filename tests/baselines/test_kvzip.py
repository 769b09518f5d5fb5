"""KVzip-style selection on the tiny random model: reconstruction scores (max over spans, whole
softmax), one budget across layers and heads with exact bytes, anchors, masked slots, the fit."""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent.parent / "training"))
from targets_fixture import DOC, make_targets  # noqa: E402

from nectar.attention.exact import ExactDocState  # noqa: E402
from nectar.baselines import fit_kvzip  # noqa: E402
from nectar.baselines.kvzip import allocate, anchor_mask, recon_capture, template_mask  # noqa: E402
from nectar.modules import plan_module  # noqa: E402
from nectar.schemas.config import ProbesConfig, ReconConfig, SelectionConfig  # noqa: E402
from nectar.stages.recon import make_recon  # noqa: E402
from nectar.modules.stored import stored_nbytes
from float_tolerance import FORWARD, close_reordered

RECON = ReconConfig(span_words=12, withheld_fraction=0.0)
PROBES = ProbesConfig(block_units=1)


@pytest.fixture(scope="module")
def tiny(tiny_llama, tmp_path_factory):
    out = tmp_path_factory.mktemp("targets")
    layout, kv, _ = make_targets(tiny_llama, DOC, out)
    spans = [(s.instruction, s.response) for s in make_recon(DOC, RECON, PROBES)]
    return tiny_llama, layout, kv, str(out), spans


def _plan(base, n, rho):
    return plan_module("quadrature", base.num_layers, base.num_kv_heads, base.head_dim, n, base.scaling, rho)


def test_recon_spans_tile_the_document_verbatim_and_withheld_blocks_are_left_out():
    spans = make_recon(DOC, RECON, PROBES)
    assert spans[0].instruction.startswith("Repeat the document verbatim from its beginning")
    assert all(s.response in DOC for s in spans)
    # consecutive spans, no unit twice, every unit covered when nothing is withheld
    units = [u for s in spans for u in range(s.first_unit, s.last_unit + 1)]
    assert units == sorted(set(units)) and units[0] == 0
    withheld = make_recon(DOC, ReconConfig(span_words=12, withheld_fraction=0.3), PROBES)
    covered = {u for s in withheld for u in range(s.first_unit, s.last_unit + 1)}
    assert 0 < len(covered) < len(units)


def test_scores_are_max_over_queries_of_whole_softmax_probabilities(tiny):
    base, layout, kv, _, spans = tiny
    mx = recon_capture(base, layout, kv, spans, "max")
    mean = recon_capture(base, layout, kv, spans, "mean")
    L, H, n = mx.scores.shape
    assert (L, H, n) == (base.num_layers, base.num_kv_heads, layout.n)
    assert (mx.scores <= 1 + 1e-5).all() and (mx.scores >= 0).all()
    assert (mx.scores >= mean.scores - 1e-6).all()  # a max is at least a mean
    # the probabilities share the softmax with the queries' own tokens: over document keys they sum
    # to at most one per query, so for one query, its max over keys is at most its doc share
    assert mx.q.shape[:3] == (mx.alpha.shape[0], L, base.num_q_heads)
    # the captured document targets are the exact provider's on the same queries
    exact = ExactDocState(kv, backend="torch")
    q = mx.q[:5, 0].transpose(0, 1).unsqueeze(0)  # [1, Hq, 5, d]
    st = exact(0, q, base.scaling)
    assert close_reordered(st.lse[0].T, mx.alpha[:5, 0], FORWARD)  # captured in a packed forward


def test_global_budget_spends_the_plans_bytes_across_heads_unevenly(tiny):
    base, layout, kv, _, spans = tiny
    plan = _plan(base, layout.n, 0.2)
    cap = recon_capture(base, layout, kv, spans)
    d = base.head_dim
    for per_pair in (2 * d, 2 * d + 1):
        for mode in ("global", "layer", "head"):
            kept = allocate(cap.scores, plan, per_pair, mode, anchor_mask(layout.n, 4))
            counts = torch.tensor([[k.numel() for k in heads] for heads in kept])
            if mode == "global":
                assert counts.sum() == base.num_kv_heads * sum(plan.budgets) // per_pair
            if mode == "head":
                assert all((counts[i] == b // per_pair).all() for i, b in enumerate(plan.budgets))
            for heads in kept:
                for idx in heads:
                    assert set(range(4)) <= set(idx.tolist())  # sinks kept everywhere
                    assert (idx.diff() > 0).all()  # document order, no duplicates
    kept = allocate(cap.scores, plan, 2 * d, "global", anchor_mask(layout.n, 4))
    counts = torch.tensor([[k.numel() for k in heads] for heads in kept])
    assert counts.min() < counts.max()  # a random model's heads are not all alike


@pytest.mark.parametrize("fit", [False, True])
def test_fitted_state_counts_only_real_pairs_and_masked_slots_change_nothing(tiny, fit):
    base, layout, kv, url, spans = tiny
    plan = _plan(base, layout.n, 0.2)
    state = fit_kvzip(base, layout, DOC, kv, url, plan, SelectionConfig(fit=fit), spans)
    per_pair = 2 * base.head_dim + (1 if fit else 0)
    total = base.num_kv_heads * sum(plan.budgets) // per_pair
    assert sum(map(sum, state.plan.quad_head_pairs)) == total
    buffers = 0  # a closed-form state stores no normalisation buffers (nectar/modules/stored.py)
    assert state.nbytes == buffers + total * per_pair * 4 == stored_nbytes(state.module, state.plan)
    assert state.nbytes <= buffers + base.num_kv_heads * sum(plan.budgets) * 4  # within the budget
    q = torch.randn(1, base.num_q_heads, 3, base.head_dim) * 3
    for layer in range(base.num_layers):
        st = state(layer, q, base.scaling)
        assert torch.isfinite(st.lse).all() and torch.isfinite(st.out).all()
        if not fit:  # exact KV of the kept keys: the exact state over that subset
            net, g = state.module.layers[layer], base.num_q_heads // base.num_kv_heads
            for h, c in enumerate(state.plan.quad_head_pairs[layer]):
                W = net.W[h, :c]
                logits = torch.einsum("gmd,pd->gmp", q[0, h * g:(h + 1) * g], W) * base.scaling
                assert close_reordered(st.lse[0, h * g:(h + 1) * g], logits.logsumexp(-1))


def test_keeping_every_key_with_the_fit_reproduces_the_document_state(tiny):
    base, layout, kv, url, spans = tiny
    plan = plan_module("quadrature", base.num_layers, base.num_kv_heads, base.head_dim, layout.n, base.scaling,
                       1.0, layer_multipliers=(1.0,))
    state = fit_kvzip(base, layout, DOC, kv, url, plan, SelectionConfig(fit=False, budget="head"), spans)
    assert state.plan.quad_head_pairs == ((layout.n,) * base.num_kv_heads,) * base.num_layers
    exact = ExactDocState(kv, backend="torch")
    q = torch.randn(1, base.num_q_heads, 4, base.head_dim) * 3
    for layer in range(base.num_layers):
        got, want = state(layer, q, base.scaling), exact(layer, q, base.scaling)
        assert close_reordered(got.lse, want.lse) and close_reordered(got.out, want.out)


def test_template_tokens_are_the_context_outside_the_document(tiny):
    base, layout, _, _, _ = tiny
    mask = template_mask(layout, DOC)
    assert mask[0] and mask[-1]  # the chat header and the closing wrapper
    inside = base.tokenizer.decode([t for t, m in zip(layout.context_ids, mask.tolist()) if not m])
    assert DOC.strip()[:40] in inside and len(inside) <= len(DOC) + 16
