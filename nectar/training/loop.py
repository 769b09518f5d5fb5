"""The training loop: λα·Lα + λA·LA + λKL·LKL with AdamW, warmup–cosine, clipping, NaN masking.

* Pure regression (λKL = 0) trains on random query *tokens* of the train split; with distillation
  it trains on whole *pairs*, teacher-forced through the frozen base model with the module as
  the document provider (only module parameters get gradients), plus regression on their tokens.
* A step whose loss or gradients are non-finite is skipped (no update) and counted;
  ``max_bad_steps`` consecutive skipped steps stop the run with ``TrainingDiverged`` — the last
  checkpoint, written only from finite parameters, stays on disk.
* Checkpoints every ``checkpoint_every`` steps make a resumed run continue bit-for-bit.
* Train and held-out metrics are logged every ``eval_every`` steps (and at step 0 and the end).
"""
from __future__ import annotations

import contextlib
import math
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch
from torch import nn

from ..attention.forward import query_logits
from ..modules.builder import NectarModule
from ..modules.provider import ModuleDocState
from ..schemas.artifacts import TrainLogRow
from ..schemas.config import TrainConfig
from .checkpoint import load_checkpoint, rng_state, save_checkpoint, set_rng_state
from ..targets.reader import PairBatch, TargetsData, TokenBatch, padded_groups
from .data import shard_for_rank, stream
from .distributed import DistInfo, all_ranks_agree, all_reduce_sum, barrier, dist_info, wrap
from ..kl import kl_topk_tail_sum
from .losses import correct_sum, regression_sums
from .schedule import LRFactor, Schedule, derive_schedule

MICRO_BATCH_TOKENS = 2048  # padded query tokens per forward through the base model (bounds the [m, V] logits)
MAX_EVAL_PAIRS = 32  # held-out pairs per evaluation (the first ones of the test split, fixed)
Progress = Callable[[int, int], None]
_STAT_KEYS = ("alpha", "A", "rte_alpha", "rte_A", "n_terms", "tokens", "kl", "correct", "positions")


class TrainingDiverged(RuntimeError):
    pass


@dataclass(frozen=True)
class LossWeights:
    alpha: float
    A: float
    kl: float


@dataclass
class TrainState:
    step: int = 0
    samples: int = 0
    bad_streak: int = 0
    skipped: int = 0
    log_rows: list[dict[str, Any]] = field(default_factory=list)
    window: dict[str, float] = field(default_factory=dict)  # train stats summed since the last log
    grad_norms: list[float] = field(default_factory=list)


@dataclass
class TrainResult:
    state: TrainState
    schedule: Schedule
    resumed_from: int
    stopped_early: bool

    @property
    def rows(self) -> list[TrainLogRow]:
        return [TrainLogRow.model_validate(r) for r in self.state.log_rows]


