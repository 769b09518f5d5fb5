"""Free-form generations (paper App. G "Generation"): module-plugged vs full-context model.

Both models answer the same held-out instructions with nucleus sampling (p=0.8, T=0.7 by default),
64 new tokens for QA and 196 otherwise. The full-context model is the same query-only forward with
the exact document provider over the document KV computed once — no per-instruction re-prefill.
A pair selected for several splits (a challenge pair is also a test pair) is generated once and
reported under each split.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..attention.engine import DecodeEngine, Request
from ..layout import PromptLayout
from ..base_model import BaseLM
from ..schemas.artifacts import GenerationRow
from ..schemas.config import EvaluateConfig


@dataclass(frozen=True)
class GenItem:
    pair_id: str
    task: str
    splits: tuple[str, ...]
    instruction: str
    ground_truth: str


def max_new_tokens(task: str, cfg: EvaluateConfig) -> int:
    return cfg.max_new_tokens_qa if task == "qa" else cfg.max_new_tokens_other


def _decode(base: BaseLM, tokens: list[int]) -> str:
    return base.tokenizer.decode(tokens, skip_special_tokens=True).strip()


def generate_answers(
    base: BaseLM,
    layout: PromptLayout,
    providers: dict[str, Callable | None],
    items: list[GenItem],
    cfg: EvaluateConfig,
    batch_size: int = 8,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, dict[str, str]]:
    """{model: {pair_id: answer}} for every provider, batched by generation length.

    Item i samples with seed ``cfg.seed + i`` for every model, and the engine's draws depend only
    on a row's seed and token index, so an answer does not depend on the batch it ran in. One
    decode engine per model, reused by every batch (its buffers, and on CUDA its decode graphs)."""
    answers: dict[str, dict[str, str]] = {name: {} for name in providers}
    engines = {name: DecodeEngine(base, provider, layout.n) for name, provider in providers.items()}
    by_len: dict[int, list[tuple[int, GenItem]]] = {}
    for i, it in enumerate(items):
        by_len.setdefault(max_new_tokens(it.task, cfg), []).append((i, it))
    done, total = 0, len(items) * len(providers)
    for length, group in sorted(by_len.items()):
        for lo in range(0, len(group), batch_size):
            batch = [it for _, it in group[lo: lo + batch_size]]
            seeds = [cfg.seed + i for i, _ in group[lo: lo + batch_size]]
            prompts = [layout.prompt(it.instruction).ids for it in batch]
            requests = [Request(p, length, cfg.temperature, cfg.top_p, seed) for p, seed in zip(prompts, seeds)]
            for name, engine in engines.items():
                res = engine.run(requests)
                for it, toks in zip(batch, res.tokens):
                    answers[name][it.pair_id] = _decode(base, toks)
                done += len(batch)
                if progress:
                    progress(done, total)
    return answers


def generation_rows(items: list[GenItem], answers: dict[str, dict[str, str]]) -> list[GenerationRow]:
    """One row per (split, pair): the instruction, ground truth and both models' answers."""
    return [
        GenerationRow(pair_id=it.pair_id, split=split, task=it.task, instruction=it.instruction,
                      ground_truth=it.ground_truth, module_output=answers["module"][it.pair_id],
                      full_output=answers["full"][it.pair_id])
        for it in items for split in it.splits
    ]
