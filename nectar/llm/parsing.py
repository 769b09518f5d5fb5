"""Tolerant JSON extraction from model output.

Servers that ignore the requested schema (``transformers serve``; vLLM without a grammar backend)
and small models wrap JSON in prose, code fences, ``<think>`` blocks, scratchpads and trailing junk,
or emit Python-style literals and trailing commas. These helpers find the JSON value anyway, or
return None: callers record the failure, they never crash on it.
"""
from __future__ import annotations

import json
import re
from typing import Any, Callable, Iterator

_THINK = re.compile(r"<think>.*?(</think>|$)", re.DOTALL)
_FENCE = re.compile(r"```(?:json|JSON)?\s*\n?(.*?)(?:```|$)", re.DOTALL)
_TRAILING_COMMA = re.compile(r",\s*([}\]])")
_PY_LITERALS = re.compile(r"\b(True|False|None)\b")
# strict=False: a raw control character inside a string (xgrammar's JSON grammar lets byte-level
# tokens such as \x17 through) is kept rather than failing the whole value.
_DECODER = json.JSONDecoder(strict=False)


def strip_reasoning(text: str) -> str:
    """Drop ``<think>…</think>`` blocks (Qwen3 and other reasoning models)."""
    return _THINK.sub("", text)


def find_json(text: str, accept: Callable[[Any], bool] = lambda v: True) -> Any | None:
    """The first JSON object/array in ``text`` (fenced blocks first) for which ``accept`` is true."""
    text = strip_reasoning(text)
    for source in [*(m.group(1) for m in _FENCE.finditer(text)), text]:
        for value, _ in iter_json_values(source):
            if accept(value):
                return value
    return None


def find_all_json(text: str, accept: Callable[[Any], bool]) -> list[Any]:
    """Every non-overlapping JSON value in ``text`` that ``accept`` likes, left to right.

    Used to salvage the complete items of a list that was cut off by the token limit.
    """
    out, pos = [], 0
    text = strip_reasoning(text)
    while pos < len(text):
        found = next(((v, s, e) for v, (s, e) in _values_from(text, pos) if accept(v)), None)
        if found is None:
            break
        out.append(found[0])
        pos = found[2]
    return out


def iter_json_values(text: str) -> Iterator[tuple[Any, tuple[int, int]]]:
    for value, span in _values_from(text, 0):
        yield value, span


def _values_from(text: str, start: int) -> Iterator[tuple[Any, tuple[int, int]]]:
    """Each JSON value that starts at a '{' or '[' at or after ``start`` (outermost first)."""
    for m in re.finditer(r"[\[{]", text[start:]):
        i = start + m.start()
        try:
            value, end = _DECODER.raw_decode(text, i)
            yield value, (i, end)
            continue
        except json.JSONDecodeError:
            pass
        repaired = _repair(text, i)
        if repaired is not None:
            yield repaired


def _repair(text: str, i: int) -> tuple[Any, tuple[int, int]] | None:
    """Retry the balanced span at ``i`` with trailing commas and Python literals fixed."""
    end = _balanced_end(text, i)
    if end is None:
        return None
    span = text[i:end]
    fixed = _TRAILING_COMMA.sub(r"\1", span)
    fixed = _PY_LITERALS.sub(lambda m: {"True": "true", "False": "false", "None": "null"}[m.group(1)], fixed)
    for candidate in (fixed, _single_to_double_quotes(fixed)):
        try:
            return json.loads(candidate), (i, end)
        except json.JSONDecodeError:
            continue
    return None


def _balanced_end(text: str, i: int) -> int | None:
    """Index after the bracket closing the one at ``i`` (string-aware), or None if unbalanced."""
    depth, quote, escaped = 0, None, False
    for j in range(i, len(text)):
        ch = text[j]
        if quote:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == quote:
                quote = None
        elif ch in "\"'":
            quote = ch
        elif ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
            if depth == 0:
                return j + 1
    return None


def _single_to_double_quotes(span: str) -> str:
    """{'a': 'it\\'s'} → {"a": "it's"}: only when no double quotes are present (else ambiguous)."""
    if '"' in span:
        return span
    placeholder = "\x00"
    return span.replace("\\'", placeholder).replace("'", '"').replace(placeholder, "'")
