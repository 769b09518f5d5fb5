"""Judge prompts, the judge adapter's failure handling and the Δs summary."""
import pytest
from scipy import stats

from nectar.evaluation.judge import JudgeItem, judge, judge_prompt, judge_summary
from nectar.prompts import EVAL_RUBRICS as RUBRICS
from nectar.prompts import template
from nectar.schemas import JudgmentRow

ITEM = JudgeItem("p1", "quoting", ("test", "challenge"), "Quote the line about {generated} oil.",
                 "barrels of lamp oil", "CHUNK TEXT", "module says lamp oil", "full says lamp oil")


def test_prompts_are_the_papers_with_the_task_rubric():
    p = judge_prompt(ITEM, "module_vs_truth")
    assert p.startswith("You are an expert evaluator assessing semantic similarity\nbetween a model's response")
    assert RUBRICS["quoting"] in p and RUBRICS["qa"] not in p
    assert "<context>\nCHUNK TEXT\n</context>" in p and "module says lamp oil" in p
    assert "{generated}" in p  # text inside the instruction is not substituted a second time
    assert '{"score": 1 to 5, "reasoning": "brief explanation"}' in p
    assert "full says lamp oil" in judge_prompt(ITEM, "base_vs_truth")
    c = judge_prompt(ITEM, "module_vs_base")
    assert "CHUNK TEXT" not in c and "<response_a>\nfull says lamp oil\n</response_a>" in c
    assert "<response_b>\nmodule says lamp oil\n</response_b>" in c
    assert "Score 3: one says 'football' and the other says 'swimming'." in template("eval_compare")


def test_unknown_task_is_a_clear_error():
    bad = JudgeItem("p", "poetry", ("test",), "i", "g", "c", "m", "f")
    with pytest.raises(ValueError, match="no judge rubric for task 'poetry'"):
        judge_prompt(bad, "module_vs_truth")


def test_judge_records_garbage_and_backend_errors_with_fake_garbage_judge():
    replies = iter([("not json at all", None), (None, "HTTP 500: server exploded"), ('{"score": 9}', None)])
    rows = judge(lambda prompts: [next(replies) for _ in prompts], [ITEM])
    assert len(rows) == 6  # 3 comparisons x 2 splits
    by = {r.comparison: r for r in rows if r.split == "test"}
    assert by["module_vs_truth"].score is None and "no JSON object" in by["module_vs_truth"].parse_error
    assert by["module_vs_truth"].raw == "not json at all"
    assert by["base_vs_truth"].parse_error == "backend error: HTTP 500: server exploded"
    assert "out of range" in by["module_vs_base"].parse_error
    summary = judge_summary(rows)
    assert {(s["split"], s["task"]) for s in summary} == {("test", "quoting"), ("test", "all"),
                                                          ("challenge", "quoting"), ("challenge", "all")}
    assert all(s["n_paired"] == 0 and s["n_unparsed"] == 1 and s["judge_errors"] == 3 for s in summary)


def test_judge_rejects_a_backend_that_loses_replies():
    with pytest.raises(RuntimeError, match="returned 1 replies for 3 prompts"):
        judge(lambda prompts: [("{}", None)], [JudgeItem("p", "qa", ("test",), "i", "g", "c", "m", "f")])


def _rows(split, task, pid, base, module, agree):
    return [JudgmentRow(pair_id=pid, split=split, task=task, comparison=c, score=s, reasoning="", raw="",
                        parse_error=None if s is not None else "x")
            for c, s in (("base_vs_truth", base), ("module_vs_truth", module), ("module_vs_base", agree))]


def test_summary_per_task_and_overall_matches_scipy():
    data = [("qa", "a", 5, 4, 5), ("qa", "b", 4, 2, 3), ("qa", "c", 3, 3, 5), ("summarization", "d", 4, 1, 2),
            ("summarization", "e", 2, None, 4), ("summarization", "f", 5, 5, 5)]
    rows = [r for t, pid, b, m, a in data for r in _rows("test", t, pid, b, m, a)]
    s = {x["task"]: x for x in judge_summary(rows)}
    assert s["qa"]["delta_s"] == pytest.approx((5 + 4 + 3 - 4 - 2 - 3) / 3)
    lo, hi = stats.ttest_rel([5, 4, 3], [4, 2, 3]).confidence_interval()
    assert s["qa"]["delta_s_ci"] == pytest.approx((hi - lo) / 2)
    assert (s["summarization"]["n_paired"], s["summarization"]["n_unparsed"]) == (2, 1)
    assert s["all"]["n_paired"] == 5 and s["all"]["delta_s"] == pytest.approx((1 + 2 + 0 + 3 + 0) / 5)
    assert s["all"]["agreement_mean"] == pytest.approx(24 / 6)
    assert list(s) == ["qa", "summarization", "all"]


@pytest.mark.slow
def test_judge_through_the_real_local_backend_on_the_tiny_model():
    """A real chat backend (in-process, tiny random model): with the score schema enforced every
    reply parses to 1..5; unconstrained, the random model's replies are recorded as parse errors."""
    from nectar.evaluation.judge import make_chat
    from nectar.llm import make_backend
    from nectar.schemas import LLMConfig, ModelConfig

    items = [JudgeItem("p1", "qa", ("test",), "What ran aground?", "The Meridian.", "The Meridian ran aground.",
                       "the Meridian", "a schooner")]
    for structured in (True, False):
        cfg = LLMConfig(backend="local", temperature=0.0, max_new_tokens=24, structured_output=structured)
        backend = make_backend(cfg, ModelConfig(name="tiny:llama"))
        rows = judge(make_chat(backend, cfg), items)
        assert len(rows) == 3 and all(r.raw for r in rows)
        if structured:
            assert all(r.parse_error is None and 1 <= r.score <= 5 for r in rows), [r.raw for r in rows]
        else:
            assert all(r.score is None and r.parse_error for r in rows), [r.raw for r in rows]


@pytest.mark.slow
def test_judge_with_the_embedded_smollm2_backend_parses_every_reply():
    """The cpu preset's judge: the local SmolLM2 with the score schema; every reply parses."""
    from nectar.evaluation.judge import make_chat
    from nectar.llm import make_backend
    from nectar.schemas import ModelConfig, load_config

    cfg = load_config("cpu").evaluate.judge.model_copy(update={"max_new_tokens": 64, "backend": "local"})
    backend = make_backend(cfg, ModelConfig(name="embedded:smollm2-135m"))
    items = [JudgeItem("p1", "qa", ("test",), "Who bought the island?", "Ilse Brandt bought the island.",
                       "Her captain, Ilse Brandt, later bought the island.", "Ilse Brandt.",
                       "The island was bought by the captain, Ilse Brandt.")]
    rows = judge(make_chat(backend, cfg), items)
    assert [r.comparison for r in rows] == ["module_vs_truth", "base_vs_truth", "module_vs_base"]
    assert all(r.parse_error is None and 1 <= r.score <= 5 for r in rows), [r.raw for r in rows]


def test_a_judge_that_gives_every_reply_one_score_is_flagged():
    from nectar.stages.evaluate import constant_judge_score

    same = [r for i in range(2) for r in _rows("test", "qa", f"p{i}", 1, 1, 1)]
    assert constant_judge_score(same) == 1
    varied = same[:-1] + _rows("test", "qa", "p9", 1, 1, 5)
    assert constant_judge_score(varied) is None
    assert constant_judge_score(same[:3]) is None  # too few to tell
    unparsed = same + _rows("test", "qa", "p8", None, None, None)
    assert constant_judge_score(unparsed) == 1  # parse failures don't count as a score
