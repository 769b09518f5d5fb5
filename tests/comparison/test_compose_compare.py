"""``nectar compare RUN_A RUN_B``: states of two documents composed, scored against the concatenation
(nectar/comparison/compose.py), on the tiny model with runs that hold only their documents."""
import json

import pytest

from nectar import orchestration
from nectar.comparison.compose import compare_composed, composed_prompts, open_runs
from nectar.comparison.inputs import CompareInputError
from nectar.schemas import ComparisonRow, load_config
from nectar.tables import read_table

DOC_A = ("The lighthouse keeper of Varn Island kept a ledger of every ship that passed the northern reef. "
         "In the winter of 1871 the schooner Meridian ran aground, and the keeper rowed out twice to bring "
         "its seven sailors ashore through the freezing spray. The ledger records that the Meridian carried "
         "salt cod and barrels of lamp oil from Bergen. Her captain, Ilse Brandt, later bought the island "
         "with the salvage money and built a second lamp on the southern cliff. The keeper's daughter "
         "painted both lamps red in the spring of 1880 so that fishermen could tell them apart at dusk.\n\n"
         "A storm in 1884 broke the northern lamp, and for three winters only the southern cliff was lit. ")
DOC_B = ("The amendment of 1902 moved the ledger to the harbour office at Kell, where clerk Oskar Lind "
         "copied every page twice a year. One copy went by mail boat to the archive in Tromsø, the other "
         "stayed in a locked oak chest under the harbour master's desk. Lind added a column for the weather "
         "at each passing, which the old keeper had never recorded. In 1911 a fire in the harbour office "
         "burned the oak chest, but the Tromsø copy survived and is read there today by visiting historians.\n\n"
         "The amendment also required every captain to sign the ledger in person when landing at Kell. ")


def _run(root, name, text, model="tiny:llama"):
    path = root / f"{name}.txt"
    path.write_text(text)
    config = load_config("tiny", overrides=["evaluate.bootstrap_resamples=200", f"model.name={model}",
                                            "targets.probes.min_response_words=6", "targets.probes.block_units=1"])
    return orchestration.prepare_run(str(path), config, str(root / name)).run.root


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("compose")
    return _run(root, "varn", DOC_A), _run(root, "kell", DOC_B)


def test_prompts_read_each_document_and_both(two_runs):
    ctxs = open_runs(list(two_runs))
    prompts = composed_prompts([("a", DOC_A), ("b", DOC_B)], ctxs[0], per_doc=50, both=3)
    splits = {s for p in prompts for s in p.splits}
    assert {"probes", "probes:a", "probes:b", "both"} <= splits
    both = [p for p in prompts if p.task == "both"]
    assert len(both) == 3
    for p in both:  # needs a sentence of each document, in either order
        first, second = p.response.split("\n", 1)
        assert (first in DOC_A and second in DOC_B) or (first in DOC_B and second in DOC_A)


@pytest.mark.slow
def test_compare_composed_writes_rows_for_every_layout_and_part(two_runs, tmp_path):
    out = tmp_path / "out"
    res = compare_composed(list(two_runs), str(out), ["none", "full", "recon_fit@int4"], rhos=[0.2],
                           per_doc=6, both=3, log=lambda _: None)
    rows = read_table(str(out / "comparison.parquet"), ComparisonRow)
    systems = {r.system for r in rows}
    assert {"none", "full", "compose[concat]:recon_fit@int4", "compose[concat+once]:recon_fit@int4",
            "compose[own]:recon_fit@int4", "compose[longest]:recon_fit@int4", "alone:varn:recon_fit@int4",
            "alone:kell:recon_fit@int4"} <= systems
    assert {r.split for r in rows} >= {"probes", "probes:varn", "probes:kell", "both"}
    by = {(r.system, r.split): r for r in rows}
    composed, alone = by[("compose[concat]:recon_fit@int4", "probes")], by[("alone:varn:recon_fit@int4", "probes")]
    assert composed.state_bytes > alone.state_bytes > 0  # the composition holds both documents' states
    assert by[("full", "probes")].kl_to_full == pytest.approx(0.0, abs=1e-6)
    info = json.loads((out / "info.json").read_text())
    assert info["n"] < sum(info["n_parts"])  # one chat prefix in the concatenation, one per part composed
    assert 0 < info["n_shared_prefix"] <= sum(info["n_parts"]) - info["n"]
    assert "Several documents at once" in res["markdown"]


