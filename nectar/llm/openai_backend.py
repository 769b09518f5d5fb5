"""Chat backend for any OpenAI-compatible server (vLLM in production, ``transformers serve`` on CPU).

Requests run concurrently on one asyncio loop, at most ``max_concurrency`` in flight. Transient
failures (timeouts, connection errors, 408/409/429/5xx) are retried by the openai client itself:
exponential backoff with jitter (0.5 s doubling, at most 8 s), or the server's ``Retry-After`` /
``retry-after-ms`` on 429/503 (up to 120 s; a longer one is not waited for). ``retry_budget_s``
bounds one request's attempts and waits together. What still fails becomes a result with
``error`` set. A server that can't be reached at all (connection refused after retries), or that
rejects us outright (401/403/404: wrong key or model name), raises LLMUnavailableError naming the
URL — every other request would fail the same way.

When a request carries a JSON schema we ask for ``response_format: json_schema``. A server that
refuses the field (400/422) is asked again without it, once, and from then on for this backend;
a server that silently ignores it (``transformers serve``) is handled by tolerant parsing.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import os
from dataclasses import replace
from typing import Any, Coroutine, Sequence, TypeVar

import openai

from .parsing import find_json
from .types import ChatRequest, ChatResult, LLMUnavailableError, OnResult, Progress

T = TypeVar("T")
_RETRYABLE_STATUS = {408, 409, 429}  # and every 5xx: what the openai client retries


class OpenAIBackend:
    name = "openai"

    def __init__(self, base_url: str | None, model: str | None, api_key: str = "EMPTY",
                 max_concurrency: int = 8, max_retries: int = 3, timeout_s: float = 300.0,
                 retry_budget_s: float = 900.0):
        self.base_url = base_url
        self.model = model
        self.api_key = api_key
        self.max_concurrency = max(1, max_concurrency)
        self.max_retries = max(0, max_retries)
        self.timeout_s = timeout_s  # one attempt
        self.retry_budget_s = retry_budget_s  # one request: every attempt and every wait between them
        self.schema_supported = True  # flipped off when the server refuses response_format

    @property
    def url(self) -> str:
        return self.base_url or "https://api.openai.com/v1"

    def context_window(self) -> int | None:
        return None  # the server enforces its own limit and answers 400 per request

    def prompt_tokens(self, request: ChatRequest) -> int | None:
        return None

    def describe(self) -> dict[str, Any]:
        return {"backend": self.name, "url": self.url, "model": self.model, "max_concurrency": self.max_concurrency}

    def chat_many(self, requests: Sequence[ChatRequest], progress: Progress | None = None,
                  on_result: OnResult | None = None) -> list[ChatResult]:
        if not requests:
            return []
        return run_sync(self._run_all(list(requests), progress, on_result))

    # ----- async internals -----

    async def _run_all(self, requests: list[ChatRequest], progress: Progress | None,
                       on_result: OnResult | None) -> list[ChatResult]:
        client = openai.AsyncOpenAI(base_url=self.base_url, api_key=self.api_key, timeout=self.timeout_s,
                                    max_retries=self.max_retries)
        results: list[ChatResult | None] = [None] * len(requests)
        sem = asyncio.Semaphore(self.max_concurrency)
        done = 0

        async def one(i: int, model: str) -> None:
            nonlocal done
            async with sem:
                results[i] = await self._one(client, model, requests[i])
            done += 1
            if on_result is not None:
                on_result(i, results[i])
            if progress is not None:
                progress(done, len(requests))

        try:
            model = self.model or await self._served_model(client)
            async with asyncio.TaskGroup() as tg:  # the first LLMUnavailableError cancels the rest
                for i in range(len(requests)):
                    tg.create_task(one(i, model))
        except* LLMUnavailableError as group:
            raise group.exceptions[0] from None
        finally:
            await client.close()
        return results  # type: ignore[return-value]

    async def _served_model(self, client: openai.AsyncOpenAI) -> str:
        """No model configured: use the one the server serves (vLLM/transformers serve host one)."""
        try:
            models = await client.models.list()
        except openai.APIConnectionError as exc:
            raise self._unavailable(exc, 1) from None
        except openai.APIStatusError as exc:
            raise LLMUnavailableError(f"LLM server at {self.url} can't list its models ({exc.status_code}: "
                                      f"{_body(exc)}); set llm.model to the served model name") from None
        ids = [m.id for m in models.data]
        if not ids:
            raise LLMUnavailableError(f"LLM server at {self.url} serves no models; set llm.model")
        return ids[0]

    async def _one(self, client: openai.AsyncOpenAI, model: str, req: ChatRequest) -> ChatResult:
        kwargs = self._kwargs(model, req)
        try:
            async with asyncio.timeout(self.retry_budget_s):
                resp = await client.chat.completions.create(**kwargs)
            return _to_result(resp, req)
        except TimeoutError:  # the budget, not one attempt (that is APITimeoutError)
            last = f"gave up after {self.retry_budget_s:g}s of attempts and waits (llm.retry_budget_s)"
        except openai.APITimeoutError:
            last = f"timed out after {self.timeout_s:g}s ({self.max_retries + 1} attempt(s))"
        except openai.APIConnectionError as exc:
            raise self._unavailable(exc, self.max_retries + 1) from None
        except openai.APIStatusError as exc:
            status = exc.status_code
            if status in (401, 403, 404):
                raise LLMUnavailableError(
                    f"LLM server at {self.url} rejected the request with {status} ({_body(exc)}); "
                    f"check the API key (env var) and the model name {model!r}") from None
            if status in (400, 422) and "response_format" in kwargs:
                self.schema_supported = False  # ask again (not counted as a retry) without it
                return await self._one(client, model, req)
            last = f"{_attempts(exc)} attempt(s): server answered {status}: {_body(exc)}"
        except Exception as exc:  # garbled reply (not JSON, missing fields): recorded, not retried
            return ChatResult(text="", error=f"malformed response from {self.url}: {type(exc).__name__}: {exc}",
                              finish_reason="error")
        return ChatResult(text="", error=f"request failed after {last}", finish_reason="error")

    def _kwargs(self, model: str, req: ChatRequest) -> dict[str, Any]:
        kwargs: dict[str, Any] = dict(
            model=model, messages=list(req.messages), max_tokens=req.max_new_tokens,
            temperature=req.temperature, top_p=req.top_p, seed=req.seed,
        )
        if req.n > 1:
            kwargs["n"] = req.n
        extra = self._extra_body(req)
        if extra:
            kwargs["extra_body"] = extra
        if req.constrained and self.schema_supported:
            kwargs["response_format"] = {
                "type": "json_schema", "json_schema": {"name": "reply", "schema": req.json_schema, "strict": True},
            }
        return kwargs

    def _extra_body(self, req: ChatRequest) -> dict[str, Any]:
        """Fields outside the OpenAI API: none for a generic server (vLLM's backend adds its own)."""
        return {}

    def _unavailable(self, exc: Exception, attempts: int) -> LLMUnavailableError:
        return LLMUnavailableError(
            f"cannot reach the LLM server at {self.url} after {attempts} attempt(s): {exc}. Is it running? "
            "(start one with `vllm serve MODEL` or `transformers serve MODEL`, or fix llm.base_url)")


def _to_result(resp: Any, req: ChatRequest) -> ChatResult:
    if not getattr(resp, "choices", None):
        raise ValueError(f"reply has no choices: {str(resp)[:200]}")
    usage = getattr(resp, "usage", None)
    choices = []
    for choice in sorted(resp.choices, key=lambda c: c.index or 0):
        text = choice.message.content
        if not isinstance(text, str):
            raise ValueError(f"reply message has no text content: {str(choice)[:200]}")
        choices.append(ChatResult(
            text=text, parsed=find_json(text) if req.json_schema is not None else None,
            finish_reason=choice.finish_reason or "stop", prompt_tokens=getattr(usage, "prompt_tokens", None),
            meta={"seed": req.seed}))
    first = choices[0]
    # usage counts every choice's tokens together
    return replace(first, completion_tokens=getattr(usage, "completion_tokens", None),
                   choices=tuple(choices) if len(choices) > 1 else ())


def _attempts(exc: openai.APIStatusError) -> int:
    """How many attempts the client made (it numbers its retries in a request header)."""
    try:
        return int(exc.response.request.headers.get("x-stainless-retry-count", "0")) + 1
    except (AttributeError, ValueError, RuntimeError):
        return 1


def _body(exc: openai.APIStatusError) -> str:
    try:
        return exc.response.text[:300]
    except Exception:
        return str(exc)[:300]


def api_key_from_env(var: str) -> str:
    """vLLM and transformers serve accept any key; "EMPTY" is the convention when none is set."""
    return os.environ.get(var) or "EMPTY"


def run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine from sync code, also when this thread already runs a loop (Prefect, Jupyter)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="nectar-llm") as pool:
        return pool.submit(asyncio.run, coro).result()
