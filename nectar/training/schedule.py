"""Derived hyperparameters and the warmup–cosine schedule (paper App. A.4).

    steps  N  = ceil(samples / b)                          (total sample budget)
    peak      = peak_lr · sqrt(b / b_ref)                  (batch-noise compensation)
    warmup    = min(N / 40, 10 · N_items / b) iterations   (2.5 % of the budget or ten epochs)
    lr(s)     = peak · (s+1)/warmup                  for s < warmup   (from 0 up)
              = peak · ½(1 + cos(π (s − warmup) / (N − warmup)))      (down towards 0)

b is the global batch (all data-parallel ranks together), so the schedule and the sample budget
don't depend on how many processes train (the paper scales by the per-device batch).
"""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Schedule:
    total_steps: int
    warmup_steps: int
    peak_lr: float
    batch_size: int
    n_items: int  # training items per epoch (tokens or pairs)

    def factor(self, step: int) -> float:
        """lr(step) / peak for 0-based optimizer step ``step``."""
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        span = max(1, self.total_steps - self.warmup_steps)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, (step - self.warmup_steps) / span)))

    def lr(self, step: int) -> float:
        return self.peak_lr * self.factor(step)


def derive_schedule(samples: int, batch_size: int, ref_batch_size: int, peak_lr: float,
                    n_items: int) -> Schedule:
    if samples <= 0 or batch_size <= 0 or ref_batch_size <= 0:
        raise ValueError(f"samples ({samples}), batch_size ({batch_size}) and ref_batch_size "
                         f"({ref_batch_size}) must be positive")
    total = math.ceil(samples / batch_size)
    warmup = max(1, int(min(total / 40, 10 * n_items / batch_size)))
    peak = peak_lr * math.sqrt(batch_size / ref_batch_size)
    return Schedule(total, min(warmup, total), peak, batch_size, n_items)


class LRFactor:
    """Picklable LambdaLR callable (LambdaLR checkpoints callable objects' state)."""

    def __init__(self, schedule: Schedule):
        self.schedule = schedule

    def __call__(self, step: int) -> float:
        return self.schedule.factor(step)
