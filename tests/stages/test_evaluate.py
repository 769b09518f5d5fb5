"""The evaluate stage end to end on the tiny model: targets → a trained module → every table and
the report, with a module that genuinely differs from the full-context model."""
import pytest

from nectar.attention.doc_kv import prefill_document
from nectar.schemas.artifacts import BenchmarkRow, PerLayerRow
from nectar.layout import build_layout
from nectar.modules import load_module
from nectar.schemas import (ChunkRow, DatasetRow, EvaluateConfig, GenerationRow, JudgmentRow, MetricsRow,
                            TargetsConfig, TrainConfig)
from nectar.stages import evaluate as evaluate_stage
from nectar.stages import targets as targets_stage
from nectar.stages.train import train
from nectar.tables import read_table

DOC = ("The lighthouse keeper of Varn Island kept a ledger of every ship that passed. In the winter of "
       "1871 the schooner Meridian ran aground on the northern reef, and the keeper rowed out twice to "
       "bring its seven sailors ashore. The Meridian carried salt cod and barrels of lamp oil; her captain, "
       "Ilse Brandt, later bought the island. ") * 3

PAIRS = [("qa", "Who bought the island?", "Ilse Brandt."), ("qa", "What ran aground?", "The schooner Meridian."),
         ("qa", "What cargo did the Meridian carry?", "Salt cod and lamp oil."),
         ("qa", "How many sailors were rescued?", "Seven."), ("summarization", "Summarize the wreck.",
                                                             "A schooner ran aground and the keeper saved its crew."),
         ("quoting", "Quote the sentence about the cargo.", "The Meridian carried salt cod and barrels of lamp oil."),
         ("paraphrasing", "Paraphrase the rescue.", "The keeper rowed out two times to save seven sailors."),
         ("qa", "When did the wreck happen?", "In the winter of 1871."),
         ("qa", "Where did the schooner run aground?", "On the northern reef.")]


def _dataset():
    rows = []
    for i, (task, ins, resp) in enumerate(PAIRS):
        split = "train" if i < 5 else "test"
        rows.append(DatasetRow(pair_id=f"p{i}", chunk_id=0, task=task, instruction=ins, response=resp,
                               full_answer=resp, judge_raw="{}", is_consistent=True, confidence=0.9, reasoning="",
                               verdict="consistent", kept=True, split=split, challenge=i in (6, 8)))
    return rows