def test_runs_of_different_base_models_are_refused_in_one_line(two_runs, tmp_path):
    other = _run(tmp_path, "qwen", DOC_B, model="tiny:qwen2")
    with pytest.raises(CompareInputError, match="base model 'tiny:qwen2'.*differs from 'tiny:llama'") as err:
        open_runs([two_runs[0], other])
    assert "\n" not in str(err.value)
    from typer.testing import CliRunner

    from nectar.pipeline.cli import app

    res = CliRunner().invoke(app, ["compare", two_runs[0], other, "--out", str(tmp_path / "o")])
    assert res.exit_code == 2 and "differs from 'tiny:llama'" in res.output
    assert len(res.output.strip().splitlines()) == 1, res.output


def test_one_run_is_not_a_composition(two_runs):
    with pytest.raises(CompareInputError, match="at least two runs"):
        open_runs([two_runs[0]])


def test_each_part_is_asked_from_the_tokens_placed_after_it(tiny_llama):
    from nectar.attention.compose import compose, part_gaps

    assert part_gaps([10, 20, 30], "concat") == (50, 30, 0)
    assert part_gaps([10, 20, 30], "own") == (0, 0, 0)
    assert part_gaps([10, 20, 30], "longest") == (20, 10, 0)
    # the question placed elsewhere (``at``) moves every part's query, not the gaps: part k's frame
    # puts the question at at − shift_k = n_k + gap_k
    provider, at = compose([None, None, None], [10, 20, 30], "concat", tiny_llama.model, at=55)
    assert tuple(at - s for s in provider.shifts) == (10 + 50, 20 + 30, 30 + 0)


def test_gap_systems_parse_cache_apart_and_others_are_refused_in_one_line(two_runs, tmp_path):
    from typer.testing import CliRunner

    from nectar.comparison.compose import plan_systems, state_key
    from nectar.pipeline.cli import app

    chosen, _ = plan_systems(["none", "recon_fit@int4+gaps", "recon_fit@int4", "kvpress:kvzip:int4"], ["concat"])
    assert [s.name for s in chosen] == ["none", "recon_fit@int4", "recon_fit@int4+gaps", "kvpress:kvzip:int4"]
    gaps = chosen[2]
    assert gaps.method == "recon_fit" and gaps.bits == 4 and gaps.options == chosen[1].options
    assert state_key(gaps, 0) == state_key(chosen[1]) == "recon_fit@int4"  # gap 0: the plain state, reused
    assert state_key(gaps, 2044) == "recon_fit@int4+gap2044" != state_key(gaps, 1528)
    for bad in ("evict@int4+gaps", "recon_select@int4+gaps", "kvpress:kvzip+gaps"):
        with pytest.raises(CompareInputError, match="only a fitted recon_fit system"):
            plan_systems([bad], None)
    res = CliRunner().invoke(app, ["compare", *two_runs, "--systems", "evict@int4+gaps", "--out", str(tmp_path / "o")])
    assert res.exit_code == 2 and "only a fitted recon_fit system" in res.output
    assert len(res.output.strip().splitlines()) == 1, res.output


