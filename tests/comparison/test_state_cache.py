"""The fitted-state cache of ``nectar compare`` and the document panel (compose.fit_part's ``cache_dir``):
a later fit with the same settings reuses the file, and a system whose definition changed under the same
name (as ``recon_first@int4`` gained its fit cap, issue 39) is fitted again — "cached" must mean still
correct."""
from __future__ import annotations

import dataclasses
import os

import pytest

from nectar import orchestration
from nectar.attention.doc_kv import prefill_document
from nectar.comparison import compose
from nectar.comparison.systems import SYSTEMS
from nectar.layout import build_layout
from nectar.orchestration.context import load_base
from nectar.schemas import load_config

from sample_document import DOC


@pytest.fixture(scope="module")
def part(tmp_path_factory):
    root = tmp_path_factory.mktemp("state-cache")
    (root / "doc.txt").write_text(DOC)
    ctx = orchestration.prepare_run(str(root / "doc.txt"), load_config("tiny"), str(root / "run"))
    base = load_base(ctx.config)
    layout = build_layout(base.tokenizer, ctx.text)
    return compose.Part(ctx, "doc", layout, prefill_document(base, layout.context_ids)), base


def test_a_cached_state_is_reused_and_a_redefined_system_is_fitted_again(part, tmp_path, monkeypatch):
    part, base = part
    system, cache = SYSTEMS["recon_first@int4"], str(tmp_path)
    fits = []
    real = compose._fit_part
    monkeypatch.setattr(compose, "_fit_part", lambda *a, **k: fits.append(a[1].options) or real(*a, **k))
    first = compose.fit_part(part, system, 0.1, base, cache)
    again = compose.fit_part(part, system, 0.1, base, cache)
    assert len(fits) == 1 and again.nbytes == first.nbytes and len(os.listdir(cache)) == 1
    # the same name, another definition (the cap lifted): a new file, fitted again
    redefined = dataclasses.replace(system, options={**system.options, "fit_keys": None})
    compose.fit_part(part, redefined, 0.1, base, cache)
    assert len(fits) == 2 and len(os.listdir(cache)) == 2
    assert compose.fit_digest(part, system) != compose.fit_digest(part, redefined)


def test_a_setting_added_later_keeps_states_cached_before_it_while_at_its_default(part):
    """``lr_schedule`` came after the first state's cached files: at its default ("constant") the digest reads
    the settings as before it existed (the same file name), and at "cosine" it names another state."""
    part, base = part
    first = SYSTEMS["recon_first@int4"]
    cosine = dataclasses.replace(first, options={**first.options, "lr_schedule": "cosine"})
    method = compose._configured_method(part, first)
    before = {k: v for k, v in dataclasses.asdict(method).items() if k != "lr_schedule"}  # the fields it had
    assert compose.method_settings(method) == before
    assert compose.method_settings(compose._configured_method(part, cosine))["lr_schedule"] == "cosine"
    assert compose.fit_digest(part, first) != compose.fit_digest(part, cosine)


def test_a_benchmark_variant_is_its_base_with_the_options_over_it():
    """systems.register_variant (benchmarks/refine_steps.py, refine_schedule.py): the base's method, bits and
    settings with the given ones over them, opt-in, registered once (a second call returns the same name)."""
    from nectar.comparison.systems import register_variant

    name = register_variant("recon_first@int4", "recon_first_test_variant@int4", " (a test)", lr=2e-3)
    assert register_variant("recon_first@int4", name, " (again)", lr=9.0) == name
    base, v = SYSTEMS["recon_first@int4"], SYSTEMS[name]
    assert (v.method, v.bits, v.default) == (base.method, base.bits, False)
    assert v.options == {**base.options, "lr": 2e-3} and v.description == base.description + " (a test)"
