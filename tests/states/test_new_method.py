"""A state method written in this file against the interface alone (nectar/states/interface.py) —
"keep the exact KV of the document's last p tokens" — registered at test time, is fitted on the
tiny model, scored by ``nectar compare``'s own machinery on a tiny run, and served: saved as a
module, loaded back as the server's loader does and asked a question (docs/architecture.md,
"Adding a state method")."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest
import torch

from nectar import comparison
from nectar.comparison.jobs import baseline_plan
from nectar.comparison.systems import SYSTEMS, System
from nectar.modules.budget import pairs_in_bytes
from nectar.modules.builder import ModulePlan, build_module
from nectar.modules.io import load_module, make_spec, save_module
from nectar.modules.stored import quantize_module_
from nectar.orchestration.context import load_base, load_run_doc_kv
from nectar.schemas.renamed import renamed
from nectar.states import METHODS, FitInputs, FittedState, StateMethod, get_method, register, unregister

from hand_written_run import QA as QUESTIONS, run_with_targets


@dataclass(frozen=True)
class KeepLast(StateMethod):
    """The exact KV of the last p context tokens in every layer, p what the bytes buy per head."""

    share: float = 1.0  # of the budget's pairs kept (a setting: the dataclass field)

    name = "keep_last"
    READS = frozenset({"doc_kv"})

    def plan(self, plan: ModulePlan, bits: int | None = None) -> ModulePlan:
        bits = plan.bits if bits is None else bits
        head_bytes = 4 * sum(plan.budgets) // plan.num_layers
        p = max(1, min(plan.n_context, int(self.share * pairs_in_bytes(head_bytes, plan.head_dim, False, bits,
                                                                       plan.quant_group))))
        return dataclasses.replace(plan, arch="quadrature", quad_pairs=(p,) * plan.num_layers, mlp_widths=(),
                                   quad_bias=False, bits=bits)

    def fit(self, plan: ModulePlan, inputs: FitInputs) -> FittedState:
        qplan = self.plan(plan, inputs.bits)
        module = build_module(qplan)
        with torch.no_grad():
            for layer, net in enumerate(module.layers):
                p = qplan.quad_pairs[layer]
                keys = inputs.doc_kv.keys[layer].detach().float().cpu()[:, -p:]
                values = inputs.doc_kv.values[layer].detach().float().cpu()[:, -p:]
                net.set_pairs(keys, values, None)
        return FittedState(self.name, quantize_module_(module).eval(), qplan)


# six of the hand-written pairs, four of them train
QA = [QUESTIONS[i] for i in (0, 1, 2, 3, 5, 6)]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A tiny run with targets (chunk, a verified dataset written by hand, targets)."""
    return run_with_targets(tmp_path_factory.mktemp("newmethod"), "tiny",
                            ["evaluate.bootstrap_resamples=100", "evaluate.agreement_new_tokens=4",
                             "evaluate.agreement_max_samples=0"], qa=QA, n_train=4)


@pytest.fixture
def keep_last():
    """Registered the way docs/architecture.md says: the method, and a compare system naming it."""
    method = register(KeepLast())
    system = comparison.register(System("keep_last", "method", "exact KV of the last tokens", method="keep_last"))
    yield method, system
    unregister(method.name)
    del SYSTEMS[system.name]


def test_a_method_written_against_the_interface_is_fitted_compared_and_served(tiny_run, keep_last, tmp_path):
    ctx = tiny_run
    assert get_method("keep_last") is METHODS["keep_last"]
    # fitted on the tiny model, in the bytes of the run's module plan
    base = load_base(ctx.config)
    doc_kv = load_run_doc_kv(ctx)
    plan = baseline_plan(ctx, 0.2)
    fitted = get_method("keep_last").fit(plan, FitInputs(doc_kv))
    p = fitted.plan.quad_pairs[0]
    assert 1 <= p < doc_kv.n and fitted.nbytes <= 4 * plan.num_kv_heads * sum(plan.budgets) * 1.01
    torch.testing.assert_close(fitted.module.layers[0].W, doc_kv.keys[0][:, -p:].float().cpu())
    # compared by nectar compare's machinery, beside the reference and a built-in method at the same bytes
    res = comparison.compare(ctx, ["none", "full", "truncate", "keep_last"], rhos=[0.2],
                             run_one=lambda c, stage, force: None)
    by = {(r.system, r.split): r for r in res.rows}
    row = by[("keep_last", "test")]
    assert row.kind == "method" and row.state_bytes == fitted.nbytes
    assert 0 < row.kl_to_full < by[("none", "test")].kl_to_full
    assert row.train_seconds is not None and row.train_seconds > 0  # its fit, timed as every method's
    assert "| keep_last | method |" in res.markdown
    # a setting is a dataclass field: half the share keeps (about) half the pairs
    assert get_method("keep_last").with_options(share=0.5).plan(plan).quad_pairs[0] in (p // 2, (p + 1) // 2)
    # served: saved as a module, loaded as the server's loader does, asked a question
    from nectar.layout import build_layout
    from nectar.serving.ask import answer

    spec = make_spec(fitted.module, fitted.plan, base.name, base.weights_hash, ctx.info.sha256, base.num_q_heads)
    save_module(fitted.module, spec, str(tmp_path / "state"))
    module, loaded = load_module(str(tmp_path / "state"), base, ctx.info.sha256, device=base.device)
    assert loaded.module_bytes == spec.module_bytes
    out = answer(base, module, build_layout(base.tokenizer, ctx.text), loaded.n_context, "Who bought the island?",
                 max_new_tokens=4)
    assert len(out.token_ids) >= 1 and out.n_context == doc_kv.n


def test_an_old_name_is_read_as_the_new_one_in_one_line(capsys):
    capsys.readouterr()
    assert renamed("system", "kvzip_fit_template@int4") == "recon_fit_template@int4"
    assert renamed("system", "kvzip_fit_template@int4") == "recon_fit_template@int4"  # said once
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'kvzip_fit_template@int4' is read as 'recon_fit_template@int4' (renamed;" in err
    assert renamed("system", "kvpress:kvzip:int4") == "kvpress:kvzip:int4"  # kvpress's KVzip keeps its name
    assert get_method("kvzip") is METHODS["recon_fit"]
    assert get_method("kvpress:kvzip:int4").press == "kvzip"
