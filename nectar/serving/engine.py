"""The server's one seam to the decode engine (``nectar.attention.engine.DecodeEngine``).

Everything the server knows about the engine is in this file. The engine samples every row with its
own temperature, top-p, seed, token budget and document (``Request.doc``: the job's module), takes
new rows at any host check (``admit``) and drops a row when ``on_token`` returns True, so:

* any requests share the running batch, whatever their sampling or their document; a seeded
  request's draws depend only on its seed and token index, so it samples the same answer whatever
  else is running (it equals ``nectar ask --seed``);
* a request that arrives while a batch decodes joins it at the next step (continuous batching);
* each row's job stops taking tokens at its own max_tokens, stop string or end-of-sequence, answers
  its client at once, and its row leaves the batch at the engine's next check;
* one ``DecodeEngine`` is kept for the server's lifetime: its buffers (and on CUDA its captured
  graphs) are reused from run to run.
"""
from __future__ import annotations

import random
from collections.abc import Callable

from ..attention.engine import DecodeEngine, Request
from ..base_model import BaseLM
from .job import Job


class ModuleEngine:
    """Decodes jobs with the base model plus each job's module (no document in context)."""

    def __init__(self, base: BaseLM, provider=None, n_context: int = 0):
        self.base, self.n_context = base, n_context
        # end-of-sequence is the engine's (the model's eos ids): the row ends with finish "stop"
        self.engine = DecodeEngine(base, provider, n_context)
        self._seeds = random.Random()

    def _request(self, j: Job) -> Request:
        p = j.params
        return Request(j.prompt_ids, p.max_tokens, p.temperature, p.top_p,
                       p.seed if p.seed is not None else self._seeds.randrange(2**31), doc=j.doc, n=j.n)

    def run(self, jobs: list[Job], admit: Callable[[int], list[Job]] | None = None) -> None:
        """Decode ``jobs`` and every job ``admit(rows still decoding)`` hands over meanwhile (appended
        to ``jobs``, so a caller that catches an engine failure can fail them all); every job ends
        finished or failed."""
        def take(active: int) -> list[Request]:
            new = admit(active)
            jobs.extend(new)
            return [self._request(j) for j in new]

        result = self.engine.run([self._request(j) for j in jobs], on_token=lambda row, token: jobs[row].accept(token),
                                 admit=take if admit is not None else None)
        for job, reason in zip(jobs, result.finish_reasons):
            job.finish("stop" if reason == "stop" else "length")  # no-op for jobs that ended themselves
