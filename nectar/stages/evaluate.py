"""The evaluate stage (docs/design.md §5, §11; paper §4.2–4.3, App. C, F, G). Pure Python, no Prefect.

On the held-out pairs of each split (``test``; ``challenge``: the test pairs least similar to any
training instruction, App. E; and every further held-out split the targets hold, e.g. ``probes``),
it writes

  metrics.parquet      MetricsRow: token accuracy, cross-entropy, KL to full, KL recovered and greedy
                       agreement with the full model — module / full / none — over EVERY pair of the
                       split, each with a 95 % paired bootstrap interval over pairs
  per_layer.parquet    PerLayerRow: score/target MSE and relative transport error per layer × head
  generations.parquet  GenerationRow: module and full-context answers side by side (a seeded sample
                       of up to ``max_samples`` pairs per split)
  judgments.parquet    JudgmentRow: three judge comparisons per sample (parse failures kept)
  benchmark.parquet    BenchmarkRow: TTFT, tok/s, peak memory — module vs full KV, cold and cached
  report.md, report.html, figures/*.png

The full-context model is the exact provider over the document KV computed once by the targets
stage; the no-document model has no provider; the module-plugged model uses the trained module.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from ..attention.doc_kv import DocKV
from ..attention.exact import ExactDocState
from ..evaluation.benchmark import BENCH_PROMPT, run_benchmark, same_architecture
from ..evaluation.generations import GenItem, generate_answers, generation_rows
from ..evaluation.judge import ChatFn, JudgeItem, judge
from ..evaluation.report import ReportInputs, write_report
from ..schemas.artifacts import BenchmarkRow, PerLayerRow
from ..evaluation.quality import SystemQuality
from ..evaluation.scoring import score_providers
from ..evaluation.selection import EvaluateInputError, Selection, evaluated_splits, select_pairs
from ..evaluation.questions import with_questions
from ..evaluation.teacher import EvalPair, head_errors
from ..layout import PromptLayout
from ..base_model import BaseLM
from ..modules.builder import ModulePlan, NectarModule
from ..modules.provider import ModuleDocState, inference_provider
from ..schemas.artifacts import (ChunkRow, DatasetRow, GenerationRow, JudgmentRow, MetricsRow,
                                 ModuleSpec, TargetsPairRow, TrainLogRow)
from ..schemas.config import EvaluateConfig
from ..tables import read_table, write_table
from ..targets.online import OnlineTargets
from ..targets.reader import TargetsData
from ..targets.store import open_targets, targets_zarr_url

Progress = Callable[[str, int, int], None]  # (step, done, total)

__all__ = ["EvaluateInputError", "constant_judge_score", "evaluate", "evaluated_splits", "select_pairs"]


def _metrics_rows(quality: dict[str, dict[str, SystemQuality]]) -> list[MetricsRow]:
    rows = []
    for split, by_model in sorted(quality.items()):
        for model in ("module", "full", "none"):
            cols = by_model[model].columns()
            rows.append(MetricsRow(split=split, model=model, **MetricsRow.quality(cols)))
    return rows


def _target_rows(targets_url: str, base: BaseLM, doc_kv: DocKV):
    """The targets' (q, α, A) rows by token index: read (any storage dtype) or recomputed (online)."""
    data = TargetsData(targets_zarr_url(targets_url))
    if data.online:
        data.attach_values(OnlineTargets(data, base, doc_kv))
    return data


def _per_layer_rows(data, header, provider, sel: Selection, device) -> list[PerLayerRow]:
    rows = []
    group = header.num_q_heads // header.num_kv_heads
    for split, pids in sel.per_split.items():
        # the user's questions (split "questions") have no cached targets: no per-layer errors
        spans = [(sel.rows[p].start, sel.rows[p].start + sel.rows[p].length) for p in pids if p in sel.rows]
        if not spans:
            continue
        idx = np.concatenate([np.arange(a, b) for a, b in spans])
        t = data.rows(idx)  # stored (any storage dtype) or, for online targets, recomputed
        q, alpha, A = (x.cpu().numpy() for x in (t.q, t.alpha, t.A))  # [T, L, Hq, (d)] float32
        means = head_errors(provider, q, alpha, A, header.scaling, device).means()
        for layer in range(header.num_layers):
            for h in range(header.num_q_heads):
                rows.append(PerLayerRow(split=split, layer=layer, q_head=h, kv_head=h // group,
                                        **{k: float(v[layer, h]) for k, v in means.items()},
                                        n_tokens=len(idx)))
    return rows