@pytest.mark.slow
def test_gap_fitted_states_are_cached_per_gap_and_compared_with_the_plain_ones(two_runs, tmp_path):
    out = tmp_path / "out"
    res = compare_composed(list(two_runs), str(out), ["recon_fit@int4", "recon_fit@int4+gaps"], rhos=[0.2],
                           positions=["concat"], per_doc=6, both=3, log=lambda _: None)
    n_parts = json.loads((out / "info.json").read_text())["n_parts"]
    names = sorted(p.name for p in (out / "states").iterdir())
    assert len(names) == 3  # both documents' plain states, the first one's at the second's length
    assert sum(f"recon_fit@int4+gap{n_parts[1]}-" in n for n in names) == 1
    rows = {r.system for r in read_table(str(out / "comparison.parquet"), ComparisonRow)}
    assert {"compose[concat+once]:recon_fit@int4+gaps", "alone:varn:recon_fit@int4+gaps"} <= rows
    assert "| probes | compose[concat+once]:recon_fit@int4+gaps@0.2 | compose[concat+once]:recon_fit@int4@0.2 |" \
        in res["markdown"]  # paired with the same composition fitted without gaps


def _with_module(run_root, base, rho=None):
    """A module in the run's train stage, planned at the run's ρ for its document (weights untrained:
    composing reads the module the way ``nectar run`` leaves it, and what it scores doesn't matter here)."""
    from nectar.comparison.jobs import baseline_plan
    from nectar.layout import build_layout
    from nectar.modules import build_module, make_spec, save_module
    from nectar.orchestration.context import open_run

    ctx = open_run(run_root)
    dims = dict(num_layers=base.num_layers, num_kv_heads=base.num_kv_heads, head_dim=base.head_dim,
                n_context=build_layout(base.tokenizer, ctx.text).n, scaling=base.scaling)
    plan = baseline_plan(ctx, rho or ctx.config.train.module.rho, dims)
    module = build_module(plan)
    spec = make_spec(module, plan, base.name, base.weights_hash, ctx.info.sha256, base.num_q_heads)
    save_module(module, spec, ctx.run.url("train"))
    return plan.rho


def test_each_runs_own_module_composes_into_rows_labelled_with_its_rho(tmp_path, tiny_llama):
    # the run's own module has no budget asked for it (ρ None in compare_composed): it is the module's,
    # and every label and log line must say so rather than format None
    runs = [_run(tmp_path, "varn", DOC_A), _run(tmp_path, "kell", DOC_B)]
    rho = {_with_module(r, tiny_llama) for r in runs}.pop()
    out, logged = tmp_path / "out", []
    res = compare_composed(runs, str(out), ["none", "full", "module"], positions=["concat"], per_doc=3, both=1,
                           log=logged.append)
    rows = read_table(str(out / "comparison.parquet"), ComparisonRow)
    by = {(r.system, r.split): r for r in rows}
    assert {"none", "full", "compose[concat]:module", "compose[concat+once]:module", "alone:varn:module",
            "alone:kell:module"} == {r.system for r in rows}
    composed, alone = by[("compose[concat]:module", "probes")], by[("alone:varn:module", "probes")]
    assert composed.rho == alone.rho == pytest.approx(rho) and composed.kind == "trained"
    assert composed.state_bytes > alone.state_bytes > 0
    assert by[("none", "probes")].rho is None and by[("full", "probes")].kl_to_full == pytest.approx(0.0, abs=1e-6)
    assert f"| compose[concat]:module | trained | {rho:g} |" in res["markdown"]
    assert any(line.startswith(f"compose: module @ {rho:g} on varn") for line in logged), logged
    # modules of different budgets: each document's rows keep its own, the compositions have none (–)
    other = _with_module(runs[1], tiny_llama, rho=2 * rho)
    res = compare_composed(runs, str(tmp_path / "out2"), ["module"], positions=["concat"], per_doc=3, both=1,
                           log=lambda _: None, prefix_once=False)
    by = {r.system: r for r in res["rows"] if r.split == "probes"}
    assert by["compose[concat]:module"].rho is None and "| compose[concat]:module | trained | – |" in res["markdown"]
    assert (by["alone:varn:module"].rho, by["alone:kell:module"].rho) == pytest.approx((rho, other))
