"""KVzip-style selection on the tiny random model: reconstruction scores (max over spans, whole
softmax), one budget across layers and heads with exact bytes, anchors, masked slots, the fit."""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent.parent / "training"))
from targets_fixture import DOC, make_targets  # noqa: E402

from nectar.attention.exact import ExactDocState  # noqa: E402
from nectar.states import fit_recon  # noqa: E402
from nectar.states.reconstruction import allocate, anchor_mask, recon_capture, template_mask  # noqa: E402
from nectar.modules import plan_module  # noqa: E402
from nectar.schemas.config import ProbesConfig, ReconConfig, SelectionConfig  # noqa: E402
from nectar.queries.recon import make_recon  # noqa: E402
from nectar.modules.budget import ragged_pair_bytes  # noqa: E402
from nectar.modules.fused import fuse_module  # noqa: E402
from nectar.modules.io import load_module, make_spec, save_module  # noqa: E402
from nectar.modules.stored import stored_nbytes, stored_tensors  # noqa: E402
from nectar.quantization import fake_quantize  # noqa: E402
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
            kept = allocate(cap.scores, plan, 4 * per_pair, mode, anchor_mask(layout.n, 4))
            counts = torch.tensor([[k.numel() for k in heads] for heads in kept])
            if mode == "global":
                assert counts.sum() == base.num_kv_heads * sum(plan.budgets) // per_pair
            if mode == "head":
                assert all((counts[i] == b // per_pair).all() for i, b in enumerate(plan.budgets))
            for heads in kept:
                for idx in heads:
                    assert set(range(4)) <= set(idx.tolist())  # sinks kept everywhere
                    assert (idx.diff() > 0).all()  # document order, no duplicates
    kept = allocate(cap.scores, plan, 4 * 2 * d, "global", anchor_mask(layout.n, 4))
    counts = torch.tensor([[k.numel() for k in heads] for heads in kept])
    assert counts.min() < counts.max()  # a random model's heads are not all alike


@pytest.mark.parametrize("fit", [False, True])
def test_fitted_state_counts_only_real_pairs_and_masked_slots_change_nothing(tiny, fit):
    base, layout, kv, url, spans = tiny
    plan = _plan(base, layout.n, 0.2)
    state = fit_recon(base, layout, DOC, kv, url, plan, SelectionConfig(fit=fit), spans)
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
    state = fit_recon(base, layout, DOC, kv, url, plan, SelectionConfig(fit=False, budget="head"), spans)
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


def _file_tensor_bytes(path) -> int:
    from safetensors.torch import load_file
    return sum(t.numel() * t.element_size() for t in load_file(str(path)).values())


@pytest.mark.parametrize("bits,fit", [(4, True), (8, True), (4, False), (32, True)])
def test_quantized_selection_buys_more_pairs_and_its_bytes_are_the_file_it_writes(tiny, tmp_path, bits, fit):
    base, layout, kv, url, spans = tiny
    plan = _plan(base, layout.n, 0.05)  # int4 pairs stay fewer than the document's keys
    fp32 = fit_recon(base, layout, DOC, kv, url, plan, SelectionConfig(fit=fit), spans)
    qplan = plan.__class__(**{**plan.__dict__, "bits": bits})
    state = fit_recon(base, layout, DOC, kv, url, qplan, SelectionConfig(fit=fit), spans)
    pairs = sum(map(sum, state.plan.quad_head_pairs))
    pair_bytes = ragged_pair_bytes(base.head_dim, fit, bits)
    assert pairs == 4 * base.num_kv_heads * sum(plan.budgets) // pair_bytes  # the bytes set the count
    if bits < 32:
        assert pairs > 3 * sum(map(sum, fp32.plan.quad_head_pairs))  # int8 ~3.6x, int4 ~6.8x the pairs
    assert state.nbytes == pairs * pair_bytes <= 4 * base.num_kv_heads * sum(plan.budgets)
    # masked slots are not stored: the file holds exactly the counted bytes
    spec = make_spec(state.module, state.plan, base.name, base.weights_hash, "0" * 64, base.num_q_heads)
    save_module(state.module, spec, str(tmp_path))
    assert spec.module_bytes == state.nbytes == _file_tensor_bytes(tmp_path / "module.safetensors")
    assert sum(t.numel() * t.element_size() for t in stored_tensors(state.module).values()) == state.nbytes
    # round trip: the loaded state is the fitted one exactly (its real pairs were already on the grid)
    loaded, _ = load_module(str(tmp_path))
    for a, b in zip(state.module.layers, loaded.layers):
        assert torch.equal(a.W, b.W) and torch.equal(a.Z, b.Z) and torch.equal(a.beta, b.beta)
    if bits < 32:  # stored values are on the grid: each real row re-quantizes to itself
        W = state.module.layers[0].W
        c = state.plan.quad_head_pairs[0][0]
        assert torch.equal(fake_quantize(W[0, :c], bits), W[0, :c])
    # the fused decode path serves the state from its codes (--codes-only: it holds exactly the stored
    # bytes) or from floats dequantized once at load (the default: it holds the codes and the floats),
    # and both equal the float copy
    codes_only, kept = fuse_module(loaded, keep_dequantized=False), fuse_module(loaded)
    if bits < 32:  # (at float32 the padded float copy is what it reads)
        assert codes_only.nbytes == codes_only.resident_bytes == state.nbytes
        assert kept.resident_bytes == state.nbytes + kept.nbytes and kept.nbytes > state.nbytes
    q = torch.randn(base.num_kv_heads, 5, base.head_dim) * 3  # [H, N, d]
    for fused in (codes_only, kept):
        for layer in range(base.num_layers):
            A, a = fused.predict(layer, q)
            A_ref, a_ref = loaded.predict(layer, q.transpose(0, 1))  # [N, H, ·]
            assert close_reordered(a, a_ref.transpose(0, 1)) and close_reordered(A, A_ref.transpose(0, 1))


def test_quantization_aware_fit_beats_rounding_a_float_fit_on_its_own_queries(tiny):
    """At int4 the fit that sees the keys and β as stored matches the fitting queries' targets
    better than the float fit rounded afterwards."""
    base, layout, kv, url, spans = tiny
    plan = _plan(base, layout.n, 0.1)
    qplan = plan.__class__(**{**plan.__dict__, "bits": 4})
    cap = recon_capture(base, layout, kv, spans)
    errs = {}
    for aware in (True, False):
        st = fit_recon(base, layout, DOC, kv, None, qplan, SelectionConfig(fit_queries="recon", quant_aware=aware), spans)
        err = 0.0
        with torch.no_grad():  # the state's tensors require grad; only the error is read
            for layer in range(base.num_layers):
                q = cap.q[:, layer].transpose(0, 1).unsqueeze(0)  # [1, Hq, T, d]
                got = st(layer, q, base.scaling)
                err += float(((got.out[0].transpose(0, 1) - cap.A[:, layer]) ** 2).sum())
        errs[aware] = err
    assert errs[True] < errs[False]


def test_ranking_by_recon_and_train_queries_keeps_keys_of_both(tiny):
    base, layout, kv, url, spans = tiny
    from nectar.states.reconstruction import combined_scores
    r = torch.rand(2, 2, 50)
    t = torch.rand(2, 2, 50) * 100  # a different scale must not swamp the other ranking
    s = combined_scores(r, t, 20)
    top = set(torch.topk(s.reshape(-1), 20).indices.tolist())
    assert top & set(torch.topk(r.reshape(-1), 10).indices.tolist())
    assert top & set(torch.topk(t.reshape(-1), 10).indices.tolist())
    plan = _plan(base, layout.n, 0.2)
    both = fit_recon(base, layout, DOC, kv, url, plan, SelectionConfig(score_queries="recon+train"), spans)
    recon = fit_recon(base, layout, DOC, kv, url, plan, SelectionConfig(), spans)
    assert sum(map(sum, both.plan.quad_head_pairs)) == sum(map(sum, recon.plan.quad_head_pairs))  # same bytes
    assert both.plan.quad_head_pairs != recon.plan.quad_head_pairs


def test_gap_zero_is_the_capture_of_the_document_alone_bit_for_bit(tiny):
    base, layout, kv, _, spans = tiny
    alone, zero = recon_capture(base, layout, kv, spans), recon_capture(base, layout, kv, spans, gap=0)
    for a, b in zip((alone.scores, alone.q, alone.alpha, alone.A), (zero.scores, zero.q, zero.alpha, zero.A)):
        assert torch.equal(a, b)


def test_a_gap_capture_is_the_exact_attention_of_queries_that_far_after_the_document(tiny):
    """At gap g the spans sit at n + g …: layer 0's queries are the document-alone ones rotated g
    positions further (its input is the embeddings), and every layer's (α, A) is the exact attention
    of the captured queries over the document's keys (the part of a composed merge this document gives)."""
    from nectar.attention.compose import RopeShift

    base, layout, kv, _, spans = tiny
    gap = 300
    near, far = recon_capture(base, layout, kv, spans), recon_capture(base, layout, kv, spans, gap=gap)
    rope = RopeShift.of_model(base.model)
    assert close_reordered(far.q[:, 0], rope(near.q[:, 0], -gap), FORWARD)  # [T, Hq, d]
    exact = ExactDocState(kv, backend="torch")
    for layer in range(base.num_layers):
        q = far.q[:, layer].transpose(0, 1).unsqueeze(0)  # [1, Hq, T, d]
        st = exact(layer, q, base.scaling)
        assert close_reordered(st.lse[0].T, far.alpha[:, layer], FORWARD)
        assert close_reordered(st.out[0].transpose(0, 1), far.A[:, layer], FORWARD)
    assert not torch.allclose(far.alpha, near.alpha, atol=1e-3)  # the distance changes what is asked


def test_fitting_at_gaps_adds_the_shifted_queries_and_keeps_the_selection(tiny):
    from nectar.states.recon_fit import fit_queries

    base, layout, kv, url, spans = tiny
    select = SelectionConfig(fit_queries="recon", fit_gaps=(300,))
    near, far = recon_capture(base, layout, kv, spans), recon_capture(base, layout, kv, spans, gap=300)
    queries = fit_queries(near, None, select, gapped=[far])
    assert len(queries.q) == len(near.q) + len(far.q)  # below MAX_FIT_TOKENS: every token of both
    assert torch.equal(queries.alpha[len(near.q):], far.alpha) and torch.equal(queries.q[:len(near.q)], near.q)
    plan = _plan(base, layout.n, 0.2)
    plain = fit_recon(base, layout, DOC, kv, url, plan, SelectionConfig(fit_queries="recon"), spans)
    gapped = fit_recon(base, layout, DOC, kv, url, plan, select, spans)
    assert gapped.plan == plain.plan  # the ranking is the document's own: the same keys, the same bytes
    a, b = plain.module.state_dict(), gapped.module.state_dict()
    assert any(not torch.equal(a[k], b[k]) for k in a)  # … fitted (β, values) on more queries


def test_max_scores_taken_before_the_exp_are_the_whole_softmax_maxima():
    """The recorder's max path (the max over rows before the exp, −total folded into the product) gives
    what exp(s·q·k − total) then the max gives, on random queries with a local part of the softmax."""
    from nectar.attention.state import AttnState
    from nectar.states.reconstruction import _ScoreRecorder

    g = torch.Generator().manual_seed(0)
    hkv, group, R, n, d, s = 2, 3, 7, 40, 16, 0.25
    keys = [torch.randn(hkv, n, d, generator=g)]
    q = torch.randn(1, hkv * group, R + 2, d, generator=g)  # two rows that are not response rows
    rows = torch.arange(1, R + 1)
    logits = torch.einsum("hgrd,hnd->hgrn", q[0][:, rows].reshape(hkv, group, R, d), keys[0]) * s
    doc_lse = torch.zeros(1, hkv * group, R + 2)
    doc_lse[0][:, rows] = torch.logsumexp(logits, -1).reshape(-1, R)  # the document part of the softmax
    doc = AttnState(torch.zeros(1, hkv * group, R + 2, d), doc_lse)
    local = AttnState(torch.zeros_like(doc.out), torch.randn(1, hkv * group, R + 2, generator=g))
    total = torch.logaddexp(doc.lse[0][:, rows], local.lse[0][:, rows]).reshape(hkv, group, R, 1)
    want = (logits - total).exp().amax(dim=(1, 2))  # [Hkv, n]
    scores = torch.zeros(1, hkv, n)
    _ScoreRecorder(keys, rows, s, "max", scores)(0, q, doc, local)
    # two summation orders (the product with −total folded in vs subtracted after): float32 rounding of
    # logits up to ~10 moves exp by ~1e-6 relative on any processor; 1e-4 leaves margin
    assert torch.allclose(scores[0], want, rtol=1e-4, atol=1e-7)
    assert (scores[0] < 1).all() and (scores[0] > 0).all()


def test_scores_in_key_blocks_equal_the_whole_product(monkeypatch):
    """The recorder scores the keys in blocks (score_keys): blocks of 4 keys (a last one short) and
    one block of every key give the same scores (the max is exact; only the matmul's summation order
    may differ with the block's shape)."""
    from float_tolerance import assert_close_reordered, close_reordered
    from nectar.states import reconstruction

    g = torch.Generator().manual_seed(1)
    hkv, group, R, n, d = 2, 3, 11, 50, 16
    recorder = reconstruction._ScoreRecorder([], torch.arange(R), 0.25, "max", torch.zeros(1, hkv, n))
    qr, total = torch.randn(hkv * group, R, d, generator=g), torch.randn(hkv * group, R, generator=g)
    keys = torch.randn(hkv, n, d, generator=g)
    monkeypatch.setattr(reconstruction, "score_keys", lambda rows: 10 ** 6)
    whole = recorder._max_probs(qr, total, keys)
    monkeypatch.setattr(reconstruction, "score_keys", lambda rows: 4)  # 50 keys: 12 blocks of 4 and 1 of 2
    blocked = recorder._max_probs(qr, total, keys)
    assert_close_reordered(blocked, whole, name="scores in blocks")
    assert not close_reordered(recorder._max_probs(qr[:, :-1], total[:, :-1], keys), whole)  # a row less


def test_score_keys_shrink_with_the_rows_within_their_bounds():
    from nectar.states.reconstruction import score_keys

    assert score_keys(1) == 512 and score_keys(10 ** 6) == 32
    assert score_keys(1_000) > score_keys(3_000) >= 256


def test_gptq_value_rounding_keeps_the_pairs_and_bytes_and_fits_its_queries_closer(tiny):
    """``value_rounding: gptq`` (states/value_rounding.py): the same kept keys, β and bytes as rounding each
    value row to nearest, values on the int4 grid, and the fit queries' targets matched more closely."""
    base, layout, kv, url, spans = tiny
    plan = _plan(base, layout.n, 0.05)
    qplan = plan.__class__(**{**plan.__dict__, "bits": 4})
    cap = recon_capture(base, layout, kv, spans)
    states, errs = {}, {}
    for rounding in ("nearest", "gptq"):
        st = fit_recon(base, layout, DOC, kv, None, qplan, SelectionConfig(fit_queries="recon", value_rounding=rounding),
                       spans)
        err = 0.0
        with torch.no_grad():
            for layer in range(base.num_layers):
                q = cap.q[:, layer].transpose(0, 1).unsqueeze(0)  # [1, Hq, T, d]
                err += float(((st(layer, q, base.scaling).out[0].transpose(0, 1) - cap.A[:, layer]) ** 2).sum())
        states[rounding], errs[rounding] = st, err
    near, gptq = states["nearest"], states["gptq"]
    assert near.plan.quad_head_pairs == gptq.plan.quad_head_pairs and near.nbytes == gptq.nbytes
    for a, b, counts in zip(near.module.layers, gptq.module.layers, gptq.plan.quad_head_pairs):
        assert torch.equal(a.W, b.W) and torch.equal(a.beta, b.beta)  # keys and β: the values' rounding only
        c = counts[0]
        assert torch.equal(fake_quantize(b.Z[0, :c].detach(), 4), b.Z[0, :c].detach())
    assert not torch.equal(near.module.layers[0].Z, gptq.module.layers[0].Z)
    assert errs["gptq"] < errs["nearest"], errs


def test_greedy_key_choice_keeps_each_heads_count_the_bytes_and_the_sinks(tiny):
    """``key_choice: greedy`` rechooses which keys a head keeps (states/greedy_keys.py), not how many."""
    base, layout, kv, url, spans = tiny
    plan = _plan(base, layout.n, 0.05)
    qplan = plan.__class__(**{**plan.__dict__, "bits": 4})
    top = fit_recon(base, layout, DOC, kv, None, qplan, SelectionConfig(fit_queries="recon"), spans)
    greedy = fit_recon(base, layout, DOC, kv, None, qplan, SelectionConfig(fit_queries="recon", key_choice="greedy"),
                       spans)
    assert greedy.plan.quad_head_pairs == top.plan.quad_head_pairs and greedy.nbytes == top.nbytes
    sinks = kv.keys[0][0, :4].float()  # the first tokens' keys (layer 0, KV head 0): kept by both
    for W in (top.module.layers[0].W[0].detach(), greedy.module.layers[0].W[0].detach()):
        stored = fake_quantize(sinks, 4)
        assert all(any(torch.equal(r, w) for w in W) for r in stored)
    assert any(not torch.equal(a.W, b.W) for a, b in zip(top.module.layers, greedy.module.layers))


@pytest.mark.parametrize("scarce", [True, False])
def test_auto_key_choice_is_greedy_where_keys_are_scarce_and_top_elsewhere(tiny, monkeypatch, scarce):
    """``key_choice: auto`` (the first state's) fits exactly the greedy state when the allocation keeps at most
    GREEDY_SHARE of the document's entries, and exactly the top-scored one above (the share set at, and just
    under, what this budget keeps: the tiny document is too short for a budget under 5 %)."""
    import nectar.states.greedy_keys as greedy_keys

    base, layout, kv, url, spans = tiny
    plan = _plan(base, layout.n, 0.05)
    qplan = plan.__class__(**{**plan.__dict__, "bits": 4})
    fit = {choice: fit_recon(base, layout, DOC, kv, None, qplan, SelectionConfig(fit_queries="recon", key_choice=choice),
                             spans) for choice in ("top", "greedy")}
    kept = sum(sum(heads) for heads in fit["top"].plan.quad_head_pairs)
    share = kept / (base.num_layers * base.num_kv_heads * layout.n)
    monkeypatch.setattr(greedy_keys, "GREEDY_SHARE", share if scarce else 0.99 * share)
    auto = fit_recon(base, layout, DOC, kv, None, qplan, SelectionConfig(fit_queries="recon", key_choice="auto"), spans)
    same, other = (fit["greedy"], fit["top"]) if scarce else (fit["top"], fit["greedy"])
    assert auto.nbytes == same.nbytes
    assert all(torch.equal(a.W, b.W) and torch.equal(a.Z, b.Z) and torch.equal(a.beta, b.beta)
               for a, b in zip(auto.module.layers, same.module.layers))
    assert any(not torch.equal(a.W, b.W) for a, b in zip(auto.module.layers, other.module.layers))
