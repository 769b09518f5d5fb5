"""recon_refine — recon_fit's state refined end to end: gradient steps on the KL between the full-context
model and the model reading the state, teacher-forced on the document's own reconstruction spans, with
the state read as stored (issue 38's lever "gradient refinement end to end by KL on the reconstruction").

Why: recon_fit fits each (layer, KV head) alone, to the exact attention of the full model's queries. At
a small budget every layer's error moves the next layer's queries, and nothing in a per-head fit sees
the output distribution. The steps here see it: the loss is the next-token KL through the frozen model,
on the same text the fit reconstructed (so the whole document holds the state, not a few questions).

  1. fit       recon_fit's selection and closed-form fit (its settings: the fields it shares)
  2. teacher   the reconstruction spans once through the full-context model: top-``topk`` log-probs of
               every response token (the KL over top-K + tail, nectar/kl.py)
  3. steps     Adam on every stored key, value and β, each read on its storage grid with a
               straight-through gradient (modules/stored.py ``trained_as_stored``), batches of whole
               spans; no weight decay (masked slots hold β = −inf)
  4. keep      the steps' state only when its KL on the spans is below the fit's (else the fit's)
"""
from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from ..attention.exact import ExactDocState
from ..attention.forward import query_logits
from ..base_model import BaseLM
from ..layout import PromptLayout
from ..modules.builder import NectarModule
from ..modules.provider import ModuleDocState
from ..modules.stored import quantize_module_, trained_as_stored
from ..schemas.config import FIRST_REFINE_STEPS, RefineConfig, SelectionConfig
from ..targets.capture import topk_logprobs
from ..targets.reader import padded_groups
from ..kl import kl_topk_tail_sum
from .greedy_keys import scarce_counts
from .interface import FitInputs, FittedState
from .recon_fit import ReconFit

REFINE_FIELDS = tuple(RefineConfig.model_fields)  # the method's fields that are not recon_fit's
REFINE_STEPS = FIRST_REFINE_STEPS  # the method's steps (measured: docs/quality.md, "Refined end to end on the reconstruction")


@dataclass(frozen=True)
class SpanBatch:
    """Right-padded reconstruction pairs and the teacher's top-K at their response tokens."""

    ids: torch.Tensor  # [b, m]
    mask: torch.Tensor  # [b, m] 1 = real token
    scored: torch.Tensor  # [b, m] bool: positions whose next token is a response token
    topk_ids: torch.Tensor  # [b, m, K]
    topk_logprobs: torch.Tensor  # [b, m, K]


def span_batches(layout: PromptLayout, spans: list[tuple[str, str]], max_tokens: int) -> list[SpanBatch]:
    """The spans as padded batches of at most ``max_tokens`` (count × longest), consecutive."""
    pairs = [layout.pair(i, r) for i, r in spans]
    batches = []
    for group in ([pairs[i] for i in g] for g in padded_groups([len(p.ids) for p in pairs], max_tokens)):
        m = max(len(p.ids) for p in group)
        ids = torch.zeros(len(group), m, dtype=torch.long)
        mask = torch.zeros(len(group), m, dtype=torch.long)
        scored = torch.zeros(len(group), m, dtype=torch.bool)
        for i, p in enumerate(group):
            ids[i, :len(p.ids)] = torch.tensor(p.ids)
            mask[i, :len(p.ids)] = 1
            scored[i, p.response_start - 1:len(p.ids) - 1] = True  # logits at t predict token t + 1
        batches.append(SpanBatch(ids, mask, scored, torch.empty(0, dtype=torch.long), torch.empty(0)))
    return batches


@torch.no_grad()
def with_teacher(base: BaseLM, doc_kv, n: int, batches: list[SpanBatch], topk: int) -> list[SpanBatch]:
    """Each batch with the full-context model's top-``topk`` log-probs at every position."""
    out = []
    for b in batches:
        logits = query_logits(base, ExactDocState(doc_kv), b.ids.to(base.device), n, b.mask.to(base.device))
        ids, logprobs = topk_logprobs(logits, topk)  # [b, m, K] each: the targets stage's teacher top-K
        out.append(dataclasses.replace(b, topk_ids=ids.cpu(), topk_logprobs=logprobs.cpu()))
    return out


def span_kl(base: BaseLM, module: NectarModule, n: int, batches: list[SpanBatch]) -> float:
    """Mean KL (top-K + tail) a scored token of the spans, the module as the document."""
    total, count = 0.0, 0
    with torch.no_grad():
        for b in batches:
            total += float(_kl_sum(base, module, n, b))
            count += int(b.scored.sum())
    return total / max(count, 1)


