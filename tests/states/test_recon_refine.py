"""recon_refine on the tiny random model: the steps see the state as stored, lower the spans' KL, keep the
bytes and the masked slots, and fall back to the fit when they do not help."""
import dataclasses
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent.parent / "training"))
from targets_fixture import DOC  # noqa: E402

from nectar.modules import plan_module  # noqa: E402
from nectar.modules.stored import quantize_module_, stored_nbytes  # noqa: E402
from nectar.schemas.config import ProbesConfig, ReconConfig  # noqa: E402
from nectar.states import get_method  # noqa: E402
from nectar.states.interface import FitInputs  # noqa: E402
from nectar.states.recon_refine import ReconRefine, refine, span_batches, span_kl, with_teacher  # noqa: E402

RECON = ReconConfig(span_words=12, withheld_fraction=0.0)
PROBES = ProbesConfig(block_units=1)
FIRST = {"fit_queries": "recon", "score_queries": "recon"}


def _fit(tiny, steps, rho=0.05, lr=3e-2):
    base, layout, kv, spans = tiny
    plan = plan_module("quadrature", base.num_layers, base.num_kv_heads, base.head_dim, layout.n, base.scaling, rho)
    method = get_method("recon_refine").with_options(**FIRST, steps=steps, lr=lr, batch_tokens=512)
    inputs = FitInputs(kv, None, base=base, layout=layout, document=DOC, spans=spans, bits=4)
    return method.fit(plan, inputs)


def test_settings_split_between_the_fit_and_the_steps():
    m = get_method("recon_refine").with_options(steps=7, fit_keys=64)
    assert isinstance(m, ReconRefine) and (m.steps, m.fit_keys) == (7, 64)
    assert "steps" not in m.select.model_dump() and m.select.fit_keys == 64
    with pytest.raises(ValueError, match="set fit=true"):
        get_method("recon_refine").with_options(fit=False).fit(None, None)


def _damaged(module, factor=30.0):
    """The fitted state with its values scaled (kept on the grid): the tiny random model barely reads its
    document, so the fit is already at the full model's KL (~1e-9); a damaged state gives the steps room."""
    with torch.no_grad():
        for layer in module.layers:
            layer.Z.mul_(factor)
    return quantize_module_(module)


def test_steps_lower_the_spans_kl_and_keep_the_stored_state(tiny):
    base, layout, kv, spans = tiny
    fitted = _fit(tiny, steps=0)
    masked = [torch.isinf(layer.beta).clone() for layer in fitted.module.layers]
    module = _damaged(fitted.module)
    batches = with_teacher(base, kv, layout.n, span_batches(layout, list(spans), 512), 16)
    start = {k: v.clone() for k, v in module.state_dict().items()}
    module, facts = refine(base, module, layout.n, batches, steps=10, lr=5e-2)
    assert facts["span_kl_refined"] < 0.8 * facts["span_kl_fit"], facts  # toward the full model
    assert facts["span_kl_refined"] == pytest.approx(span_kl(base, module, layout.n, batches))
    assert any(not torch.equal(start[k], v) for k, v in module.state_dict().items())
    for m, layer in zip(masked, module.layers):
        assert torch.equal(m, torch.isinf(layer.beta))  # masked slots stay masked (no NaN, no new pairs)
        assert not any(torch.isnan(x).any() for x in (layer.beta, layer.W, layer.Z))
    # what the module holds is on its storage grid: rounding it again moves nothing by a step (a code flip
    # moves a value by ~1/15 of its row's range; the tolerance only absorbs a scale recomputed an ulp apart)
    again = {k: v.clone() for k, v in module.state_dict().items()}
    quantize_module_(module)
    for k, v in module.state_dict().items():
        torch.testing.assert_close(v, again[k], rtol=1e-5, atol=1e-3)
    assert stored_nbytes(module, fitted.plan) == fitted.nbytes  # the same pairs, the same bytes


