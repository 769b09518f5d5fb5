"""The LLM judge (paper §4.3, App. G): three comparisons per sample, and Δs per task and split.

  module_vs_truth  the ground-truth prompt with the task's rubric and the pair's context chunk
  base_vs_truth    the same for the full-context model's answer
  module_vs_base   the comparison prompt (no context: agreement, not correctness)

The judge is any chat backend from ``nectar.llm`` (an OpenAI-compatible endpoint or the local
model); this file only renders prompts, calls ``chat_many`` once for the whole batch and parses.
A backend error or an unparseable reply becomes a JudgmentRow with ``parse_error`` set — counted
in the summary, never given a score.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from ..prompts import EVAL_RUBRICS, EVAL_SCHEMA, eval_compare_prompt, eval_ground_truth_prompt
from ..schemas.artifacts import JudgmentRow
from ..schemas.config import TASK_TYPES, EvaluateConfig, LLMConfig
from .judge_parse import parse_judgment
from .stats import score_gap

COMPARISONS = ("module_vs_truth", "base_vs_truth", "module_vs_base")


@dataclass(frozen=True)
class JudgeItem:
    pair_id: str
    task: str
    splits: tuple[str, ...]
    instruction: str
    ground_truth: str
    context_chunk: str
    module_output: str
    full_output: str


def judge_prompt(item: JudgeItem, comparison: str) -> str:
    """The App. G prompt for one comparison (templates verbatim in nectar/prompts/eval_*.txt)."""
    if comparison == "module_vs_base":
        return eval_compare_prompt(item.instruction, base_generated=item.full_output, generated=item.module_output)
    if item.task not in EVAL_RUBRICS:
        raise ValueError(f"pair {item.pair_id}: no judge rubric for task {item.task!r}; "
                         f"tasks are {sorted(EVAL_RUBRICS)}")
    generated = item.module_output if comparison == "module_vs_truth" else item.full_output
    return eval_ground_truth_prompt(item.task, item.context_chunk, item.instruction, item.ground_truth, generated)


# (prompts) → [(text, error)] — the one call into the chat backend (see make_chat below).
ChatFn = Callable[[list[str]], list[tuple[str | None, str | None]]]


def make_chat(backend: Any, llm_cfg: LLMConfig | None = None) -> ChatFn:
    """Adapt a ``nectar.llm`` backend: one user message per prompt, all in one ``chat_many``, with
    the judge's sampling settings and, where the backend supports it, the {score, reasoning} JSON
    schema as structured output (``llm_cfg.structured_output``). The reply text is still parsed
    by ``parse_judgment``, so a server that ignores the schema is handled the same way."""
    from ..llm import make_request

    if llm_cfg is None:  # callers should pass the run's evaluate.judge; this is its default
        llm_cfg = EvaluateConfig().judge

    def chat(prompts: list[str]) -> list[tuple[str | None, str | None]]:
        results = backend.chat_many([make_request(llm_cfg, p, json_schema=EVAL_SCHEMA) for p in prompts])
        return [(r.text, r.error) for r in results]

    return chat


def judge(chat: ChatFn, items: Sequence[JudgeItem]) -> list[JudgmentRow]:
    """Judge every item three ways; one JudgmentRow per (split, pair, comparison)."""
    jobs = [(it, c) for it in items for c in COMPARISONS]
    replies = chat([judge_prompt(it, c) for it, c in jobs]) if jobs else []
    if len(replies) != len(jobs):
        raise RuntimeError(f"judge backend returned {len(replies)} replies for {len(jobs)} prompts")
    rows = []
    for (it, comparison), (text, error) in zip(jobs, replies):
        if error:
            score, reasoning, perr = None, "", f"backend error: {error}"
        else:
            parsed = parse_judgment(text)
            score, reasoning, perr = parsed.score, parsed.reasoning, parsed.error
        for split in it.splits:
            rows.append(JudgmentRow(pair_id=it.pair_id, split=split, task=it.task, comparison=comparison,
                                    score=score, reasoning=reasoning, raw=text or "", parse_error=perr))
    return rows


def judge_summary(rows: Sequence[JudgmentRow], confidence: float = 0.95) -> list[dict[str, Any]]:
    """Δs = mean(base) − mean(module) with Student-t intervals per (split, task) and per split
    overall (task "all"). Plain dicts: the report and the Prefect table artifacts use them as is."""
    by_pair: dict[tuple[str, str], dict[str, Any]] = {}
    for r in rows:
        cell = by_pair.setdefault((r.split, r.pair_id), {"task": r.task, "errors": 0})
        cell[r.comparison] = r.score
        cell["errors"] += r.parse_error is not None
    out = []
    for split in sorted({s for s, _ in by_pair}):
        cells = [c for (s, _), c in by_pair.items() if s == split]
        tasks = [t for t in TASK_TYPES if any(c["task"] == t for c in cells)]
        for task in [*tasks, "all"]:
            group = [c for c in cells if task == "all" or c["task"] == task]
            gap = score_gap([c.get("base_vs_truth") for c in group], [c.get("module_vs_truth") for c in group],
                            [c.get("module_vs_base") for c in group], confidence)
            out.append({
                "split": split, "task": task, "n_samples": gap.n_samples,
                "n_paired": gap.delta.n, "n_unparsed": gap.n_unparsed,
                "judge_errors": sum(c["errors"] for c in group),
                "delta_s": gap.delta.mean, "delta_s_ci": gap.delta.half_width,
                "base_mean": gap.base.mean, "base_ci": gap.base.half_width,
                "module_mean": gap.module.mean, "module_ci": gap.module.half_width,
                "agreement_mean": gap.agreement.mean, "agreement_ci": gap.agreement.half_width,
                "agreement_n": gap.agreement.n,
            })
    return out
