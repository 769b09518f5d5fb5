"""Parsing the judge's reply: ``{"score": 1..5, "reasoning": "..."}``, robustly but never guessed.

Accepted: the JSON object alone, inside a code fence, or surrounded by other text (found by the
one JSON scanner, ``nectar.llm.parsing``: reasoning blocks dropped, trailing commas forgiven); the score as an
int, an integral float (4.0) or a numeric string ("4"); and, for replies cut off mid-JSON (the
judge ran out of tokens), an explicit ``"score": N`` key/value. Everything else — no score key, a
score outside 1..5, a fractional score, or two different scores in one reply — is a parse error,
recorded with the raw reply and counted by the report, never turned into a number.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

from ..llm.parsing import find_all_json

SCORE_MIN, SCORE_MAX = 1, 5

# An explicit "score": N pair; the number must end the value (so "score": 1 to 5, the prompt's own
# format line echoed back, is not read as 1).
_SCORE_KV = re.compile(r'"score"\s*:\s*"?\s*(-?\d+(?:\.\d+)?)\s*"?\s*(?=[,}\n]|$)')
_REASONING_KV = re.compile(r'"reasoning"\s*:\s*"((?:[^"\\]|\\.)*)', re.S)


@dataclass(frozen=True)
class ParsedJudgment:
    score: int | None
    reasoning: str
    error: str | None  # None when score is a valid 1..5 integer


def _as_score(value: object) -> tuple[int | None, str | None]:
    if isinstance(value, bool):  # bool is an int subclass in Python; true/false is not a score
        return None, f"score is a boolean ({value!r}), expected an integer 1..5"
    if isinstance(value, str):
        try:
            value = float(value.strip())
        except ValueError:
            return None, f"score {value!r} is not a number"
    if not isinstance(value, (int, float)):
        return None, f"score {value!r} is not a number"
    if value != int(value):
        return None, f"score {value!r} is not a whole number 1..5"
    score = int(value)
    if not SCORE_MIN <= score <= SCORE_MAX:
        return None, f"score {score} is out of range {SCORE_MIN}..{SCORE_MAX}"
    return score, None


def parse_judgment(text: str | None) -> ParsedJudgment:
    """Parse one judge reply; see the module docstring for what counts as a score."""
    if text is None or not text.strip():
        return ParsedJudgment(None, "", "empty reply")
    objects = find_all_json(text, lambda v: isinstance(v, dict) and "score" in v)  # left to right
    if objects:
        values = {json.dumps(o["score"]) for o in objects}
        if len(values) > 1:
            return ParsedJudgment(None, "", f"reply holds several different scores: {sorted(values)}")
        obj = objects[-1]
        score, err = _as_score(obj["score"])
        reasoning = obj.get("reasoning")
        return ParsedJudgment(score, reasoning if isinstance(reasoning, str) else "", err)
    # No complete JSON object with a score: accept an explicit "score": N (truncated replies).
    hits = {m.group(1) for m in _SCORE_KV.finditer(text)}
    if not hits:
        return ParsedJudgment(None, "", "no JSON object with a \"score\" key in the reply")
    if len(hits) > 1:
        return ParsedJudgment(None, "", f"reply holds several different scores: {sorted(hits)}")
    score, err = _as_score(hits.pop())
    reason = _REASONING_KV.search(text)
    return ParsedJudgment(score, reason.group(1) if reason else "", err)
