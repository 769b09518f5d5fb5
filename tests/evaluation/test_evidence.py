"""The judge-free verifier's scores on constructed pairs, on the real embedded model (SmolLM2-135M) and
the default document: an answer copied from the document gains more from the document than a generic
one, and agreement with the full-context answer is ROUGE-L."""
import pytest
import torch

from nectar.attention.doc_kv import prefill_document
from nectar.attention.exact import ExactDocState
from nectar.documents import load_document
from nectar.evaluation.evidence import answer_agreement, distribution, document_gain
from nectar.layout import build_layout


def test_agreement_is_word_rouge_l_and_zero_for_empty_answers():
    assert answer_agreement("A NameError is raised.", "a nameerror is raised") == 1.0
    assert answer_agreement("", "anything") == 0.0 == answer_agreement("something", "  ")
    assert 0 < answer_agreement("the block is executed", "a block is a piece of text") < 1


def test_distribution_is_ordered_quantiles():
    d = distribution([0.0, 1.0, 2.0, 3.0, 4.0])
    assert d["min"] == 0 and d["p50"] == 2 and d["max"] == 4 and d["p10"] <= d["p25"] <= d["p75"] <= d["p90"]
    assert distribution([]) == {}


@pytest.mark.slow
def test_copied_answer_gains_more_from_the_document_than_a_generic_one(smollm2):
    torch.set_num_threads(2)
    doc, _ = load_document("pydoc:naming")
    layout = build_layout(smollm2.tokenizer, doc)
    full = ExactDocState(prefill_document(smollm2, layout.context_ids))  # the document KV [n = 1528 tokens]
    q = "What happens when a name is used in a code block but is not bound there?"
    copied = ('If a name is bound in a block, it is a local variable of that block, unless declared as '
              '"nonlocal" or "global".')  # a sentence of the document, verbatim
    rare = ("The following constructs bind names: formal parameters to functions, class definitions, "
            "function definitions, assignment expressions")  # verbatim, from the binding list
    generic = "It depends on the situation, and you should check the documentation for more details."
    items = [("copied", q, copied), ("rare", "Which constructs bind names?", rare), ("generic", q, generic)]
    scores = document_gain(smollm2, layout, full, items, max_tokens=384)
    assert set(scores) == {"copied", "rare", "generic"}
    # measured: copied 1.38, rare 1.75, generic -0.01 nats per answer token (verify.min_gain is 0.5)
    assert scores["copied"].gain > 1.0 and scores["rare"].gain > 1.0
    assert abs(scores["generic"].gain) < 0.3  # the document barely moves an answer that doesn't read it
    assert all(s.n_tokens > 5 for s in scores.values())
