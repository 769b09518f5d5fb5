"""Generations: the full-context answers equal ordinary generation over document + prompt."""
import torch

from nectar.attention.doc_kv import prefill_document
from nectar.attention.exact import ExactDocState
from nectar.evaluation.generations import GenItem, generate_answers, generation_rows, max_new_tokens
from nectar.layout import build_layout
from nectar.schemas import EvaluateConfig

DOC = "The schooner Meridian ran aground on the northern reef of Varn Island in the winter of 1871. " * 3


def test_full_context_greedy_answers_equal_plain_generation(tiny_llama):
    layout = build_layout(tiny_llama.tokenizer, DOC)
    kv = prefill_document(tiny_llama, layout.context_ids)
    cfg = EvaluateConfig(temperature=0.0, max_new_tokens_qa=6, max_new_tokens_other=9)
    items = [GenItem("a", "qa", ("test",), "What ran aground?", "The Meridian."),
             GenItem("b", "summarization", ("test", "challenge"), "Summarize the story.", "A wreck.")]
    answers = generate_answers(tiny_llama, layout, {"module": None, "full": ExactDocState(kv)}, items, cfg)
    tok = tiny_llama.tokenizer
    for it in items:
        ids = torch.tensor([list(layout.context_ids) + layout.prompt(it.instruction).ids])
        with torch.no_grad():
            out = tiny_llama.model.generate(ids, max_new_tokens=max_new_tokens(it.task, cfg), do_sample=False,
                                            attention_mask=torch.ones_like(ids))
        ref = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()
        assert answers["full"][it.pair_id] == ref
    rows = generation_rows(items, answers)
    assert [(r.pair_id, r.split) for r in rows] == [("a", "test"), ("b", "test"), ("b", "challenge")]
    assert rows[1].full_output == rows[2].full_output  # one generation, reported under both splits
    assert rows[0].module_output == answers["module"]["a"]


def test_lengths_follow_the_task():
    cfg = EvaluateConfig()
    assert max_new_tokens("qa", cfg) == 64
    assert {max_new_tokens(t, cfg) for t in ("summarization", "quoting", "paraphrasing")} == {196}
