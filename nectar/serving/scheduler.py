"""Dynamic batching: a bounded queue of jobs and one engine thread that decodes them in batches.

The thread takes the oldest waiting job, waits ``batch_wait`` for company, and decodes it together
with up to ``max_batch - 1`` more waiting jobs the engine lets share its batch (``batch_key``),
oldest first. Requests that arrive while a batch runs wait for the next one (or join the running
batch, once the engine can: ``ModuleEngine.joins_running_batch``). The queue is bounded: a full
queue refuses new jobs at once with an estimate of when to retry, instead of letting latency grow
without limit. ``close`` lets the thread finish everything already accepted, then stops it.
"""
from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from dataclasses import dataclass

from .job import Job

log = logging.getLogger("nectar.serve")


class QueueFull(Exception):
    def __init__(self, waiting: int, limit: int, retry_after_s: int):
        super().__init__(f"{waiting} requests are waiting, the queue limit is {limit}")
        self.waiting, self.limit, self.retry_after_s = waiting, limit, retry_after_s


class ShuttingDown(Exception):
    pass


@dataclass
class SchedulerStats:
    batches: int = 0
    rows: int = 0
    largest_batch: int = 0
    tokens: int = 0
    failed_batches: int = 0
    batch_s_avg: float = 0.0  # moving average of a batch's wall time, for Retry-After


class Scheduler:
    def __init__(self, engine, max_batch: int, max_queue: int, batch_wait_s: float = 0.005):
        self.engine, self.max_batch, self.max_queue, self.batch_wait_s = engine, max_batch, max_queue, batch_wait_s
        self.stats = SchedulerStats()
        self.running = 0  # rows in the batch being decoded
        self._queue: deque[Job] = deque()
        self._cv = threading.Condition()
        self._closing = False
        self._thread = threading.Thread(target=self._loop, name="nectar-engine", daemon=True)

    # ----- any thread -----
    def start(self) -> None:
        self._thread.start()

    def submit(self, job: Job) -> None:
        with self._cv:
            if self._closing:
                raise ShuttingDown("the server is shutting down")
            self._drop_cancelled()
            if len(self._queue) >= self.max_queue:
                raise QueueFull(len(self._queue), self.max_queue, self._retry_after())
            job.batch_key = self.engine.batch_key(job.params)
            self._queue.append(job)
            self._cv.notify()

    @property
    def waiting(self) -> int:
        return len(self._queue)

    def close(self, timeout: float | None = None) -> None:
        """Refuse new jobs, decode the accepted ones, stop the thread."""
        with self._cv:
            self._closing = True
            self._cv.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # ----- engine thread -----
    def _loop(self) -> None:
        while True:
            batch = self._next_batch()
            if batch is None:
                return
            self._decode(batch)

    def _next_batch(self) -> list[Job] | None:
        with self._cv:
            while True:
                self._drop_cancelled()
                if self._queue:
                    break
                if self._closing:
                    return None
                self._cv.wait()
            if self.batch_wait_s > 0 and len(self._queue) < self.max_batch and not self._closing:
                # Requests sent together arrive a few ms apart: wait briefly so they share a batch.
                self._cv.wait_for(lambda: len(self._queue) >= self.max_batch or self._closing, self.batch_wait_s)
            first = self._queue.popleft()
            batch = [first]
            for job in list(self._queue):
                if len(batch) >= self.max_batch:
                    break
                if job.batch_key == first.batch_key and not job.cancelled:
                    batch.append(job)
                    self._queue.remove(job)
            self.running = len(batch)
            return batch

    def _decode(self, batch: list[Job]) -> None:
        t0 = time.monotonic()
        for job in batch:
            job.started_at = t0
        try:
            self.engine.run(batch)
        except Exception as exc:  # one bad batch must not stop the server
            log.exception("decoding a batch of %d failed", len(batch))
            self.stats.failed_batches += 1
            for job in batch:
                job.fail(f"the decode engine failed: {type(exc).__name__}: {exc}")
        dt = time.monotonic() - t0
        s = self.stats
        s.batches += 1
        s.rows += len(batch)
        s.largest_batch = max(s.largest_batch, len(batch))
        s.tokens += sum(j.completion_tokens for j in batch)
        s.batch_s_avg = dt if s.batches == 1 else 0.8 * s.batch_s_avg + 0.2 * dt
        self.running = 0

    # ----- helpers (hold the lock) -----
    def _drop_cancelled(self) -> None:
        if any(j.cancelled for j in self._queue):
            self._queue = deque(j for j in self._queue if not j.cancelled)

    def _retry_after(self) -> int:
        """Seconds until the queue has room, from the recent batch time: one batch frees max_batch places."""
        batches_ahead = math.ceil((len(self._queue) + 1) / self.max_batch)
        return max(1, math.ceil(batches_ahead * (self.stats.batch_s_avg or 1.0)))
