"""The server's one seam to the decode engine: ``nectar.attention.run.generate``.

Everything the server knows about the engine is in this file, so moving to another engine (per-row
sampling parameters, requests joining a running batch) changes this file only. Today's engine takes
one set of sampling parameters per batch and a batch-wide token budget, streams every token through
``on_token(row, token)``, and has no way to retire one row early. So:

* ``batch_key``: requests may share a batch when their sampling is the same — all greedy requests
  together; sampled requests with equal (temperature, top_p); a *seeded* sampled request alone,
  because the engine draws one random stream for the whole batch and the same seed must give the
  same answer whatever else is running (it then equals ``nectar ask --seed``).
* the batch runs to the largest max_tokens in it; each row's job stops taking tokens at its own
  max_tokens, stop string or end-of-sequence, and answers its client at once.
* end-of-sequence is detected here (the engine is given no stop ids, so it hands every token over),
  and once every row is finished the batch is ended by raising out of ``on_token``: the engine's
  attention hooks are removed in a ``finally``, and no step is decoded that nobody reads.
"""
from __future__ import annotations

import random
from collections.abc import Hashable

from ..attention.run import _stop_ids, generate
from ..models import BaseModel
from .job import Job, SamplingParams


class _BatchFinished(Exception):
    """Every row of the batch is finished: leave the engine's decode loop."""


class ModuleEngine:
    """Decodes batches of jobs with the base model plus the module (no document in context)."""

    joins_running_batch = False  # today's engine: a request that arrives mid-batch waits for the next

    def __init__(self, base: BaseModel, provider, n_context: int):
        self.base, self.provider, self.n_context = base, provider, n_context
        self.eos = frozenset(_stop_ids(base))
        self._seeds = random.Random()

    def batch_key(self, params: SamplingParams) -> Hashable:
        if params.temperature <= 0:
            return ("greedy",)
        if params.seed is not None:
            return ("seeded", object())  # unique: runs alone
        return ("sampled", params.temperature, params.top_p)

    def run(self, jobs: list[Job]) -> None:
        """Decode one batch (jobs of one ``batch_key``); every job ends finished or failed."""
        params = jobs[0].params
        seed = params.seed if params.seed is not None else self._seeds.randrange(2**31)

        def on_token(row: int, token: int) -> None:
            job = jobs[row]
            if job.finished:
                return
            if token in self.eos:
                job.finish("stop")
            else:
                job.accept(token)
            if all(j.finished for j in jobs):
                raise _BatchFinished

        try:
            generate(self.base, self.provider, self.n_context, [j.prompt_ids for j in jobs],
                     max(j.params.max_tokens for j in jobs), params.temperature, params.top_p, seed,
                     stop_ids=(), on_token=on_token)
        except _BatchFinished:
            pass
        for job in jobs:  # the engine's budget ran out first (cannot happen while budgets agree)
            job.finish("length")
