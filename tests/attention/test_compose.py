"""Composing documents' states (nectar/attention/compose.py): the merge identity over several documents.

Two documents prefilled apart, each at positions 0 … n_k − 1, composed with the query rotated to each
part's offset must give what attention over both KVs placed back to back gives (the second one's keys
computed at its offset): exact, up to the order of the reductions. What composition cannot give — the
second document attending to the first — is left out of the reference on purpose: that is the
measured loss (docs/quality.md), not a tolerance here."""
import pytest
import torch
from transformers import DynamicCache

from nectar.attention.compose import (ComposedDocState, CompositionError, RopeShift, compose, composed_layout,
                                     shared_prefix)
from nectar.attention.doc_kv import DocKV, prefill_document
from nectar.attention.exact import ExactDocState
from nectar.attention.forward import query_logits
from nectar.cache_call import cache_kwargs
from nectar.layout import build_layout
from float_tolerance import FORWARD, assert_close_reordered

DOC_B = ("The amendment of 1902 moved the ledger to the harbour office at Kell, where clerk Oskar Lind "
         "copied it twice a year and sent one copy to the archive in Tromsø. ") * 2


def _prefill_at(base, ids, offset: int) -> DocKV:
    """The KV of ``ids`` alone (attending only to themselves), its tokens at offset … offset + n − 1."""
    t = torch.tensor([list(ids)])
    cache = DynamicCache(config=base.model.config)
    with torch.no_grad():
        base.model(input_ids=t, position_ids=torch.arange(offset, offset + t.shape[1]).unsqueeze(0),
                   **cache_kwargs(base.model, cache), use_cache=True, logits_to_keep=1)
    return DocKV([layer.keys[0].contiguous() for layer in cache.layers],
                 [layer.values[0].contiguous() for layer in cache.layers])


def _cat(a: DocKV, b: DocKV) -> DocKV:
    return DocKV([torch.cat([x, y], dim=1) for x, y in zip(a.keys, b.keys)],  # [hkv, na + nb, d]
                 [torch.cat([x, y], dim=1) for x, y in zip(a.values, b.values)])


def _query(base, document):
    layout = build_layout(base.tokenizer, document)
    return layout, torch.tensor([layout.pair("Who copied the ledger?", "Clerk Oskar Lind, at Kell.").ids])


def test_one_state_composed_with_nothing_is_the_state(tiny_llama, document):
    layout, ids = _query(tiny_llama, document)
    alone = ExactDocState(prefill_document(tiny_llama, layout.context_ids))
    with torch.no_grad():
        want = query_logits(tiny_llama, alone, ids, layout.n)
        provider, n = compose([alone], [layout.n], "concat", tiny_llama.model)
        assert n == layout.n
        assert torch.equal(query_logits(tiny_llama, provider, ids, n), want)  # bit for bit
        with_nothing = ComposedDocState([alone, None])
        assert torch.equal(query_logits(tiny_llama, with_nothing, ids, layout.n), want)


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen3", "tiny_llama_yarn"])
def test_two_exact_kvs_compose_to_attention_over_both(fixture, request, document):
    """concat: B's keys at offset n_A by rotating the query; equals attention over [KV_A ; KV_B at n_A]."""
    base = request.getfixturevalue(fixture)
    layout_a, ids = _query(base, document)
    ids_b = build_layout(base.tokenizer, DOC_B).context_ids
    na, nb = layout_a.n, len(ids_b)
    kv_a, kv_b = prefill_document(base, layout_a.context_ids), prefill_document(base, ids_b)
    both = ExactDocState(_cat(kv_a, _prefill_at(base, ids_b, na)))  # the reference: B computed at n_A …
    with torch.no_grad():
        want = query_logits(base, both, ids, na + nb)
        provider, n = compose([ExactDocState(kv_a), ExactDocState(kv_b)], [na, nb], "concat", base.model)
        got = query_logits(base, provider, ids, n)
        alone = query_logits(base, ExactDocState(kv_a), ids, na + nb)
    assert n == na + nb
    assert_close_reordered(got, want, FORWARD, name=f"compose-concat-{fixture}")
    assert (alone - want).abs().max() > 1e-3  # B's keys do change the answer: the test can fail


