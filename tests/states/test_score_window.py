"""The reconstruction scores within a window (``select.score_window``, KVzip's chunk-local scoring) on
the tiny random model: spans mapped to their context tokens, the merged intervals a batch scores, a
window covering the document giving the whole scores bit for bit, a narrow one scoring each key only
from the batches near it, and the settings it refuses."""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent.parent / "training"))
from targets_fixture import DOC, make_targets  # noqa: E402

from nectar.queries.recon import make_recon  # noqa: E402
from nectar.schemas.config import ProbesConfig, ReconConfig, SelectionConfig  # noqa: E402
from nectar.states import reconstruction  # noqa: E402
from nectar.states.reconstruction import recon_capture, response_tokens, score_ranges  # noqa: E402

RECON = ReconConfig(span_words=12, withheld_fraction=0.0)
PROBES = ProbesConfig(block_units=1)


@pytest.fixture(scope="module")
def tiny(tiny_llama, tmp_path_factory):
    layout, kv, _ = make_targets(tiny_llama, DOC, tmp_path_factory.mktemp("targets"))
    spans = [(s.instruction, s.response) for s in make_recon(DOC, RECON, PROBES)]
    return tiny_llama, layout, kv, spans


def test_each_response_maps_to_the_context_tokens_that_spell_it(tiny):
    base, layout, _, spans = tiny
    ranges = response_tokens(layout, [r for _, r in spans])
    ids = list(layout.context_ids)
    assert len(ranges) == len(spans) > 3
    for (_, response), (a, b) in zip(spans, ranges):
        spelled = base.tokenizer.decode(ids[a:b])
        assert response.strip() in spelled and len(spelled) < len(response.strip()) + 16
        assert response.strip() not in base.tokenizer.decode(ids[a + 1:b])  # no token to spare at the start
    assert all(a1 >= b0 - 1 for (_, b0), (a1, _) in zip(ranges, ranges[1:]))  # in document order


def test_a_second_tiling_pass_is_found_again_from_the_start(tiny):
    _, layout, _, spans = tiny
    responses = [r for _, r in spans]
    twice = response_tokens(layout, responses + responses[:2])
    assert twice[-2:] == twice[:2]


def test_score_ranges_widen_clip_and_merge():
    assert score_ranges([(10, 20), (22, 30)], 2, 100) == [(8, 32)]
    assert score_ranges([(50, 60), (0, 5)], 3, 62) == [(0, 8), (47, 62)]
    assert score_ranges([(10, 20)], 0, 100) == [(10, 20)]


def test_a_window_over_the_whole_document_gives_the_whole_scores_bit_for_bit(tiny, monkeypatch):
    base, layout, kv, spans = tiny
    monkeypatch.setattr(reconstruction, "RECON_BATCH_TOKENS", 96)  # several batches on the tiny document
    whole = recon_capture(base, layout, kv, spans)
    covering = recon_capture(base, layout, kv, spans, window=layout.n)
    assert torch.equal(covering.scores, whole.scores)
    assert torch.equal(covering.A, whole.A) and torch.equal(covering.alpha, whole.alpha)


def test_a_narrow_window_scores_each_key_from_the_batches_near_it_only(tiny, monkeypatch):
    base, layout, kv, spans = tiny
    monkeypatch.setattr(reconstruction, "RECON_BATCH_TOKENS", 96)
    whole = recon_capture(base, layout, kv, spans)
    narrow = recon_capture(base, layout, kv, spans, window=4)
    # a max over fewer batches: never above the whole max (1e-5: key blocks of other shapes may sum the
    # (d + 1)-term logits in another order on another processor), strictly below somewhere
    assert (narrow.scores <= whole.scores * (1 + 1e-5)).all() and (narrow.scores < whole.scores).any()
    # every token of a reconstructed span is scored by its own batch: the same as some whole-score batch
    spans_keys = response_tokens(layout, [r for _, r in spans])
    inside = torch.zeros(layout.n, dtype=torch.bool)
    for a, b in spans_keys:
        inside[a:b] = True
    assert (narrow.scores[..., inside] > 0).all()
    assert (narrow.scores[..., :spans_keys[0][0] - 4] == 0).all()  # the template before the text: unscored
    # the targets (q, α, A) do not depend on which keys are scored
    assert torch.equal(narrow.A, whole.A) and torch.equal(narrow.q, whole.q)


def test_a_window_with_the_mean_aggregate_is_refused_in_one_line(tiny):
    base, layout, kv, spans = tiny
    with pytest.raises(ValueError, match="score_window=null"):
        SelectionConfig(aggregate="mean", score_window=64)
    with pytest.raises(ValueError, match="max aggregate"):
        recon_capture(base, layout, kv, spans, "mean", window=64)


def test_the_first_state_and_its_compare_system_score_in_the_same_window():
    """``recon_first@int4`` is the first stage's algorithm at any budget: the same selection settings
    (the window included); ``recon_first_allscores@int4`` differs from it by the window alone."""
    from nectar.comparison.systems import SYSTEMS
    from nectar.schemas.config import FIRST_SCORE_WINDOW, FirstConfig
    from nectar.states import get_method
    from nectar.states.recon_fit import ReconFit

    first = FirstConfig().select
    assert first.score_window == FIRST_SCORE_WINDOW
    system = get_method(SYSTEMS["recon_first@int4"].method).with_options(**SYSTEMS["recon_first@int4"].options)
    assert system.select == first
    top = ReconFit.from_select(SelectionConfig()).with_options(**SYSTEMS["recon_first_top@int4"].options)
    # the first state as it was before its key choice and its β/value estimate went "auto"
    assert top.select == first.model_copy(update={"key_choice": "top", "fit_by": "least_squares"})
    whole = ReconFit.from_select(SelectionConfig()).with_options(**SYSTEMS["recon_first_allscores@int4"].options)
    assert whole.select == top.select.model_copy(update={"score_window": None})


def test_a_span_that_cannot_be_placed_makes_its_batch_score_every_key(tiny, monkeypatch):
    """A response not found in the context (a tokenizer quirk) maps to None; its batch falls back to
    scoring every key — exact, only slower — while the other batches keep their windows."""
    base, layout, kv, spans = tiny
    monkeypatch.setattr(reconstruction, "RECON_BATCH_TOKENS", 96)
    stranger = ("Repeat the document verbatim.", "Zebras quietly annotate purple harmonicas.")
    assert response_tokens(layout, [stranger[1], spans[0][1]])[0] is None
    whole = recon_capture(base, layout, kv, [stranger, *spans])
    narrow = recon_capture(base, layout, kv, [stranger, *spans], window=4)
    batches = list(reconstruction.recon_batches([len(layout.pair(i, r).ids) for i, r in [stranger, *spans]], 96))
    assert len(batches) > 2 and 0 in batches[0]
    # the stranger's batch scored every key, so no key scores 0 — the template before the text included
    assert (narrow.scores > 0).all()
    assert (narrow.scores <= whole.scores * (1 + 1e-5)).all()
    without = recon_capture(base, layout, kv, spans, window=4)  # every batch placed: the template unscored
    assert (without.scores[..., :2] == 0).all()
