"""targets → train → evaluate through the orchestrator on the tiny model, from a verified dataset
written by hand (the LLM stages are covered by their own tests and the end-to-end CLI test)."""
import pytest

from nectar import orchestration
from nectar.orchestration.executor import stage_status
from nectar.schemas import load_config

from hand_written_run import QA, write_verified

@pytest.fixture
def tiny_ctx(tmp_path, document):
    path = tmp_path / "doc.txt"
    path.write_text(document)
    config = load_config("tiny", overrides=["train.samples=600", "evaluate.judge.max_new_tokens=8"])
    ctx = orchestration.prepare_run(str(path), config, str(tmp_path / "run"))
    orchestration.run_chunk(ctx)
    write_verified(ctx, QA[:8], n_train=6, challenge={7})
    return ctx


@pytest.mark.slow
def test_targets_train_evaluate_and_cache(tiny_ctx):
    ctx = tiny_ctx
    for stage in ("targets", "train", "evaluate"):
        out = orchestration.STAGE_RUNNERS[stage](ctx, False)
        assert out.status == "done", stage
    assert ctx.run.exists("evaluate", "report.html")
    # no first or promote stage here, so no live pointer: the run serves, and evaluate scores, train's module
    counts = ctx.run.read_manifest("evaluate").counts
    assert counts["scored_state"] == "train"
    assert counts["scored_module_sha256"] == ctx.run.read_manifest("train").outputs["module.safetensors"]
    tables = orchestration.read_eval_tables(ctx.run)
    assert tables["headline"] and "token_acc_module" in tables["headline"][0]
    # identical second pass: all cache hits
    for stage in ("targets", "train", "evaluate"):
        assert orchestration.STAGE_RUNNERS[stage](ctx, False).status == "cached"
        assert stage_status(ctx.run, stage)["state"] == "cached"
    # a changed training config re-runs train and, through its new outputs, evaluate
    ctx2 = orchestration.RunContext(ctx.run, load_config("tiny", overrides=["train.samples=300"]), ctx.text, ctx.info,
                                  ctx.progress)
    assert orchestration.run_targets(ctx2).status == "cached"
    assert orchestration.run_train(ctx2).status == "done"


def test_stage_before_its_inputs_is_refused(tmp_path, document):
    path = tmp_path / "doc.txt"
    path.write_text(document)
    ctx = orchestration.prepare_run(str(path), load_config("tiny"), str(tmp_path / "run"))
    with pytest.raises(orchestration.StageInputError, match="needs the outputs of 'verify'"):
        orchestration.run_targets(ctx)


@pytest.mark.slow
def test_sweep_variants_share_the_parent_data_stages(tiny_ctx):
    from nectar.comparison import sweep, variants as variant_runs

    orchestration.run_targets(tiny_ctx)
    variants = sweep.expand_variants(tiny_ctx.config, sweep.parse_grid(["arch=mlp,quadrature"]))
    assert [v.config.train.module.arch for v in variants] == ["mlp", "quadrature"]
    v = variant_runs.prepare_variant(tiny_ctx, variants[1])
    reopened = orchestration.open_run(v.run.root)
    assert reopened.stage_run("targets").root == tiny_ctx.run.root
    assert orchestration.run_train(reopened).status == "done"
    row = sweep.comparison_row(variants[1], reopened.run)
    assert row["arch"] == "quadrature" and row["module_bytes"] > 0
    with pytest.raises(Exception, match="only"):
        sweep.expand_variants(tiny_ctx.config, sweep.parse_grid(["chunk.words=10,20"]))
    # The variant equal to the parent's config trains in the parent run (cached after `nectar run`).
    assert variant_runs.variant_context(tiny_ctx, variants[0]).run.root == tiny_ctx.run.root
    assert variant_runs.variant_context(tiny_ctx, variants[1]).run.root != tiny_ctx.run.root
    assert [v.name for v in sweep.with_base(tiny_ctx.config, variants)] == [v.name for v in variants]
    assert [v.name for v in sweep.with_base(tiny_ctx.config, variants[1:])] == ["base", variants[1].name]


@pytest.mark.slow
def test_targets_cache_held_out_probes_and_train_probes_only_when_asked(tiny_ctx):
    from nectar.schemas.artifacts import ProbeRow, TargetsPairRow
    from nectar.tables import read_table
    from nectar.targets.reader import TargetsData

    out = orchestration.run_targets(tiny_ctx)
    assert out.manifest.counts["probes_held_out"] > 0 and out.manifest.counts["probes_train"] == 0
    probes = read_table(tiny_ctx.run.url("targets", "probes.parquet"), ProbeRow)
    pairs = read_table(tiny_ctx.run.url("targets", "pairs.parquet"), TargetsPairRow)
    held = {p.probe_id for p in probes if p.split == "probes"}
    assert {p.pair_id for p in pairs if p.split == "probes"} == held
    assert not any(p.pair_id.startswith("probe-") and p.split == "train" for p in pairs)
    data = TargetsData(tiny_ctx.run.url("targets", "targets.zarr"))
    assert len(data.pairs("probes")) == len(held)
    train_tokens = len(data.tokens("train"))
    # train probes join the training queries; held-out probes stay the same and never train
    ctx = orchestration.RunContext(tiny_ctx.run, load_config("tiny", overrides=["targets.probes.train=true"]),
                                   tiny_ctx.text, tiny_ctx.info, tiny_ctx.progress)
    assert orchestration.run_targets(ctx).status == "done"
    data = TargetsData(tiny_ctx.run.url("targets", "targets.zarr"))
    assert len(data.tokens("train")) > train_tokens and len(data.pairs("probes")) == len(held)
    rows = read_table(tiny_ctx.run.url("targets", "pairs.parquet"), TargetsPairRow)
    assert {p.pair_id for p in rows if p.split == "probes"} == held