class Objective(nn.Module):
    """Loss of one micro-batch. The module is its only submodule, so DDP syncs only NECTAR weights."""

    def __init__(self, module: NectarModule, base, n_context: int, per_element: tuple[float, float] = (1.0, 1.0)):
        super().__init__()
        self.module = module
        self._base = (base,)  # a tuple hides the frozen base model from nn.Module / DDP
        self.n_context = n_context
        # Elements per token of the α and A sums (L·Hq and L·Hq·d) under regression_scale="mean", else 1.
        self.per_alpha, self.per_A = per_element

    def forward(self, batch: TokenBatch | PairBatch, w: LossWeights, denom_tokens: float,
                denom_kl: float, scale: float) -> tuple[torch.Tensor, dict[str, float]]:
        device = next(self.module.parameters()).device
        t = batch.targets if isinstance(batch, PairBatch) else batch
        reg = regression_sums(self.module, t.q.to(device), t.alpha.to(device), t.A.to(device))
        loss = reg.A.new_zeros(())
        if w.alpha:
            loss = loss + w.alpha * reg.alpha / (denom_tokens * self.per_alpha)
        if w.A:
            loss = loss + w.A * reg.A / (denom_tokens * self.per_A)
        stats = {"alpha": reg.alpha.item(), "A": reg.A.item(), "rte_alpha": reg.rte_alpha.item(),
                 "rte_A": reg.rte_A.item(), "n_terms": reg.n_terms, "tokens": t.n_tokens}
        if isinstance(batch, PairBatch) and w.kl:
            kl, correct, positions = self.kl_terms(batch, device)
            loss = loss + w.kl * kl / denom_kl
            stats.update(kl=kl.item(), correct=correct, positions=positions)
        return loss * scale, stats

    def kl_terms(self, batch: PairBatch, device) -> tuple[torch.Tensor, int, int]:
        logits = query_logits(self._base[0], ModuleDocState(self.module), batch.input_ids.to(device),
                              self.n_context, batch.attention_mask.to(device))  # [b, m, V]
        mask = batch.kl_mask.to(device)
        kl = kl_topk_tail_sum(logits, batch.topk_ids.to(device), batch.topk_logprobs.to(device), mask)
        correct = int(correct_sum(logits, batch.next_ids.to(device), mask))
        return kl, correct, int(mask.sum())


def micro_batches(data: TargetsData, pairs: np.ndarray, max_tokens: int) -> list[np.ndarray]:
    """Consecutive groups of pairs whose padded size (count × longest) stays within max_tokens."""
    lengths = data.offsets[pairs + 1] - data.offsets[pairs]
    return [pairs[g] for g in padded_groups(lengths, max_tokens)]


