"""The server's one seam to the decode engine (``nectar.attention.engine.DecodeEngine``).

Everything the server knows about the engine is in this file. The engine samples every row with its
own temperature, top-p, seed and token budget, and a row leaves the batch when ``on_token`` returns
True, so:

* ``batch_key``: any requests may share a batch. A seeded request's draws depend only on its seed and
  token index, so it samples the same answer whatever else is running (it equals ``nectar ask --seed``).
* each row's job stops taking tokens at its own max_tokens, stop string or end-of-sequence, answers its
  client at once, and its row leaves the batch at the engine's next check.
* one ``DecodeEngine`` is kept for the server's lifetime: its buffers (and on CUDA its captured graphs)
  are reused from batch to batch.
"""
from __future__ import annotations

import random
from collections.abc import Hashable

from ..attention.engine import DecodeEngine, Request
from ..base_model import BaseLM
from .job import Job, SamplingParams


class _BatchFinished(Exception):
    """Every row of the batch is finished: leave the engine's decode loop."""


class ModuleEngine:
    """Decodes batches of jobs with the base model plus the module (no document in context)."""

    joins_running_batch = False  # a request that arrives mid-batch waits for the next one

    def __init__(self, base: BaseLM, provider, n_context: int):
        self.base, self.n_context = base, n_context
        # end-of-sequence is the engine's (the model's eos ids): the row ends with finish "stop"
        self.engine = DecodeEngine(base, provider, n_context)
        self._seeds = random.Random()

    @property
    def provider(self):
        return self.engine.provider

    @provider.setter
    def provider(self, provider) -> None:  # swapped in tests to inject failures
        self.engine.provider = provider

    def batch_key(self, params: SamplingParams) -> Hashable:
        return ("any",)  # per-row sampling: every request can share a batch

    def run(self, jobs: list[Job]) -> None:
        """Decode one batch of jobs; every job ends finished or failed."""
        requests = [Request(j.prompt_ids, j.params.max_tokens, j.params.temperature, j.params.top_p,
                            j.params.seed if j.params.seed is not None else self._seeds.randrange(2**31))
                    for j in jobs]
        result = self.engine.run(requests, on_token=lambda row, token: jobs[row].accept(token))
        for job, reason in zip(jobs, result.finish_reasons):
            job.finish("stop" if reason == "stop" else "length")  # no-op for jobs that ended themselves
