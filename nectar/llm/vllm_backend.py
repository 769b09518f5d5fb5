"""Chat backend for a vLLM server: the OpenAI client plus what vLLM adds.

- ``cache_salt``: the prefix cache is namespaced per document, so verification's hundreds of
  ``document + question`` prompts reuse one cached document prefix, and no two documents share one.
- ``n > 1``: a request that wants several samples (synthesize's samples per chunk) gets them in one
  request, sharing the prompt's prefill.
- JSON-schema ``response_format`` is enforced by vLLM's structured-output engine (xgrammar), so the
  reply is the schema's JSON, not free text to dig in.
The server is either one this process manages (``nectar.vllm.pool``, the process ``nectar.vllm.server``)
or one at ``base_url``. This backend is the one piece of vLLM code outside ``nectar/vllm/``: it is one
of the LLM backends (a subclass of ``OpenAIBackend``), and ``nectar.vllm`` sits below ``nectar.llm``.

A managed server is this backend's to keep alive: when it dies mid-fan-out (its process exits, its
engine dies, /health fails), the requests it had not answered are held back, the server is restarted
(at most ``max_restarts`` times, each reason logged and kept for the manifest) and those requests
are asked again; the answers already given were handed to ``on_result`` (the stage's partial files)
as they came. When it can't be kept up, ``fallback`` (the local loop, for ``backend: auto``)
answers the rest, said in one line; without one the fan-out stops with ``ServerDeadError``, naming
the exit, the end of the server's log and its path.
"""
from __future__ import annotations

import json
import shlex
import sys
import urllib.request
from typing import Any, Callable, Sequence

from .openai_backend import OpenAIBackend
from .types import ChatBackend, ChatRequest, ChatResult, LLMUnavailableError, OnResult, Progress
from ..vllm.notices import say
from ..vllm.server import VLLMServer
from ..vllm.venv import VLLMError


class ServerDeadError(VLLMError, LLMUnavailableError):
    """A managed server died and could not be kept up; the message names its exit, the end of its
    log and the log's path."""


class VLLMBackend(OpenAIBackend):
    name = "vllm"

    def __init__(self, base_url: str, model: str | None, server: VLLMServer | None = None,
                 max_restarts: int = 2, fallback: Callable[[], ChatBackend] | None = None, **kwargs: Any):
        super().__init__(base_url=base_url, model=model, **kwargs)
        self.server = server
        self.max_restarts = max_restarts
        self.fallback = fallback
        self.fell_back: dict[str, Any] | None = None  # {"to", "reason", "requests"} once the local loop took over

    @classmethod
    def managed(cls, server: VLLMServer, **kwargs: Any) -> "VLLMBackend":
        return cls(base_url=server.url, model=server.spec.served_name, server=server, **kwargs)

    @property
    def base_url(self) -> str | None:
        # A restarted server listens on a new port; every backend sharing it follows.
        return self.server.url if self.server is not None else self._base_url

    @base_url.setter
    def base_url(self, value: str | None) -> None:
        self._base_url = value

    def _extra_body(self, req: ChatRequest) -> dict[str, Any]:
        return {"cache_salt": req.cache_salt} if req.cache_salt else {}

    # ----- a managed server that dies -----

    def chat_many(self, requests: Sequence[ChatRequest], progress: Progress | None = None,
                  on_result: OnResult | None = None) -> list[ChatResult]:
        if self.server is None:
            return super().chat_many(requests, progress, on_result)
        requests = list(requests)
        results: list[ChatResult | None] = [None] * len(requests)

        def deliver(i: int, result: ChatResult) -> None:
            results[i] = result
            if on_result is not None:
                on_result(i, result)
            if progress is not None:
                progress(sum(r is not None for r in results), len(requests))

        pending = list(range(len(requests)))
        while pending:
            generation = self.server.generation
            held = self._ask_holding_errors(requests, pending, deliver)
            reason = self.server.death()
            if reason is None:  # a healthy server's failures are the requests' own
                for i, result in held.items():
                    deliver(i, result)
                break
            pending = [i for i in pending if results[i] is None]
            if not pending:
                break
            if not self._revive(reason, generation, len(pending)):
                self._finish_elsewhere(requests, pending, deliver, reason)
                break
        return results  # type: ignore[return-value]

    def _ask_holding_errors(self, requests: list[ChatRequest], pending: list[int],
                            deliver: Callable[[int, ChatResult], None]) -> dict[int, ChatResult]:
        """Ask ``pending``; deliver every answer, hold back failures (a dying server's failures are
        asked again after the restart, a healthy one's delivered by the caller)."""
        held: dict[int, ChatResult] = {}

        def on_sub(j: int, result: ChatResult) -> None:
            if result.error is not None:
                held[pending[j]] = result
            else:
                deliver(pending[j], result)

        try:
            super().chat_many([requests[i] for i in pending], on_result=on_sub)
        except LLMUnavailableError:
            if self.server.death() is None:
                raise  # reachable after all (a wrong model name, a key): not ours to fix by restarting
            # the unanswered requests stay pending for the caller
        return held

    def _revive(self, reason: str, generation: int, n_pending: int) -> bool:
        """Restart the server unless its restarts are spent; False when it can't be kept up."""
        if len(self.server.restarts) >= self.max_restarts:
            return False
        say(f"vllm: the managed server died ({reason}); restarting it "
            f"({len(self.server.restarts) + 1} of at most {self.max_restarts}) to ask {n_pending} "
            f"unanswered request(s) again (log {self.server.log_path})")
        try:
            self.server.restart(reason, generation)
        except VLLMError as exc:
            say(f"vllm: the restart failed: {exc}")
            return False
        say(f"vllm: serving again at {self.server.url} after {self.server.startup_s} s")
        return True

    def _finish_elsewhere(self, requests: list[ChatRequest], pending: list[int],
                          deliver: Callable[[int, ChatResult], None], reason: str) -> None:
        message = self.server.death_message(reason)
        if self.fallback is None:
            raise ServerDeadError(f"{message}. The answers received are saved; {_resume_hint()}")
        say(f"llm: {message}; finishing the {len(pending)} remaining request(s) on the local backend")
        self.server.stop()
        local = self.fallback()
        self.fell_back = {"to": getattr(local, "name", "local"), "reason": message, "requests": len(pending)}
        local.chat_many([requests[i] for i in pending], on_result=lambda j, r: deliver(pending[j], r))

    def _unavailable(self, exc: Exception, attempts: int) -> LLMUnavailableError:
        if self.server is None:
            return super()._unavailable(exc, attempts)
        # Never "start one with vllm serve": this server is the pipeline's own.
        return LLMUnavailableError(f"lost the managed vLLM server at {self.url} after {attempts} attempt(s): "
                                   f"{exc} (log {self.server.log_path})")

    def describe(self) -> dict[str, Any]:
        if self.server is not None:
            out = {**self.server.describe(), "max_concurrency": self.max_concurrency}
            if self.fell_back is not None:
                out["fallback"] = self.fell_back
            return out
        return {**super().describe(), "server_version": self._version()}

    def _version(self) -> str | None:
        root = self.url.rstrip("/").removesuffix("/v1")
        try:
            with urllib.request.urlopen(f"{root}/version", timeout=10) as r:
                return json.loads(r.read()).get("version")
        except (OSError, ValueError):
            return None


def _resume_hint() -> str:
    """The command that resumes: this one again (finished stages are cached, partial answers kept)."""
    if sys.argv and sys.argv[0].endswith("nectar"):
        return f"resume with `{shlex.join(['nectar', *sys.argv[1:]])}`"
    return "run the same command again to resume"