class Trainer:
    def __init__(self, module: NectarModule, arch: str, data: TargetsData, base, cfg: TrainConfig,
                 ckpt_url: str, fingerprint: str, info: DistInfo | None = None,
                 micro_tokens: int = MICRO_BATCH_TOKENS):
        self.module, self.data, self.base, self.cfg = module, data, base, cfg
        self.info = info or dist_info()
        self.ckpt_url, self.fingerprint, self.micro_tokens = ckpt_url, fingerprint, micro_tokens
        # The quadrature score is closed-form from W (paper §3.3): λα is forced to 0. With a log-mass
        # bias β it is not: A is invariant to a common shift of β, so only Lα (or KL) pins a(q).
        has_bias = getattr(module.layers[0], "beta", None) is not None
        closed_form_score = arch == "quadrature" and not has_bias
        self.w = LossWeights(0.0 if closed_form_score else cfg.lambda_alpha, cfg.lambda_A, cfg.lambda_kl)
        if not (self.w.alpha or self.w.A or self.w.kl):
            raise ValueError("all loss weights are zero (lambda_alpha, lambda_A, lambda_kl): nothing to train")
        self.pair_mode = self.w.kl > 0
        # Train items (pairs or tokens) in a (seed, step)-pure order, streamed from the store.
        self.stream = stream(data, cfg.splits, by_pairs=self.pair_mode, seed=cfg.seed)
        if cfg.batch_size < self.info.world_size:
            raise ValueError(f"train.batch_size ({cfg.batch_size}) must be at least the number of "
                             f"data-parallel processes ({self.info.world_size})")
        self.schedule = derive_schedule(cfg.samples, cfg.batch_size, cfg.ref_batch_size, cfg.peak_lr,
                                        self.stream.n_items)
        h = data.header
        per_element = ((h.num_layers * h.num_q_heads, h.num_layers * h.num_q_heads * h.head_dim)
                       if cfg.regression_scale == "mean" else (1.0, 1.0))
        self.objective = Objective(module, base, h.n_context, per_element)
        self.optimizer = torch.optim.AdamW(module.parameters(), lr=self.schedule.peak_lr,
                                           weight_decay=cfg.weight_decay)
        self.lr_sched = torch.optim.lr_scheduler.LambdaLR(self.optimizer, LRFactor(self.schedule))
        self.state = TrainState()
        self.resumed_from = self._restore()
        unused = not self.w.kl and not (self.w.alpha and self.w.A)  # e.g. an untrained score head
        self.model = wrap(self.objective, self.info, find_unused=unused)

    # ---- checkpoints ------------------------------------------------------------------------
    def _restore(self) -> int:
        ckpt = load_checkpoint(self.ckpt_url, self.fingerprint)
        if ckpt is None:
            return 0
        self.module.load_state_dict(ckpt["module"])
        self.optimizer.load_state_dict(ckpt["optimizer"])
        self.lr_sched.load_state_dict(ckpt["scheduler"])
        set_rng_state(ckpt["rng"])
        self.state = TrainState(**ckpt["state"])
        return self.state.step

    def _checkpoint(self) -> None:
        if self.info.is_main:
            s = self.state
            save_checkpoint(self.ckpt_url, {
                "fingerprint": self.fingerprint, "module": self.module.state_dict(),
                "optimizer": self.optimizer.state_dict(), "scheduler": self.lr_sched.state_dict(),
                "rng": rng_state(), "data_position": s.step * self.cfg.batch_size,
                "state": {"step": s.step, "samples": s.samples, "bad_streak": s.bad_streak,
                          "skipped": s.skipped, "log_rows": list(s.log_rows), "window": dict(s.window),
                          "grad_norms": list(s.grad_norms)},
            })
        barrier(self.info)

    # ---- one step ---------------------------------------------------------------------------
    def _step(self, global_idx: np.ndarray) -> tuple[bool, dict[str, float], float]:
        d, w, info = self.data, self.w, self.info
        local = shard_for_rank(global_idx, info.rank, info.world_size)
        if self.pair_mode:
            denom_tokens, denom_kl = d.pair_tokens(global_idx), max(1, d.kl_positions(global_idx))
            groups = micro_batches(d, local, self.micro_tokens)
        else:
            denom_tokens, denom_kl, groups = len(global_idx), 1, [local]
        self.optimizer.zero_grad(set_to_none=True)
        stats = dict.fromkeys(_STAT_KEYS, 0.0)
        loss_ok = True
        for i, mb in enumerate(groups):
            batch = d.pair_batch(mb, self._pad_id()) if self.pair_mode else d.rows(mb)
            last = i == len(groups) - 1
            sync = contextlib.nullcontext() if (last or not info.active) else self.model.no_sync()
            with sync:
                # DDP averages gradients over ranks; × world_size makes the sum the global mean.
                loss, s = self.model(batch, w, denom_tokens, denom_kl, float(info.world_size))
                loss_ok &= bool(torch.isfinite(loss))
                loss.backward()
            for k, v in s.items():
                stats[k] += v
        gnorm = float(torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.cfg.grad_clip))
        ok = all_ranks_agree(loss_ok and math.isfinite(gnorm), info)
        if ok:
            self.optimizer.step()
        return ok, self._reduce(stats), gnorm

    def _reduce(self, stats: dict[str, float]) -> dict[str, float]:
        if not self.info.active:
            return stats
        return dict(zip(_STAT_KEYS, all_reduce_sum([stats[k] for k in _STAT_KEYS], self.info)))

    def _pad_id(self) -> int:
        return int(getattr(self.base.tokenizer, "pad_token_id", 0) or 0)

    # ---- logging ----------------------------------------------------------------------------
    def _row(self, split: str, stats: dict[str, float], grad_norm: float | None) -> dict[str, Any]:
        tokens, positions = max(stats.get("tokens", 0), 1), stats.get("positions", 0)
        # in the loss's own units (per element under regression_scale="mean"), so the logged terms
        # are the magnitudes the λ weights multiply
        la = stats.get("alpha", 0) / tokens / self.objective.per_alpha
        lA = stats.get("A", 0) / tokens / self.objective.per_A
        lkl = stats.get("kl", 0) / positions if positions else 0.0
        n_terms = max(stats.get("n_terms", 0), 1)
        row = TrainLogRow(
            step=self.state.step, samples=self.state.samples, split=split,
            lr=self.schedule.lr(max(self.state.step - 1, 0)),
            loss=self.w.alpha * la + self.w.A * lA + self.w.kl * lkl,
            loss_alpha=la, loss_A=lA, loss_kl=lkl,
            rte_A=stats.get("rte_A", 0) / n_terms, rte_alpha=stats.get("rte_alpha", 0) / n_terms,
            token_acc=stats["correct"] / positions if positions else None,
            grad_norm=grad_norm, skipped_nonfinite=self.state.skipped)
        return row.model_dump(mode="json")

    @torch.no_grad()
    def evaluate(self) -> dict[str, float] | None:
        """Held-out regression metrics, KL and token accuracy on the first test pairs."""
        pairs = self.data.pairs("test")[:MAX_EVAL_PAIRS]
        if len(pairs) == 0:
            return None
        device = next(self.module.parameters()).device
        stats = dict.fromkeys(_STAT_KEYS, 0.0)
        for mb in micro_batches(self.data, pairs, self.micro_tokens):
            batch = self.data.pair_batch(mb, self._pad_id())
            _, s = self.objective(batch, LossWeights(0, 0, 0), 1.0, 1.0, 1.0)
            kl, correct, positions = self.objective.kl_terms(batch, device)
            s.update(kl=kl.item(), correct=correct, positions=positions)
            for k, v in s.items():
                stats[k] += v
        return stats

    def _log(self, with_train: bool) -> None:
        s = self.state
        if with_train and s.window:
            norms = [g for g in s.grad_norms if math.isfinite(g)]
            s.log_rows.append(self._row("train", s.window, sum(norms) / len(norms) if norms else None))
        if self.info.is_main:
            held = self.evaluate()
            if held is not None:
                s.log_rows.append(self._row("heldout", held, None))
        s.window, s.grad_norms = {}, []

    # ---- the loop ---------------------------------------------------------------------------
    def run(self, progress: Progress | None = None, stop_after: int | None = None) -> TrainResult:
        cfg, s, total = self.cfg, self.state, self.schedule.total_steps
        if s.step == 0 and not s.log_rows:
            self._log(with_train=False)  # the untrained module's held-out baseline
        while s.step < total:
            if stop_after is not None and s.step >= stop_after:
                return TrainResult(s, self.schedule, self.resumed_from, stopped_early=True)
            ok, stats, gnorm = self._step(self.stream.batch(s.step, cfg.batch_size))
            with warnings.catch_warnings():  # a skipped first step trips "scheduler before optimizer"
                warnings.simplefilter("ignore", UserWarning)
                self.lr_sched.step()  # the schedule follows samples consumed, skipped or not
            s.step += 1
            s.samples += cfg.batch_size
            if ok:
                s.bad_streak = 0
                for k, v in stats.items():
                    s.window[k] = s.window.get(k, 0.0) + v
                s.grad_norms.append(gnorm)
            else:
                s.bad_streak += 1
                s.skipped += 1
                if s.bad_streak >= cfg.max_bad_steps:
                    raise TrainingDiverged(
                        f"training diverged: {s.bad_streak} consecutive steps with a non-finite loss or "
                        f"gradient (up to step {s.step}; {s.skipped} skipped in all). The last checkpoint "
                        f"in {self.ckpt_url} holds the last finite parameters; lower train.peak_lr or "
                        "check the targets for NaN/inf")
            if s.step % cfg.eval_every == 0 or s.step == total:
                self._log(with_train=True)
            if s.step % cfg.checkpoint_every == 0 or s.step == total:
                self._checkpoint()
            if progress is not None:
                progress(s.step, total)
        return TrainResult(s, self.schedule, self.resumed_from, stopped_early=False)