def _kl_sum(base: BaseLM, module: NectarModule, n: int, b: SpanBatch) -> torch.Tensor:
    dev = base.device
    logits = query_logits(base, ModuleDocState(module), b.ids.to(dev), n, b.mask.to(dev))  # [b, m, V]
    return kl_topk_tail_sum(logits, b.topk_ids.to(dev), b.topk_logprobs.to(dev), b.scored.to(dev))


WARMUP_SHARE = 0.05  # the cosine schedule's linear warm-up: this share of the steps


def lr_factor(schedule: str, step: int, steps: int) -> float:
    """The share of the peak rate at 0-based ``step`` of ``steps``: 1 throughout ("constant"), or a linear
    warm-up over ``WARMUP_SHARE`` of the steps and a cosine decay to 0 at the last step ("cosine")."""
    if schedule == "constant":
        return 1.0
    if schedule != "cosine":
        raise ValueError(f"lr_schedule {schedule!r}: expected 'constant' or 'cosine'")
    warm = max(1, math.ceil(WARMUP_SHARE * steps))
    if step < warm:
        return (step + 1) / warm
    return 0.5 * (1.0 + math.cos(math.pi * (step - warm + 1) / max(steps - warm, 1)))


def refine(base: BaseLM, module: NectarModule, n: int, batches: list[SpanBatch], steps: int, lr: float,
           seed: int = 0, log=None, schedule: str = "constant") -> tuple[NectarModule, dict[str, float]]:
    """``steps`` Adam steps on the module as stored (one batch a step, batches in a seeded order that
    cycles; the rate ``lr`` × ``lr_factor(schedule, …)``); returns the module (rounded onto its grid) and the
    spans' KL before and after."""
    before = span_kl(base, module, n, batches)
    start = {k: v.detach().clone() for k, v in module.state_dict().items()}
    for p in base.model.parameters():  # the base model is frozen: only the state moves
        p.requires_grad_(False)
    rng = np.random.default_rng(seed)
    order: list[int] = []
    module.train()
    with trained_as_stored(module):
        params = [p for p in module.parameters() if p.requires_grad]
        opt = torch.optim.Adam(params, lr=lr)
        for step in range(steps):
            for group in opt.param_groups:
                group["lr"] = lr * lr_factor(schedule, step, steps)
            if not order:
                order = list(rng.permutation(len(batches)))
            b = batches[order.pop()]
            opt.zero_grad(set_to_none=True)
            loss = _kl_sum(base, module, n, b) / max(int(b.scored.sum()), 1)
            loss.backward()
            for p in params:  # masked slots (β = −inf) give NaN gradients through −inf − −inf: none move
                if p.grad is not None:
                    p.grad.nan_to_num_(0.0, 0.0, 0.0)
            opt.step()
            if log is not None:
                log(step, loss.item())
    module.eval()
    quantize_module_(module)
    after = span_kl(base, module, n, batches)
    if not after < before:  # the steps did not help on the spans themselves: keep the fit
        module.load_state_dict(start)
    return module, {"span_kl_fit": before, "span_kl_refined": after}


def refines(cfg: RefineConfig, plan, n: int) -> bool:
    """Whether ``cfg``'s steps run on a state laid out as ``plan`` for an ``n``-token document: any steps, and
    with ``when: auto`` only where its kept pairs are at most GREEDY_SHARE of the document's entries."""
    pairs = plan.quad_head_pairs or tuple((p,) * plan.num_kv_heads for p in plan.quad_pairs)  # [L][Hkv] kept
    return cfg.steps > 0 and (cfg.when == "always" or scarce_counts(pairs, n))


def step_count(cfg: RefineConfig, n: int) -> int:
    """The steps ``cfg`` takes on an ``n``-token document: ``steps``, or ``steps`` per ``per_tokens`` tokens when
    that is more (a longer text has proportionally more spans to cover)."""
    if cfg.per_tokens <= 0:
        return cfg.steps
    return max(cfg.steps, math.ceil(cfg.steps * n / cfg.per_tokens))