def test_the_method_fits_then_steps(tiny):
    """recon_refine through the registry: recon_fit's state (the same bytes) after its steps."""
    fitted, refined = _fit(tiny, steps=0), _fit(tiny, steps=2)
    assert refined.name == "recon_refine" and refined.nbytes == fitted.nbytes
    assert refined.plan.quad_head_pairs == fitted.plan.quad_head_pairs


def test_steps_that_raise_the_spans_kl_fall_back_to_the_fit(tiny):
    """Failure injection: a rate far too large makes the steps worse on the spans; the fit's state stays."""
    base, layout, kv, spans = tiny
    fitted = _fit(tiny, steps=0)
    batches = with_teacher(base, kv, layout.n, span_batches(layout, list(spans), 512), 16)
    start = {k: v.clone() for k, v in fitted.module.state_dict().items()}
    module, facts = refine(base, fitted.module, layout.n, batches, steps=3, lr=1e3)
    assert facts["span_kl_refined"] > facts["span_kl_fit"]
    assert all(torch.equal(start[k], v) for k, v in module.state_dict().items())


def test_the_cosine_schedule_warms_up_then_decays_to_zero():
    from nectar.states.recon_refine import lr_factor

    assert [lr_factor("constant", i, 40) for i in (0, 20, 39)] == [1.0, 1.0, 1.0]
    rates = [lr_factor("cosine", i, 40) for i in range(40)]  # warm-up: 5 % of 40 steps = 2
    assert rates[:2] == [0.5, 1.0] and rates[-1] == pytest.approx(0.0, abs=1e-12)
    assert all(a > b for a, b in zip(rates[1:], rates[2:]))  # decays every step after the warm-up
    assert sum(rates) / 40 == pytest.approx(0.5, abs=0.05)  # the mean rate is about half the peak
    assert lr_factor("cosine", 0, 1) == 1.0  # one step: the warm-up's only step, at the peak
    with pytest.raises(ValueError, match="lr_schedule 'linear'"):
        lr_factor("linear", 0, 10)


def test_the_steps_follow_the_schedule_and_it_keys_the_cache(tiny, monkeypatch):
    """refine sets Adam's rate at every step from the schedule (the rates the steps used, read from the
    optimizer as each step runs) and still lowers the spans' KL; a cosine refinement is its own cache
    entry, the constant rate stays out of the key (states made before the setting stay valid)."""
    from nectar.schemas.config import RefineConfig
    from nectar.states.recon_refine import lr_factor

    base, layout, kv, spans = tiny
    module = _damaged(_fit(tiny, steps=0).module)
    batches = with_teacher(base, kv, layout.n, span_batches(layout, list(spans), 512), 16)
    used = []
    real_step = torch.optim.Adam.step

    def recording_step(opt, *a, **k):  # what the optimizer ran each step with
        used.append(opt.param_groups[0]["lr"])
        return real_step(opt, *a, **k)

    monkeypatch.setattr(torch.optim.Adam, "step", recording_step)
    module, facts = refine(base, module, layout.n, batches, steps=10, lr=5e-2, schedule="cosine")
    assert used == pytest.approx([5e-2 * lr_factor("cosine", i, 10) for i in range(10)])
    assert facts["span_kl_refined"] < facts["span_kl_fit"], facts  # half the constant rate's mean: less, still lower
    assert "lr_schedule" not in RefineConfig(steps=3).cache_dict()
    assert RefineConfig(steps=3, lr_schedule="cosine").cache_dict()["lr_schedule"] == "cosine"
    method = get_method("recon_refine").with_options(lr_schedule="cosine")
    assert method.refine_config.lr_schedule == "cosine"


