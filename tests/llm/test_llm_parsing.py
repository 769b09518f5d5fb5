"""Tolerant JSON extraction: the shapes real models and schema-ignoring servers produce."""
from __future__ import annotations

from nectar.llm.parsing import find_all_json, find_json


def is_pair_list(v):
    return isinstance(v, list) and v and all(isinstance(x, dict) and "instruction" in x for x in v)


def test_plain_json_object():
    assert find_json('{"a": 1}') == {"a": 1}


def test_code_fence_and_prose_around():
    text = 'Sure! Here you go:\n```json\n{"is_consistent": true, "confidence": 0.9}\n```\nHope it helps.'
    assert find_json(text) == {"is_consistent": True, "confidence": 0.9}


def test_paper_form_scratchpad_then_list_with_brackets_inside_scratchpad():
    text = ("<scratchpad>\n- names [identifiers] bind objects\n- scopes {blocks}\n</scratchpad>\n"
            '[{"instruction": "What binds names?", "response": "Binding operations."}] trailing junk ]')
    assert find_json(text, is_pair_list) == [{"instruction": "What binds names?", "response": "Binding operations."}]


def test_think_block_is_ignored():
    text = '<think>maybe {"wrong": 1}</think>{"right": 2}'
    assert find_json(text) == {"right": 2}


def test_trailing_commas_and_python_literals_repaired():
    assert find_json('{"ok": True, "items": [1, 2,],}') == {"ok": True, "items": [1, 2]}
    assert find_json("{'is_consistent': False, 'reasoning': 'it\\'s fine'}") == {
        "is_consistent": False, "reasoning": "it's fine"}


def test_no_json_returns_none():
    assert find_json("no json here, just words") is None
    assert find_json('{"unterminated": "str') is None


def test_salvage_complete_items_of_truncated_list():
    text = ('[{"instruction": "q1", "response": "a1"}, {"instruction": "q2", "response": "a2"}, '
            '{"instruction": "q3", "resp')
    items = find_all_json(text, lambda v: isinstance(v, dict) and "instruction" in v)
    assert items == [{"instruction": "q1", "response": "a1"}, {"instruction": "q2", "response": "a2"}]


def test_raw_control_character_inside_a_string_is_kept():
    # xgrammar's JSON grammar lets a byte-level token such as \x17 into a string
    assert find_json('{"reasoning": "a\x17b", "ok": true}') == {"reasoning": "a\x17b", "ok": True}
