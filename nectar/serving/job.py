"""One chat completion on its way through the decode engine.

The engine thread feeds the job its row's tokens (``accept``) and ends it (``finish``); the job turns
tokens into text deltas (stop strings, max_tokens) and hands each event to the asyncio loop of the
HTTP request that waits for it. The two sides share nothing else, so a slow client never stalls a
batch: events queue up in the loop, the engine moves on.
"""
from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Literal

from .text_stream import TextStream


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int
    temperature: float  # 0 = greedy
    top_p: float
    seed: int | None
    stop: tuple[str, ...] = ()


@dataclass(frozen=True)
class JobEvent:
    kind: Literal["delta", "done", "error", "cancelled"]
    text: str = ""  # the delta, or the error message
    finish_reason: Literal["stop", "length"] | None = None


@dataclass
class Job:
    prompt_ids: list[int]
    params: SamplingParams
    tokenizer: object
    loop: asyncio.AbstractEventLoop
    model: str = ""  # the model id the client asked for
    doc: object = None  # its module as a decode provider (None: the engine's own provider)
    n: int | None = None  # the document length the module stands in for (None: the engine's n)
    completion_tokens: int = 0
    finish_reason: str | None = None
    submitted_at: float = field(default_factory=time.monotonic)
    started_at: float | None = None  # joined a running batch
    first_token_at: float | None = None
    finished_at: float | None = None

    def __post_init__(self) -> None:
        self._text = TextStream(self.tokenizer, self.params.stop)
        self._events: asyncio.Queue[JobEvent] = asyncio.Queue()
        self._cancelled = threading.Event()

    # ----- engine thread -----
    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def accept(self, token: int) -> bool:
        """One generated (non end-of-sequence) token; True when the job needs no more tokens."""
        if self.finished:
            return True
        if self.cancelled:
            self.finish_reason, self.finished_at = "cancelled", time.monotonic()
            return True
        self.completion_tokens += 1
        if self.first_token_at is None:
            self.first_token_at = time.monotonic()
        delta = self._text.push(token)
        if delta:
            self._post(JobEvent("delta", delta))
        if self._text.hit_stop:
            self._end("stop")
        elif self.completion_tokens >= self.params.max_tokens:
            self._end("length")
        return self.finished

    def finish(self, reason: Literal["stop", "length"]) -> None:
        """The row ended in the engine: end of sequence ("stop") or the engine's token budget ("length")."""
        if not self.finished:
            self._end(reason)

    def fail(self, message: str) -> None:
        if not self.finished:
            self.finish_reason, self.finished_at = "error", time.monotonic()
            self._post(JobEvent("error", message))

    def _end(self, reason: str) -> None:
        rest = self._text.flush()
        if rest:
            self._post(JobEvent("delta", rest))
        self.finish_reason, self.finished_at = reason, time.monotonic()
        self._post(JobEvent("done", finish_reason=reason))

    def _post(self, event: JobEvent) -> None:
        try:
            self.loop.call_soon_threadsafe(self._events.put_nowait, event)
        except RuntimeError:  # the event loop is closed: nobody is waiting any more
            pass

    # ----- event loop -----
    def cancel(self) -> None:
        """The client went away: drop the job if it waits, free its row at the next token if it runs,
        and end ``events`` for whoever still iterates them."""
        if not self._cancelled.is_set():
            self._cancelled.set()
            self._events.put_nowait(JobEvent("cancelled"))

    async def events(self) -> AsyncIterator[JobEvent]:
        """Deltas, then one "done", "error" or "cancelled" event."""
        while True:
            event = await self._events.get()
            yield event
            if event.kind != "delta":
                return

    @property
    def text(self) -> str:
        return self._text.text