def refine_fitted(base: BaseLM, layout: PromptLayout, doc_kv, spans: list[tuple[str, str]], fitted: FittedState,
                  cfg: RefineConfig, seed: int = 0, timings: dict[str, float] | None = None,
                  progress: Callable[[int, int], None] | None = None) -> FittedState:
    """``fitted`` after ``cfg.steps`` steps (the first stage's ``first.refine``, the train stage's
    ``train.end_to_end`` and the method's fit): the teacher's pass, the steps (a progress line every ~1/8 of
    them; ``progress(done, total)`` after each, a stage's bar) and the span KLs in ``timings``. None of it where
    ``cfg.when`` is "auto" and the state's keys are not scarce (``refines``)."""
    if not refines(cfg, fitted.plan, layout.n):
        return fitted
    timings = {} if timings is None else timings
    started = time.perf_counter()
    batches = with_teacher(base, doc_kv, layout.n, span_batches(layout, spans, cfg.batch_tokens), cfg.topk)
    steps = step_count(cfg, layout.n)
    every = max(1, steps // 8)

    def log(step: int, loss: float) -> None:  # long work shows progress: ~8 lines a refinement
        if progress is not None:
            progress(step + 1, steps)
        if step % every == 0 or step == steps - 1:
            print(f"refine: step {step + 1}/{steps}, span KL {loss:.4f} ({time.perf_counter() - started:.0f} s)",
                  flush=True)

    module, facts = refine(base, fitted.module.to(base.device), layout.n, batches, steps, cfg.lr, seed, log,
                           cfg.lr_schedule)
    timings["refine_s"] = timings.get("refine_s", 0.0) + time.perf_counter() - started
    timings.update(facts, refine_steps=steps)
    print(f"refine: span KL {facts['span_kl_fit']:.4f} -> {facts['span_kl_refined']:.4f} ({steps} steps, "
          f"{timings['refine_s']:.0f} s{'' if facts['span_kl_refined'] < facts['span_kl_fit'] else '; kept the fit'})",
          flush=True)
    return FittedState(fitted.name, module, fitted.plan, scores=fitted.scores)


@dataclass(frozen=True)
class ReconRefine(ReconFit):
    """recon_fit (its fields) and then ``steps`` steps of end-to-end KL on the reconstruction spans (the fields of
    ``RefineConfig``; 200 steps here, where the first stage's ``first.refine.steps`` is 0 unless set)."""

    steps: int = REFINE_STEPS  # Adam steps, one batch of spans each
    lr: float = RefineConfig().lr  # Adam's rate on the float behind each stored code
    batch_tokens: int = RefineConfig().batch_tokens  # padded tokens a step (count × longest)
    topk: int = RefineConfig().topk  # the teacher's top-K of the KL (+ the tail bucket)
    when: str = RefineConfig().when  # "always", or "auto": the steps only where keys are scarce (the first state's)
    per_tokens: int = RefineConfig().per_tokens  # 0: ``steps``; N: ``steps`` per N document tokens when more
    lr_schedule: str = RefineConfig().lr_schedule  # "constant", or "cosine": warm-up, then decay to 0 at the last step

    name = "recon_refine"
    # fields added after states were cached, with the default that left them out of the digest (compose.py
    # method_settings): a constant-rate state fitted before lr_schedule existed is the same state
    added_settings = (("lr_schedule", "constant"),)

    @property
    def select(self) -> SelectionConfig:
        fields = {k: v for k, v in dataclasses.asdict(self).items() if k not in REFINE_FIELDS}
        return SelectionConfig(fit=fields.pop("fit_pairs"), **fields)

    @property
    def refine_config(self) -> RefineConfig:
        return RefineConfig(**{k: getattr(self, k) for k in REFINE_FIELDS})

    @classmethod
    def from_select(cls, select: SelectionConfig, refine: RefineConfig | None = None) -> "ReconRefine":
        fields = select.model_dump()
        return cls(fit_pairs=fields.pop("fit"), **fields, **(refine or RefineConfig(steps=REFINE_STEPS)).model_dump())

    def configured(self, module) -> "ReconRefine":
        return self.from_select(module.select, self.refine_config)

    def with_options(self, **options) -> "ReconRefine":
        """Settings changed by their config names: ``select``'s and ``RefineConfig``'s."""
        refine = {k: options.pop(k) for k in list(options) if k in REFINE_FIELDS}
        select = self.select.model_copy(update=options) if options else self.select
        return self.from_select(select, self.refine_config.model_copy(update=refine))

    def fit(self, plan, inputs: FitInputs) -> FittedState:
        if not self.fit_pairs:
            raise ValueError("recon_refine refines the fitted state: set fit=true")
        fitted = super().fit(plan, inputs)
        refined = refine_fitted(inputs.base, inputs.layout, inputs.doc_kv, list(inputs.spans), fitted,
                                self.refine_config, inputs.seed)
        return dataclasses.replace(refined, name=self.name)
