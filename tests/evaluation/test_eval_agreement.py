"""Greedy generation agreement with the full-context model, on the tiny model and the real embedder."""
import numpy as np
import pytest

from nectar.attention.doc_kv import prefill_document
from nectar.attention.exact import ExactDocState
from nectar.evaluation.agreement import agreement_scores, greedy_continuations, sentence_embedder
from nectar.layout import build_layout
from nectar.base_model import embedder_path

DOC = "The lighthouse keeper of Varn Island kept a ledger of every ship that passed. " * 3


@pytest.fixture(scope="module")
def setup(tiny_llama):
    layout = build_layout(tiny_llama.tokenizer, DOC)
    kv = prefill_document(tiny_llama, layout.context_ids)
    prompts = [layout.prompt(q).ids for q in ("Who kept the ledger?", "Where?", "What did the keeper of the island do?")]
    return layout, kv, prompts


def test_a_system_equal_to_full_agrees_exactly(tiny_llama, setup):
    layout, kv, prompts = setup
    providers = {"full": ExactDocState(kv), "copy": ExactDocState(kv), "none": None}
    cont = greedy_continuations(tiny_llama, layout.n, providers, prompts, max_new_tokens=6, batch_size=2)
    assert all(len(c) == len(prompts) for c in cont.values())
    assert all(0 < len(t) <= 6 for t in cont["full"])
    decode = lambda ids: tiny_llama.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    same = agreement_scores(decode, cont["full"], cont["copy"])
    assert list(same.exact) == [1.0] * 3 and list(same.rouge_l) == [1.0] * 3 and np.isnan(same.cosine).all()


@pytest.mark.slow  # loads all-MiniLM-L6-v2
def test_scores_by_hand_with_the_real_embedder(tiny_llama):
    tok = tiny_llama.tokenizer
    decode = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
    enc = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    ref = [enc("police killed the gunman"), enc("the names are bound at runtime")]
    cand = [enc("police kill the gunman"), enc("the names are bound at runtime")]
    s = agreement_scores(decode, ref, cand, sentence_embedder(embedder_path()))
    assert list(s.exact) == [0.0, 1.0]
    assert s.rouge_l == pytest.approx([0.75, 1.0])
    assert s.cosine[1] == pytest.approx(1.0, abs=1e-5) and 0.3 < s.cosine[0] < 0.999
    with pytest.raises(ValueError, match="compare"):
        agreement_scores(decode, ref, cand[:1])


@pytest.mark.slow  # loads all-MiniLM-L6-v2
def test_a_texts_embedding_does_not_depend_on_its_batch_companions():
    """A resumed evaluate embeds other texts beside the same continuations; their cosines must be the
    uninterrupted run's to the bit (tests/reliability/test_signals.py compares metrics.parquet)."""
    embed = sentence_embedder(embedder_path())
    text = "The names are bound at runtime, in the innermost enclosing scope."
    alone = embed([text])[0]
    crowded = embed(["a", text, "a much longer companion text " * 12, text])
    assert np.array_equal(crowded[1], alone) and np.array_equal(crowded[3], alone)
    assert float(alone @ alone) == pytest.approx(1.0, abs=1e-6)  # unit norm in float32
