"""Continuous batching: a bounded queue of jobs and one engine thread that decodes them.

The thread takes the oldest waiting job, waits ``batch_wait`` for company, and starts decoding it
with up to ``max_batch - 1`` more waiting jobs, oldest first. While that batch decodes, the engine
asks at every step (``_admit``) for jobs to fill the rows that are free: a request that arrives
mid-decode joins the running batch at the next step, and one that finishes leaves it at once, so
a short question does not wait for the longest answer in flight. Jobs of any document and any
sampling share the batch. The queue is bounded: a full queue refuses new jobs at once with an
estimate of when to retry, instead of letting latency grow without limit. ``close`` lets the
thread finish everything already accepted, then stops it.
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
    batches: int = 0  # engine runs (a run lasts while rows keep joining)
    rows: int = 0  # jobs that started decoding
    largest_batch: int = 0
    tokens: int = 0
    failed_batches: int = 0
    job_s_avg: float = 0.0  # moving average of a job's decode time, for Retry-After


class Scheduler:
    def __init__(self, engine, max_batch: int, max_queue: int, batch_wait_s: float = 0.005):
        self.engine, self.max_batch, self.max_queue, self.batch_wait_s = engine, max_batch, max_queue, batch_wait_s
        self.stats = SchedulerStats()
        self._queue: deque[Job] = deque()
        self._running: list[Job] = []  # jobs in the engine's batch (finished ones leave at the next step)
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
            self._queue.append(job)
            self._cv.notify()

    @property
    def waiting(self) -> int:
        return len(self._queue)

    @property
    def running(self) -> int:
        return sum(1 for j in list(self._running) if not j.finished)

    def snapshot(self) -> tuple[list[Job], list[Job]]:
        """(waiting, running) jobs, for the metrics."""
        with self._cv:
            return list(self._queue), [j for j in self._running if not j.finished]

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
            batch = self._first_batch()
            if batch is None:
                return
            self._decode(batch)

    def _first_batch(self) -> list[Job] | None:
        with self._cv:
            while True:
                self._drop_cancelled()
                if self._queue:
                    break
                if self._closing:
                    return None
                self._cv.wait()
            if self.batch_wait_s > 0 and len(self._queue) < self.max_batch and not self._closing:
                # Requests sent together arrive a few ms apart: wait briefly so they start together.
                self._cv.wait_for(lambda: len(self._queue) >= self.max_batch or self._closing, self.batch_wait_s)
            return self._take(0)

    def _admit(self, active: int) -> list[Job]:
        """The engine's call at every step: waiting jobs for the rows that are free."""
        with self._cv:
            self._drop_cancelled()
            return self._take(active)

    def _take(self, active: int) -> list[Job]:
        """(holds the lock) Up to max_batch - active waiting jobs, oldest first, now running."""
        self._retire()
        taken = []
        while self._queue and active + len(taken) < self.max_batch:
            taken.append(self._queue.popleft())
        now = time.monotonic()
        for job in taken:
            job.started_at = now
        self._running.extend(taken)
        s = self.stats
        s.rows += len(taken)
        s.largest_batch = max(s.largest_batch, active + len(taken))
        return taken

    def _retire(self) -> None:
        """(holds the lock) Forget finished jobs; their decode time feeds the Retry-After estimate."""
        s = self.stats
        for job in self._running:
            if job.finished:
                s.tokens += job.completion_tokens
                if job.finished_at is not None and job.started_at is not None:
                    dt = job.finished_at - job.started_at
                    s.job_s_avg = dt if s.job_s_avg == 0 else 0.8 * s.job_s_avg + 0.2 * dt
        self._running = [j for j in self._running if not j.finished]

    def _decode(self, batch: list[Job]) -> None:
        jobs = list(batch)
        try:
            self.engine.run(jobs, admit=self._admit)
        except Exception as exc:  # one bad batch must not stop the server
            log.exception("decoding a batch of %d failed", len(jobs))
            self.stats.failed_batches += 1
            for job in jobs:
                job.fail(f"the decode engine failed: {type(exc).__name__}: {exc}")
        with self._cv:
            self.stats.batches += 1
            for job in jobs:  # ended with the run, whatever their state
                if not job.finished:
                    job.fail("the decode engine stopped before this request finished")
            self._retire()

    # ----- helpers (hold the lock) -----
    def _drop_cancelled(self) -> None:
        if any(j.cancelled for j in self._queue):
            self._queue = deque(j for j in self._queue if not j.cancelled)

    def _retry_after(self) -> int:
        """Seconds until the queue has room: every max_batch jobs ahead take about one job's decode time."""
        rounds = math.ceil((len(self._queue) + 1) / self.max_batch)
        return max(1, math.ceil(rounds * (self.stats.job_s_avg or 1.0)))
