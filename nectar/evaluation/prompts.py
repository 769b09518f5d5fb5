"""The judge prompts of the paper's App. G, verbatim (Listings lst:eval-gt and lst:eval-compare).

Line breaks are the listings' own. Placeholders are ``{name}``; they are filled in one pass by
``fill`` (never ``str.format``: the prompts contain literal JSON braces, and an answer that happens
to contain ``{generated}`` must not be substituted again).
"""
from __future__ import annotations

import re

# Listing lst:eval-gt: module (or base) response vs the ground truth, with the context chunk.
TRUTH_PROMPT = (
    'You are an expert evaluator assessing semantic similarity\n'
    "between a model's response and a ground truth answer.\n"
    '\n'
    '<context>\n'
    '{context_chunk}\n'
    '</context>\n'
    '\n'
    '<instruction>\n'
    '{instruction}\n'
    '</instruction>\n'
    '\n'
    '<ground_truth>\n'
    '{ground_truth}\n'
    '</ground_truth>\n'
    '\n'
    '<model_response>\n'
    '{generated}\n'
    '</model_response>\n'
    '\n'
    '{rubric}\n'
    '\n'
    'Follow these evaluation steps:\n'
    '1. Understand what the ground truth is saying.\n'
    '2. Understand what the model response is saying.\n'
    "3. Assess how much of the ground truth's meaning is captured in\n"
    '   the response.\n'
    '4. Assign a score from 1 to 5 based on the criteria above.\n'
    '\n'
    'Output your evaluation as JSON:\n'
    '  {"score": 1 to 5, "reasoning": "brief explanation"}\n'
    'Score guide: 5=same meaning as ground truth, 4=mostly same\n'
    'meaning with minor differences, 3=partially captures the\n'
    'meaning, 2=mostly different, 1=unrelated or contradictory'
)

# The {rubric} of TRUTH_PROMPT, per task type (App. G, "Task-specific rubrics").
RUBRICS = {
    "qa": (
        'Does the response convey the same information as the ground truth? Score based on semantic match, not wording. Additional elaboration should not reduce the score.'
    ),
    "summarization": (
        'Does the response convey the same overall meaning? Different organization, wording, or level of detail is fine. Score based on whether a reader would come away with the same understanding.'
    ),
    "quoting": (
        'Does the response identify and convey the same passage? Score based on whether the same content is captured, not exact wording. Minor word variations or boundary differences are acceptable.'
    ),
    "paraphrasing": (
        'Does the response convey the same meaning? Different wording is expected and should not reduce the score. Score based on whether a reader would understand the same thing from both.'
    ),
}

# Listing lst:eval-compare: module vs base, no context (agreement, not correctness).
COMPARE_PROMPT = (
    'You are an expert evaluator assessing semantic similarity\n'
    'between two model responses.\n'
    '\n'
    '<instruction>\n'
    '{instruction}\n'
    '</instruction>\n'
    '(The instruction refers to a passage from a book. You do not\n'
    'need to verify factual accuracy -- only compare the two\n'
    'responses below.)\n'
    '\n'
    '<response_a>\n'
    '{base_generated}\n'
    '</response_a>\n'
    '\n'
    '<response_b>\n'
    '{generated}\n'
    '</response_b>\n'
    '\n'
    'Would a reader come away with the same understanding from both\n'
    'responses?\n'
    'You are NOT judging correctness -- only whether both responses\n'
    'convey the same meaning.\n'
    'If both make the same mistake, that is FULL AGREEMENT.\n'
    'Different phrasing, level of detail, verbosity, or\n'
    'organization should NOT reduce the score.\n'
    'One response being shorter or longer is fine.\n'
    'Only reduce the score when the two responses would leave a\n'
    'reader with a meaningfully different understanding of the\n'
    'answer.\n'
    "Examples -- score 5: 'played football at New Haven' vs 'Tom\n"
    'was one of the most powerful ends that ever played football at\n'
    "New Haven and was a national figure in college'.\n"
    "Score 3: one says 'football' and the other says 'swimming'.\n"
    'Score 1: completely contradictory or unrelated answers.\n'
    '\n'
    'Follow these evaluation steps:\n'
    '1. Read both responses and understand what each one is saying.\n'
    '2. Ask: would a reader take away the same understanding from\n'
    '   both?\n'
    '3. Ignore differences in length, phrasing, or level of detail.\n'
    '4. Assign a score from 1 to 5 based on semantic similarity.\n'
    '\n'
    'Output your evaluation as JSON:\n'
    '  {"score": 1 to 5, "reasoning": "brief explanation"}\n'
    'Score guide: 5=same meaning, 4=mostly same understanding with\n'
    'minor differences, 3=partially similar, 2=mostly different,\n'
    '1=contradictory or unrelated'
)

_PLACEHOLDER = re.compile(r"\{(context_chunk|instruction|ground_truth|generated|rubric|base_generated)\}")


def fill(template: str, **values: str) -> str:
    """Substitute ``{name}`` placeholders in one pass; a missing value is an error."""
    missing = {m.group(1) for m in _PLACEHOLDER.finditer(template)} - values.keys()
    if missing:
        raise KeyError(f"prompt placeholders without a value: {sorted(missing)}")
    return _PLACEHOLDER.sub(lambda m: values[m.group(1)], template)
