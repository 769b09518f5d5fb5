"""ROUGE-L (Lin, 2004): the longest common subsequence of two texts' word tokens.

    R = LCS / |reference|,   P = LCS / |candidate|,   F = 2PR / (P + R)

Tokens are maximal runs of letters and digits, lower-cased (what the reference ``rouge_score``
package does, without stemming, but keeping non-ASCII letters). Two empty texts are identical
(F = 1); one empty text shares nothing with the other (F = 0).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

_WORD = re.compile(r"[^\W_]+")


def rouge_tokens(text: str) -> list[str]:
    return _WORD.findall(text.lower())


def lcs_length(a: list[str], b: list[str]) -> int:
    """Length of the longest common subsequence: O(|a|·|b|) time, O(|b|) memory."""
    if len(a) < len(b):
        a, b = b, a
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1]


@dataclass(frozen=True)
class RougeL:
    precision: float
    recall: float
    f1: float


def rouge_l(candidate: str, reference: str) -> RougeL:
    c, r = rouge_tokens(candidate), rouge_tokens(reference)
    if not c and not r:
        return RougeL(1.0, 1.0, 1.0)
    if not c or not r:
        return RougeL(0.0, 0.0, 0.0)
    lcs = lcs_length(c, r)
    p, rec = lcs / len(c), lcs / len(r)
    f = 0.0 if lcs == 0 else 2 * p * rec / (p + rec)
    return RougeL(p, rec, f)