def _benchmark(base, layout, cfg, plan, notes, progress) -> list[BenchmarkRow]:
    prompt = layout.prompt(BENCH_PROMPT).ids
    budget = base.max_context_tokens - len(prompt) - cfg.benchmark_new_tokens
    lengths = [n for n in cfg.benchmark_lengths if n <= budget]
    if len(lengths) < len(cfg.benchmark_lengths):
        notes.append(f"benchmark lengths over the model's window ({base.max_context_tokens} tokens) "
                     f"were skipped: {sorted(set(cfg.benchmark_lengths) - set(lengths))}")
    if not lengths:
        return []
    res = run_benchmark(base, layout.context_ids, prompt, lengths, same_architecture(base, plan),
                        cfg.benchmark_new_tokens,
                        progress=(lambda d, t: progress("benchmark", d, t)) if progress else None)
    notes += [f"benchmark skipped {s}" for s in res.skipped]
    if res.rows:
        notes.append(f"benchmark: {res.rows[0].note}; memory = {res.rows[0].memory_method}.")
    return res.rows


def evaluate(
    cfg: EvaluateConfig,
    base: BaseLM,
    layout: PromptLayout,
    doc_kv: DocKV,
    module: NectarModule,
    module_spec: ModuleSpec,
    targets_url: str,
    dataset: Sequence[DatasetRow],
    chunks: Sequence[ChunkRow],
    judge_chat: ChatFn,
    out_url: str,
    train_log: Sequence[TrainLogRow] = (),
    title: str = "NECTAR evaluation",
    facts: dict[str, Any] | None = None,
    batch_size: int = 4,
    gen_batch_size: int = 16,
    progress: Progress | None = None,
    question_pairs: Sequence[EvalPair] = (),
) -> dict[str, Any]:
    """Run every evaluation step and write the tables and the report into ``out_url``.

    ``question_pairs``: the user's own questions (nectar/evaluation/questions.py), scored as the
    ``questions`` split beside the held-out pairs.

    ``targets_url`` is the targets stage folder (targets.zarr + pairs.parquet); ``judge_chat`` is
    ``nectar.evaluation.judge.make_chat(backend)`` for the configured judge backend.
    """
    step = progress or (lambda *_: None)
    g, header = open_targets(targets_zarr_url(targets_url))
    if header.n_context != layout.n or doc_kv.n != layout.n:
        raise EvaluateInputError(
            f"the targets were cached for a document of {header.n_context} tokens and the document KV "
            f"holds {doc_kv.n}, but the layout has {layout.n}; re-run from the targets stage")
    if module_spec.n_context != layout.n:
        raise EvaluateInputError(f"the module was trained for n={module_spec.n_context} document tokens, "
                                 f"this document has {layout.n}; re-run from the train stage")
    target_rows = read_table(f"{targets_url}/pairs.parquet", TargetsPairRow)
    splits = evaluated_splits(target_rows, cfg)
    sel = with_questions(select_pairs(target_rows, g["token_ids"][:], cfg, splits), question_pairs, cfg)
    if not sel.pairs:
        raise EvaluateInputError(f"no held-out pairs with response tokens for splits {splits}; "
                                 "check the verify stage's test split")
    notes: list[str] = []
    empty = [s for s, ids in sel.per_split.items() if not ids]
    if empty:
        notes.append(f"splits without pairs (not evaluated): {empty}")

    module_p, full_p = ModuleDocState(module), ExactDocState(doc_kv)
    providers = {"module": module_p, "full": full_p, "none": None}
    _, quality = score_providers(base, layout.n, providers, sel, cfg, batch_size, gen_batch_size, step)
    metrics = _metrics_rows(quality)
    per_layer = _per_layer_rows(_target_rows(targets_url, base, doc_kv), header, module_p, sel, base.device)

    by_id = {r.pair_id: r for r in dataset}
    judged = {pid for ids in sel.judged.values() for pid in ids}
    missing = [pid for pid in sorted(judged) if pid not in by_id]
    if any(sel.rows[pid].split == "test" for pid in missing):
        raise EvaluateInputError(f"targets list pairs the dataset lacks (e.g. {missing[:3]}); "
                                 "re-run from the targets stage")
    if missing:
        notes.append(f"{len(missing)} pairs of the splits {sorted({sel.rows[p].split for p in missing})} have no "
                     "instruction in the dataset; they are scored teacher-forced and by agreement, not judged")
    items = [GenItem(p.pair_id, p.task, tuple(s for s in p.splits if p.pair_id in sel.judged.get(s, ())),
                     by_id[p.pair_id].instruction, by_id[p.pair_id].response)
             for p in sel.pairs if p.pair_id in judged and p.pair_id in by_id]
    gen_providers = {"module": inference_provider(module, base.dtype), "full": full_p}  # the fused module decodes
    answers = generate_answers(base, layout, gen_providers, items, cfg,
                               gen_batch_size, lambda d, t: step("generate", d, t))
    generations = generation_rows(items, answers)
    for model in ("module", "full"):
        empty = sum(not a for a in answers[model].values())
        if empty:
            notes.append(f"{empty} of {len(items)} {model} answers are empty (the model ended its turn at "
                         "once); they are judged as they are")

    chunk_text = {c.chunk_id: c.text for c in chunks}
    judge_items = [JudgeItem(it.pair_id, it.task, it.splits, it.instruction, it.ground_truth,
                             chunk_text.get(by_id[it.pair_id].chunk_id, ""), answers["module"][it.pair_id],
                             answers["full"][it.pair_id]) for it in items]
    step("judge", 0, len(judge_items))
    judgments = judge(judge_chat, judge_items)
    step("judge", len(judge_items), len(judge_items))

    plan = ModulePlan.from_dict(module_spec.module_config)
    bench = _benchmark(base, layout, cfg, plan, notes, step)

    write_table(f"{out_url}/metrics.parquet", metrics, MetricsRow)
    write_table(f"{out_url}/per_layer.parquet", per_layer, PerLayerRow)
    write_table(f"{out_url}/generations.parquet", generations, GenerationRow)
    write_table(f"{out_url}/judgments.parquet", judgments, JudgmentRow)
    write_table(f"{out_url}/benchmark.parquet", bench, BenchmarkRow)
    judge_desc = cfg.judge.model or ("the base model" if cfg.judge.backend == "local" else "?")
    notes.insert(0, f"judge: {cfg.judge.backend} backend, model {judge_desc} "
                    "(the paper used GPT-5.2; a small local judge gives noisy scores and parse failures, "
                    "which are counted, never imputed)")
    constant = constant_judge_score(judgments)
    if constant is not None:
        notes.insert(1, f"WARNING: the judge gave every one of its {sum(j.score is not None for j in judgments)} "
                        f"parsed replies the same score ({constant}), so Δs says nothing about the module here; "
                        "point evaluate.judge at a stronger model (backend openai, base_url, model)")
    inputs = ReportInputs(
        title=title, metrics=metrics, per_layer=per_layer, generations=generations, judgments=judgments,
        benchmark=bench, train_log=list(train_log), module_bytes=module_spec.module_bytes,
        kv_bytes=doc_kv.nbytes(), notes=notes,
        facts={"model": base.name, "n": layout.n, "arch": module_spec.arch, "rho": module_spec.rho,
               "module params": module_spec.n_params, **(facts or {})})
    written = write_report(out_url, inputs)
    files = ["metrics.parquet", "per_layer.parquet", "generations.parquet", "judgments.parquet",
             "benchmark.parquet", *written.files]
    return {"files": files, "tables": written.tables,
            "counts": _counts(sel, metrics, judgments, bench, generations)}


def constant_judge_score(judgments: list[JudgmentRow], min_scores: int = 4) -> int | None:
    """The one score a degenerate judge gives every reply (e.g. a small model copying the prompt's
    example), or None when the scores vary or are too few to tell."""
    scores = {j.score for j in judgments if j.score is not None}
    parsed = sum(j.score is not None for j in judgments)
    return next(iter(scores)) if parsed >= min_scores and len(scores) == 1 else None


def _counts(sel: Selection, metrics, judgments, bench, generations) -> dict[str, Any]:
    counts: dict[str, Any] = {f"pairs_{s}": len(ids) for s, ids in sel.per_split.items()}
    counts["judgments"] = len(judgments)
    counts["judge_parse_errors"] = sum(j.parse_error is not None for j in judgments)
    counts["benchmark_rows"] = len(bench)
    counts["empty_module_answers"] = sum(not g.module_output for g in generations)
    counts["empty_full_answers"] = sum(not g.full_output for g in generations)
    for m in metrics:
        counts[f"token_acc_{m.split}_{m.model}"] = round(m.token_acc, 4)
        if m.model == "module" and m.recovered_kl is not None:
            counts[f"recovered_kl_{m.split}_module"] = round(m.recovered_kl, 4)
    return counts
