"""The judge reply parser: well-formed, malformed and out-of-range replies."""
import pytest

from nectar.evaluation.judge_parse import parse_judgment


@pytest.mark.parametrize("reply, score", [
    ('{"score": 4, "reasoning": "close"}', 4),
    ('```json\n{"score": 5, "reasoning": "same"}\n```', 5),
    ('Here is my evaluation:\n{"score": 2, "reasoning": "differs"}\nHope this helps.', 2),
    ('{"score": "3", "reasoning": "partial"}', 3),
    ('{"score": 4.0, "reasoning": "x"}', 4),
    ('{"reasoning": "nested {braces} ok", "score": 1}', 1),
    # the prompt's format line echoed back (not JSON) before the real answer
    ('Output: {"score": 1 to 5, "reasoning": "brief explanation"}\n{"score": 3, "reasoning": "ok"}', 3),
    # cut off by the token limit mid-reasoning: the explicit key/value still counts
    ('{"score": 5, "reasoning": "both say the same thing about the', 5),
])
def test_parses_scores(reply, score):
    parsed = parse_judgment(reply)
    assert (parsed.score, parsed.error) == (score, None)


def test_keeps_the_reasoning():
    assert parse_judgment('{"score": 4, "reasoning": "minor differences"}').reasoning == "minor differences"


@pytest.mark.parametrize("reply, message", [
    ('{"score": 6, "reasoning": "great"}', "out of range"),
    ('{"score": 0}', "out of range"),
    ('{"score": 4.5}', "whole number"),
    ('{"score": "high"}', "not a number"),
    ('{"score": true}', "boolean"),
    ('{"reasoning": "no score here"}', "no JSON object"),
    ("I would rate this a 4 out of 5.", "no JSON object"),
    ('{"score": 1 to 5, "reasoning": "brief explanation"}', "no JSON object"),
    ('{"score": 2} and also {"score": 5}', "several different scores"),
    ("", "empty"),
    (None, "empty"),
])
def test_records_errors_instead_of_guessing(reply, message):
    parsed = parse_judgment(reply)
    assert parsed.score is None
    assert message in parsed.error