def test_the_compare_system_is_the_first_states_selection_refined():
    """``recon_first_refined@int4`` = the first stage's selection and then the method's steps at every budget;
    ``recon_first@int4`` = the first stage's state: the same steps where keys are scarce (``when: auto``), its
    default, and part of its cache key (first states made before the default are made again)."""
    from nectar.comparison.systems import SYSTEMS
    from nectar.schemas.config import FIRST_REFINE, FIRST_REFINE_PER_TOKENS, FirstConfig, RefineConfig, SelectionConfig
    from nectar.states.recon_refine import REFINE_STEPS

    method = ReconRefine.from_select(SelectionConfig()).with_options(**SYSTEMS["recon_first_refined@int4"].options)
    assert method.select == FirstConfig().select and method.refine_config == RefineConfig(steps=REFINE_STEPS)
    first = ReconRefine.from_select(SelectionConfig()).with_options(**SYSTEMS["recon_first@int4"].options)
    assert SYSTEMS["recon_first@int4"].method == "recon_refine"
    assert first.select == FirstConfig().select and first.refine_config == FirstConfig().refine == FIRST_REFINE
    assert FIRST_REFINE == RefineConfig(steps=REFINE_STEPS, when="auto", per_tokens=FIRST_REFINE_PER_TOKENS)
    assert first.per_tokens == FIRST_REFINE_PER_TOKENS and method.per_tokens == 0  # every budget: fixed steps
    assert FirstConfig().cache_dict()["refine"]["when"] == "auto"
    # a partial override changes that setting of the first state's refinement, not of RefineConfig()
    assert FirstConfig(refine={"steps": 5}).refine == FIRST_REFINE.model_copy(update={"steps": 5})
    assert FirstConfig(refine={"steps": 5}).cache_dict()["refine"]["steps"] == 5
    assert "when" not in RefineConfig(steps=3).cache_dict()  # train.end_to_end: "always", as before
    assert "per_tokens" not in RefineConfig(steps=3).cache_dict()  # fixed steps, as before
    assert FirstConfig().cache_dict()["refine"]["per_tokens"] == FIRST_REFINE_PER_TOKENS
    fit = SYSTEMS["recon_first_fit@int4"]  # the fit the first stage publishes before its steps
    assert fit.method == "recon_fit" and get_method("recon_fit").with_options(**fit.options).select == first.select


def test_auto_refines_only_where_keys_are_scarce():
    from nectar.modules.builder import ModulePlan
    from nectar.schemas.config import RefineConfig
    from nectar.states.recon_refine import refines

    def plan(pairs):  # 2 layers × 2 KV heads
        return ModulePlan("quadrature", 2, 2, 8, 100, 0.35, 0.1, (0.1, 0.1), (1,) * 4,
                          quad_pairs=tuple(max(h) for h in pairs), quad_head_pairs=pairs)

    auto, always = RefineConfig(steps=3, when="auto"), RefineConfig(steps=3)
    five_percent = ((5, 5), (2, 8))  # 20 of 400 entries: at GREEDY_SHARE
    over = ((5, 5), (2, 9))  # 21 of 400
    assert refines(auto, plan(five_percent), 100) and not refines(auto, plan(over), 100)
    assert refines(always, plan(over), 100) and not refines(RefineConfig(steps=0), plan(five_percent), 100)
    uniform = ModulePlan("quadrature", 2, 2, 8, 100, 0.35, 0.1, (0.1, 0.1), (1,) * 4, quad_pairs=(5, 5))
    assert refines(auto, uniform, 100)  # no per-head widths: every head holds its layer's pairs (20 of 400)
    assert not refines(auto, dataclasses.replace(uniform, quad_pairs=(5, 6)), 100)


def test_the_steps_grow_with_the_document_only_past_per_tokens():
    from nectar.schemas.config import FIRST_REFINE, RefineConfig
    from nectar.states.recon_refine import step_count

    assert [step_count(RefineConfig(steps=200), n) for n in (1528, 8917)] == [200, 200]  # per_tokens 0: fixed
    scaled = RefineConfig(steps=200, per_tokens=4500)
    assert [step_count(scaled, n) for n in (10, 1528, 4500, 4501, 5257, 8917)] == [200, 200, 200, 201, 234, 397]
    assert step_count(FIRST_REFINE, 1528) == FIRST_REFINE.steps  # the default document: its 200 steps
    with pytest.raises(ValueError):
        RefineConfig(per_tokens=-1)