@pytest.fixture(scope="module")
def trained(tiny_llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("run")
    layout = build_layout(tiny_llama.tokenizer, DOC)
    kv = prefill_document(tiny_llama, layout.context_ids)
    dataset = _dataset()
    targets_stage.build_targets(tiny_llama, layout, kv, dataset, TargetsConfig(top_k=4, chunk_tokens=16,
                                shard_tokens=64, batch_size=4), str(root / "targets"), "docsha")
    cfg = TrainConfig(samples=256, batch_size=32, eval_every=4, checkpoint_every=100,
                      module={"rho": 0.25, "depths": [0, 1, 1]})
    train(str(root / "targets"), cfg, tiny_llama, kv, str(root / "train"))
    module, spec = load_module(str(root / "train"), tiny_llama, "docsha")
    return root, layout, kv, dataset, module, spec


def garbage_then_valid_judge(prompts):
    """Failure injection: every third reply is garbage; the others are fixed valid JSON."""
    return [("no idea", None) if i % 3 == 0 else ('{"score": 4, "reasoning": "ok"}', None)
            for i in range(len(prompts))]


@pytest.mark.slow
def test_evaluate_writes_every_table_and_the_report_with_fake_partly_garbage_judge(tiny_llama, trained, tmp_path):
    root, layout, kv, dataset, module, spec = trained
    from nectar.tables import read_table as rt
    from nectar.schemas import TrainLogRow

    cfg = EvaluateConfig(max_samples=3, max_new_tokens_qa=4, max_new_tokens_other=6,
                         benchmark_lengths=(96, 100_000), benchmark_new_tokens=3)
    chunks = [ChunkRow(chunk_id=0, start_word=0, end_word=len(DOC.split()), n_words=len(DOC.split()), text=DOC)]
    out = tmp_path / "evaluate"
    res = evaluate_stage.evaluate(cfg, tiny_llama, layout, kv, module, spec, str(root / "targets"), dataset,
                                  chunks, garbage_then_valid_judge, str(out),
                                  train_log=rt(str(root / "train" / "train_log.parquet"), TrainLogRow))
    metrics = read_table(str(out / "metrics.parquet"), MetricsRow)
    by = {(m.split, m.model): m for m in metrics}
    assert set(by) == {(s, m) for s in ("test", "challenge") for m in ("module", "full", "none")}
    assert by[("test", "full")].kl_to_full == pytest.approx(0.0, abs=1e-5)
    assert by[("test", "module")].kl_to_full > 0  # the module is not the document
    assert by[("test", "module")].n_tokens == by[("test", "full")].n_tokens > 0
    # teacher-forced metrics use every test pair (max_samples caps the judged generations), with intervals
    assert by[("test", "module")].n_pairs == 4 and by[("challenge", "module")].n_pairs == 2
    for m in metrics:
        assert m.token_acc_ci_low <= m.token_acc <= m.token_acc_ci_high
        assert m.kl_ci_low <= m.kl_to_full <= m.kl_ci_high
        assert m.recovered_kl_ci_low <= m.recovered_kl <= m.recovered_kl_ci_high
        assert m.n_agreement == m.n_pairs and m.agreement_rouge_l is not None and m.agreement_cosine is not None
    assert by[("test", "full")].recovered_kl == 1.0 and by[("test", "none")].recovered_kl == 0.0
    assert by[("test", "full")].agreement_exact == 1.0 and by[("test", "full")].kl_ci_high == pytest.approx(0, abs=1e-6)
    per_layer = read_table(str(out / "per_layer.parquet"), PerLayerRow)
    assert len(per_layer) == 2 * tiny_llama.num_layers * tiny_llama.num_q_heads
    assert all(r.mse_A > 0 for r in per_layer)
    gens = read_table(str(out / "generations.parquet"), GenerationRow)
    test_ids = {g.pair_id for g in gens if g.split == "test"}
    assert len(test_ids) == 3 and test_ids <= {"p5", "p6", "p7", "p8"}  # max_samples of the 4 test pairs
    assert {g.pair_id for g in gens if g.split == "challenge"} == {"p6", "p8"}
    assert all(g.module_output is not None and g.full_output is not None for g in gens)
    judg = read_table(str(out / "judgments.parquet"), JudgmentRow)
    assert len(judg) == 3 * len(gens)
    unparsed = [j for j in judg if j.parse_error]
    assert unparsed and all(j.score is None and j.raw == "no idea" for j in unparsed)
    assert res["counts"]["judge_parse_errors"] == len(unparsed)
    bench = read_table(str(out / "benchmark.parquet"), BenchmarkRow)
    assert {(b.n_context, b.system) for b in bench} == {(96, s) for s in ("module", "full_cold", "full_cached")}
    html = (out / "report.html").read_text()
    assert "100000" in html and "window" in html  # the over-long benchmark length is reported as skipped
    assert html.count("data:image/png;base64,") >= 4
    head = {h["split"]: h for h in res["tables"]["headline"]}
    assert head["test"]["token_acc_gap"] == pytest.approx(by[("test", "full")].token_acc - by[("test", "module")].token_acc)
    assert set(res["files"]) >= {"metrics.parquet", "report.md", "report.html", "benchmark.parquet"}


def test_evaluate_refuses_a_module_for_another_document(tiny_llama, trained, tmp_path):
    root, layout, kv, dataset, module, spec = trained
    bad = spec.model_copy(update={"n_context": spec.n_context + 1})
    with pytest.raises(evaluate_stage.EvaluateInputError, match="trained for n="):
        evaluate_stage.evaluate(EvaluateConfig(), tiny_llama, layout, kv, module, bad, str(root / "targets"),
                                dataset, [], garbage_then_valid_judge, str(tmp_path))


def test_unknown_split_is_a_clear_error(trained):
    root, *_ = trained
    from nectar.schemas import TargetsPairRow

    rows = read_table(str(root / "targets" / "pairs.parquet"), TargetsPairRow)
    with pytest.raises(evaluate_stage.EvaluateInputError, match="'train'"):
        evaluate_stage.select_pairs(rows, None, EvaluateConfig(splits=("train",)))
