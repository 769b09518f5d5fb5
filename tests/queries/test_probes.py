"""Document probes: verbatim responses, disjoint train / held-out positions, coverage of the
document, determinism, and the held-out token count on the embedded default document."""
import re

import pytest

from nectar.schemas.config import ProbesConfig
from nectar.queries.probes import (CONTINUE, held_out_units, make_probes, probe_dataset_rows,
                                  split_units)

TEXT = """Resolution of names
===================

A *scope* defines the visibility of a name within a block.  If a local
variable is defined in a block, its scope includes that block.

When a name is used in a code block, it is resolved using the nearest
enclosing scope.  The set of all such scopes visible to a code block
is called the block's *environment*.

The following constructs bind names:

* formal parameters to functions,

* class definitions,

When a name is not found at all, a "NameError" exception is raised. If
the current scope is a function scope, and the name refers to a local
variable that has not yet been bound to a value at the point where the
name is used, an "UnboundLocalError" exception is raised.
""" * 4


def test_units_are_exact_slices_in_document_order():
    units = split_units(TEXT)
    assert len(units) > 20
    for u in units:
        assert TEXT[u.start:u.end] == u.text and u.text == u.text.strip()
    assert all(a.end <= b.start for a, b in zip(units, units[1:]))
    # a wrapped sentence stays one unit; a heading and a list item are units of their own
    assert any(u.text.startswith("If a local\nvariable is defined") for u in units)
    assert "* class definitions," in [u.text for u in units]


def test_responses_are_verbatim_and_instructions_quote_the_document():
    cfg = ProbesConfig()
    units = split_units(TEXT)
    for p in make_probes(TEXT, cfg):
        assert p.response in TEXT
        if p.kind == "continue":
            prompt = units[p.first_unit].text
            assert p.instruction == CONTINUE.format(text=prompt)
            assert TEXT.index(p.response, units[p.first_unit + 1].start) == units[p.first_unit + 1].start
            assert len(p.response.split()) >= cfg.min_response_words
        else:
            phrase = re.search("«(.*)»", p.instruction).group(1)
            unit = units[p.first_unit]
            assert p.response == unit.text and phrase in " ".join(unit.text.split())
            assert " ".join(TEXT.split()).count(phrase) == 1  # it names exactly one place


def test_train_and_held_out_positions_are_disjoint_and_cover_the_document():
    cfg = ProbesConfig(held_out_fraction=0.4, block_units=3)
    units = split_units(TEXT)
    held = held_out_units(len(units), cfg)
    assert 0 < len(held) < len(units)
    probes = make_probes(TEXT, cfg)
    spans = {s: set() for s in ("train", "probes")}
    for p in probes:
        spans[p.split].update(range(p.first_unit, p.last_unit + 1))
    assert spans["probes"] and spans["train"] and not spans["probes"] & spans["train"]
    assert spans["probes"] <= held and not spans["train"] & held
    # together the two sets use most of the document (lost: probes straddling a block edge, and units
    # too short to prompt or answer, such as one-line list items)
    assert len(spans["probes"] | spans["train"]) >= 0.7 * len(units)


def test_probes_are_deterministic_and_seeded():
    a, b = make_probes(TEXT, ProbesConfig()), make_probes(TEXT, ProbesConfig())
    assert a == b
    c = make_probes(TEXT, ProbesConfig(seed=3))
    assert [p.split for p in a] != [p.split for p in c]


def test_held_out_probes_never_become_training_rows():
    probes = make_probes(TEXT, ProbesConfig())
    only_held = probe_dataset_rows(probes, include_train=False)
    assert only_held and all(r.split == "probes" and r.verdict == "probe" for r in only_held)
    both = probe_dataset_rows(probes, include_train=True)
    assert {r.split for r in both} == {"train", "probes"}
    held_ids = {p.probe_id for p in probes if p.split == "probes"}
    assert all(r.split == "probes" for r in both if r.pair_id in held_ids)


@pytest.mark.slow
def test_the_default_document_gives_at_least_1500_held_out_response_tokens(smollm2):
    from nectar.documents import load_document
    from nectar.layout import build_layout

    text, _ = load_document("pydoc:naming")
    layout = build_layout(smollm2.tokenizer, text)
    tokens = 0
    for p in make_probes(text, ProbesConfig()):
        if p.split == "probes":
            q = layout.pair(p.instruction, p.response)
            tokens += len(q.ids) - q.response_start
    assert tokens >= 1500