def test_a_longer_document_than_per_tokens_takes_more_steps(tiny):
    """refine_fitted runs ``step_count`` steps: per_tokens a third of the tiny document's tokens, 1 step → 3
    (the bar's total and the counts say so)."""
    import math

    from nectar.schemas.config import RefineConfig
    from nectar.states.recon_refine import refine_fitted

    base, layout, kv, spans = tiny
    cfg = RefineConfig(steps=1, batch_tokens=512, topk=16, per_tokens=math.ceil(layout.n / 3))
    seen, timings = [], {}
    refine_fitted(base, layout, kv, list(spans), _fit(tiny, steps=0), cfg, timings=timings,
                  progress=lambda i, total: seen.append((i, total)))
    assert seen == [(1, 3), (2, 3), (3, 3)] and timings["refine_steps"] == 3


def test_the_first_stage_publishes_the_fit_then_refines_where_keys_are_scarce(tiny, tmp_path):
    """At ~5 % of the entries kept the default ``first.refine`` (when: auto) steps after ``on_fitted`` saw the
    fitted state written and loadable; at ~25 % it does not step and ``on_fitted`` is never called."""
    from nectar.modules.io import load_module
    from nectar.schemas.config import FirstConfig, ModuleConfig
    from nectar.stages.first import first_state

    base, layout, kv, spans = tiny
    cfg = FirstConfig(refine={"steps": 2, "batch_tokens": 512})
    seen, done = [], []

    def on_fitted(counts):
        module, spec = load_module(str(tmp_path / "scarce"), base, "0" * 64)  # on disk, complete, before the steps
        seen.append((counts, spec.module_bytes, {k: v.clone() for k, v in module.state_dict().items()}))

    counts = first_state(base, DOC, cfg, ModuleConfig(arch="quadrature", rho=0.01, bias=True, bits=4), RECON, PROBES,
                         "0" * 64, str(tmp_path / "scarce"), on_fitted=on_fitted,
                         progress=lambda i, total: done.append((i, total)))
    assert len(seen) == 1 and seen[0][0]["refined"] is False and "refine_s" not in seen[0][0]
    assert counts["refined"] is True and counts["refine_s"] > 0 and counts["kept_share"] <= 0.05
    assert seen[0][1] == counts["module_bytes"] and done == [(1, 2), (2, 2)]  # the same bytes; a bar per step
    plenty = first_state(base, DOC, cfg, ModuleConfig(arch="quadrature", rho=0.05, bias=True, bits=4), RECON, PROBES,
                         "0" * 64, str(tmp_path / "plenty"), on_fitted=lambda c: seen.append(c))
    assert plenty["refined"] is False and "refine_s" not in plenty and plenty["kept_share"] > 0.05 and len(seen) == 1


def test_the_first_stage_refines_when_asked(tiny, tmp_path):
    from nectar.modules.io import load_module
    from nectar.schemas.config import FirstConfig, ModuleConfig
    from nectar.stages.first import first_state

    base, layout, kv, spans = tiny
    module_cfg = ModuleConfig(arch="quadrature", rho=0.05, bias=True, bits=4)
    plain = first_state(base, DOC, FirstConfig(refine={"steps": 0}), module_cfg, RECON, PROBES, "0" * 64,
                        str(tmp_path / "a"))
    assert "refine_s" not in plain
    counts = first_state(base, DOC, FirstConfig(refine={"steps": 2, "batch_tokens": 512, "when": "always"}), module_cfg,
                         RECON, PROBES,
                         "0" * 64, str(tmp_path / "b"))
    assert counts["refine_s"] > 0 and counts["span_kl_refined"] >= 0 and counts["module_bytes"] == plain["module_bytes"]
    module, spec = load_module(str(tmp_path / "b"), base, "0" * 64)
    assert spec.module_bytes == plain["module_bytes"]
