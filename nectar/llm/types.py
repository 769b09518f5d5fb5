"""The one chat interface every stage talks to (docs/design.md §7).

A ChatRequest says what to ask and how to sample; a ChatResult is what came back. Backends take a
list of requests and return one result per request, in order, and never raise for one bad
request: a failed or garbled request is a result with ``error`` set. Only a server that can't be
reached at all raises (LLMUnavailableError), because then every later request would fail too.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

from ..schemas.config import LLMConfig

Message = dict[str, str]  # {"role": "system" | "user" | "assistant", "content": "..."}
# progress(done, total): called as requests complete.
Progress = Callable[[int, int], None]
# on_result(index, result): called once per request as soon as its result exists (for resume files).
OnResult = Callable[[int, "ChatResult"], None]


class LLMError(RuntimeError):
    pass


class LLMUnavailableError(LLMError):
    """The endpoint can't be reached at all (after retries)."""


@dataclass(frozen=True)
class ChatRequest:
    messages: tuple[Message, ...]
    # A JSON schema: the reply is parsed as JSON (tolerantly) and, when enforce_schema is true,
    # decoding is constrained to it (xgrammar in-process, response_format on a server).
    json_schema: dict[str, Any] | None = None
    enforce_schema: bool = True
    max_new_tokens: int = 256
    temperature: float = 0.0  # 0 → greedy
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.messages:
            raise ValueError("a chat request needs at least one message")
        if self.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be positive, got {self.max_new_tokens}")
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ValueError(f"need temperature >= 0 and 0 < top_p <= 1, got {self.temperature}, {self.top_p}")

    @property
    def constrained(self) -> bool:
        return self.json_schema is not None and self.enforce_schema


def make_request(cfg: LLMConfig, messages: Sequence[Message] | str, json_schema: dict[str, Any] | None = None,
                 seed: int | None = None, max_new_tokens: int | None = None) -> ChatRequest:
    """A request with the sampling settings of ``cfg``; a plain string is one user message."""
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    return ChatRequest(
        messages=tuple(dict(m) for m in messages), json_schema=json_schema,
        enforce_schema=cfg.structured_output, max_new_tokens=max_new_tokens or cfg.max_new_tokens,
        temperature=cfg.temperature, top_p=cfg.top_p, seed=cfg.seed if seed is None else seed,
    )


@dataclass(frozen=True)
class ChatResult:
    text: str
    parsed: Any = None  # the JSON value found in text when the request had a schema, else None
    error: str | None = None  # set when the request itself failed (transport, server, prompt too long)
    finish_reason: str = "stop"  # "stop" | "length" | "error"
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.error is None


class ChatBackend(Protocol):
    name: str

    def chat_many(self, requests: Sequence[ChatRequest], progress: Progress | None = None,
                  on_result: OnResult | None = None) -> list[ChatResult]: ...

    def context_window(self) -> int | None:
        """Max prompt + completion tokens, when the backend knows it (local); None otherwise."""
        ...

    def prompt_tokens(self, request: ChatRequest) -> int | None:
        """Tokens the request's prompt takes after the chat template, when knowable (local)."""
        ...