def _slice(kv: DocKV, start: int) -> DocKV:
    return DocKV([k[:, start:] for k in kv.keys], [v[:, start:] for v in kv.values])  # [hkv, n - start, d]


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen3"])
def test_shared_prefix_held_once_equals_attention_over_one_prefix(fixture, request, document):
    """prefix: the template both contexts start with is taken out of the second part, so the composition
    equals attention over [KV_A ; KV_B without its prefix, at n_A]: one prefix, as in a concatenation."""
    base = request.getfixturevalue(fixture)
    layout_a, ids = _query(base, document)
    ids_b = build_layout(base.tokenizer, DOC_B).context_ids
    prefix = shared_prefix([layout_a.context_ids, ids_b])
    assert 0 < len(prefix) < len(ids_b) and list(ids_b[:len(prefix)]) == prefix
    na, nb, p = layout_a.n, len(ids_b), len(prefix)
    kv_a, kv_b = prefill_document(base, layout_a.context_ids), prefill_document(base, ids_b)
    once = ExactDocState(_cat(kv_a, _slice(_prefill_at(base, ids_b, na), p)))
    with torch.no_grad():
        want = query_logits(base, once, ids, na + nb)
        provider, n = compose([ExactDocState(kv_a), ExactDocState(kv_b)], [na, nb], "concat", base.model,
                              prefix=ExactDocState(prefill_document(base, prefix)))
        got = query_logits(base, provider, ids, n)
        twice, _ = compose([ExactDocState(kv_a), ExactDocState(kv_b)], [na, nb], "concat", base.model)
        kept = query_logits(base, twice, ids, n)
    assert_close_reordered(got, want, FORWARD, name=f"compose-prefix-once-{fixture}")
    assert (kept - want).abs().max() > 1e-3  # the second copy of the prefix does change the answer


def test_longest_and_own_layouts(tiny_llama, document):
    """longest: no shift, the query after the longer document; own: each part sees the query right
    after itself — for the last part of concat that is the same shift (0)."""
    layout_a, ids = _query(tiny_llama, document)
    ids_b = build_layout(tiny_llama.tokenizer, DOC_B).context_ids
    na, nb = layout_a.n, len(ids_b)
    kv_a, kv_b = prefill_document(tiny_llama, layout_a.context_ids), prefill_document(tiny_llama, ids_b)
    with torch.no_grad():
        provider, n = compose([ExactDocState(kv_a), ExactDocState(kv_b)], [na, nb], "longest", tiny_llama.model)
        assert n == max(na, nb)
        assert_close_reordered(query_logits(tiny_llama, provider, ids, n),
                               query_logits(tiny_llama, ExactDocState(_cat(kv_a, kv_b)), ids, n), FORWARD)
    assert composed_layout([na, nb], "own").shifts == (nb, na)
    assert composed_layout([na, nb], "concat").shifts == (0, na)


def test_rope_shift_moves_a_query_back(tiny_llama):
    """Rotating a query computed at p by −δ gives the query computed at p − δ (keys of one prefill)."""
    kv_far, kv_near = (_prefill_at(tiny_llama, [5, 6, 7], off) for off in (40, 0))
    shift = RopeShift.of_model(tiny_llama.model)
    for far, near in zip(kv_far.keys, kv_near.keys):  # keys rotate exactly as queries do
        assert_close_reordered(shift(far, 40), near)


def test_unknown_layout_is_refused_in_one_line():
    with pytest.raises(CompositionError, match="positions 'sideways'.*concat") as err:
        composed_layout([3, 4], "sideways")
    assert "\n" not in str(err.value)
