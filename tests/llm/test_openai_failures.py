"""OpenAI backend failure handling, with FAKE servers for failure injection (names say so), and a
real unreachable port. The happy path runs against a real transformers serve (slow tests)."""
from __future__ import annotations

import asyncio
import socket

import pytest

from nectar.llm import ChatRequest, LLMUnavailableError, make_backend
from nectar.llm.openai_backend import OpenAIBackend
from nectar.prompts import CONSISTENCY_SCHEMA
from nectar.schemas.config import LLMConfig, ModelConfig

from fake_openai import completion, fake_server

VERDICT = '{"is_consistent": true, "confidence": 0.9, "reasoning": "same"}'


def req(i: int = 0, schema: dict | None = None) -> ChatRequest:
    return ChatRequest(messages=({"role": "user", "content": f"q{i}"},), json_schema=schema, max_new_tokens=16,
                       temperature=0.5, top_p=0.9, seed=i)


def backend(url: str, **kw) -> OpenAIBackend:
    kw = {"max_retries": 2, "timeout_s": 5.0, **kw}
    return OpenAIBackend(url, "fake-model", **kw)


def test_request_payload_with_fake_recording_server():
    with fake_server(lambda body, n: (200, completion(VERDICT))) as srv:
        out = backend(srv.url).chat_many([req(3, CONSISTENCY_SCHEMA)])
    body = srv.bodies[0]
    assert body["model"] == "fake-model" and body["seed"] == 3 and body["max_tokens"] == 16
    assert body["temperature"] == 0.5 and body["top_p"] == 0.9
    assert body["response_format"]["type"] == "json_schema"
    assert body["response_format"]["json_schema"]["schema"] == CONSISTENCY_SCHEMA
    assert out[0].parsed == {"is_consistent": True, "confidence": 0.9, "reasoning": "same"}
    assert (out[0].prompt_tokens, out[0].completion_tokens) == (3, 5)


def test_server_ignoring_schema_is_parsed_tolerantly_with_fake_chatty_server():
    chatty = f"Sure! Here is my evaluation:\n```json\n{VERDICT}\n```\nLet me know if you need more."
    with fake_server(lambda body, n: (200, completion(chatty))) as srv:
        out = backend(srv.url).chat_many([req(0, CONSISTENCY_SCHEMA)])
    assert out[0].ok and out[0].parsed["confidence"] == 0.9


def test_garbage_replies_become_error_results_with_fake_garbage_server():
    replies = ["<html>502 bad gateway</html>", {"unexpected": "shape"}, {"choices": []}]
    with fake_server(lambda body, n: (200, replies[(n - 1) % 3])) as srv:
        out = backend(srv.url, max_concurrency=1).chat_many([req(i) for i in range(3)])
    assert all(r.error and "malformed response" in r.error for r in out), out
    assert len(srv.bodies) == 3  # garbage isn't retried


def test_5xx_is_retried_then_succeeds_with_fake_flaky_server():
    with fake_server(lambda body, n: (503, {"error": "busy"}) if n < 3 else (200, completion("ok"))) as srv:
        out = backend(srv.url).chat_many([req()])
    assert out[0].ok and out[0].text == "ok" and len(srv.bodies) == 3


def test_persistent_500_is_an_error_result_with_fake_failing_server():
    with fake_server(lambda body, n: (500, {"error": "boom"})) as srv:
        out = backend(srv.url, max_retries=2).chat_many([req(0), req(1)])
    assert all(not r.ok and "after 3 attempt(s): server answered 500" in r.error and "boom" in r.error for r in out)
    assert len(srv.bodies) == 6


def test_400_for_a_bad_request_is_not_retried_with_fake_server():
    with fake_server(lambda body, n: (400, {"error": "prompt too long: 9000 > 8192"})) as srv:
        out = backend(srv.url).chat_many([req()])
    assert "400" in out[0].error and "prompt too long" in out[0].error and len(srv.bodies) == 1


def test_schema_refused_falls_back_to_plain_with_fake_strict_server():
    def reply(body, n):
        if "response_format" in body:
            return 400, {"error": "response_format is not supported"}
        return 200, completion("Answer: " + VERDICT)

    with fake_server(reply) as srv:
        be = backend(srv.url, max_concurrency=1)
        out = be.chat_many([req(0, CONSISTENCY_SCHEMA), req(1, CONSISTENCY_SCHEMA)])
    assert all(r.ok and r.parsed["is_consistent"] is True for r in out)
    assert be.schema_supported is False
    assert ["response_format" in b for b in srv.bodies] == [True, False, False]  # refused once, then not asked


def test_401_raises_unavailable_with_fake_auth_server():
    with fake_server(lambda body, n: (401, {"error": "invalid api key"})) as srv:
        with pytest.raises(LLMUnavailableError, match=r"rejected the request with 401.*API key"):
            backend(srv.url).chat_many([req(i) for i in range(4)])


def test_timeout_is_an_error_result_with_fake_slow_server():
    with fake_server(lambda body, n: (200, completion("late")), delay_s=1.0) as srv:
        out = backend(srv.url, timeout_s=0.2, max_retries=1).chat_many([req()])
    assert "timed out after 0.2s (2 attempt(s))" in out[0].error


@pytest.mark.parametrize("status,header,value,wait_s", [(429, "Retry-After", "1", 1.0),
                                                        (503, "retry-after-ms", "700", 0.7)])
def test_retry_after_is_honoured_with_fake_rate_limiting_server(status, header, value, wait_s):
    def reply(body, n):
        return (status, {"error": "slow down"}, {header: value}) if n == 1 else (200, completion("ok"))

    with fake_server(reply) as srv:
        out = backend(srv.url).chat_many([req()])
    assert out[0].ok and out[0].text == "ok" and len(srv.bodies) == 2
    gap = srv.times[1] - srv.times[0]
    assert wait_s - 0.05 <= gap < wait_s + 1.0, gap  # the server's delay, not the client's own 0.5 s backoff


def test_retry_budget_bounds_one_request_with_fake_rate_limiting_server():
    """A server that keeps asking for 100 s is not waited on past the budget."""
    import time

    with fake_server(lambda body, n: (429, {"error": "busy"}, {"Retry-After": "100"})) as srv:
        t0 = time.monotonic()
        out = backend(srv.url, retry_budget_s=1.5, max_retries=5).chat_many([req()])
        took = time.monotonic() - t0
    assert "gave up after 1.5s of attempts and waits (llm.retry_budget_s)" in out[0].error
    assert took < 5 and len(srv.bodies) == 1


def test_concurrency_is_bounded_with_fake_slow_server():
    with fake_server(lambda body, n: (200, completion(body["messages"][0]["content"])), delay_s=0.1) as srv:
        seen = []
        out = backend(srv.url, max_concurrency=3).chat_many([req(i) for i in range(10)],
                                                            on_result=lambda i, r: seen.append(i))
    assert [r.text for r in out] == [f"q{i}" for i in range(10)]  # results in request order
    assert srv.max_in_flight == 3 and sorted(seen) == list(range(10))


def test_unreachable_port_raises_naming_the_url():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once the socket closes
    url = f"http://127.0.0.1:{port}/v1"
    with pytest.raises(LLMUnavailableError, match=rf"cannot reach the LLM server at {url} after 3 attempt"):
        backend(url).chat_many([req(0), req(1)])


def test_chat_many_works_inside_a_running_event_loop_with_fake_server():
    """Prefect tasks may call stages from inside a loop: the backend must not try asyncio.run there."""
    with fake_server(lambda body, n: (200, completion("fine"))) as srv:
        async def inside_loop():
            return backend(srv.url).chat_many([req()])

        out = asyncio.run(inside_loop())
    assert out[0].text == "fine"


def test_make_backend_openai_reads_key_from_env(monkeypatch):
    monkeypatch.setenv("MY_KEY", "sk-test")
    be = make_backend(LLMConfig(backend="openai", base_url="http://h:1/v1", model="m", api_key_env="MY_KEY",
                                max_concurrency=5), ModelConfig(name="tiny:llama"))
    assert isinstance(be, OpenAIBackend) and be.api_key == "sk-test" and be.max_concurrency == 5
    monkeypatch.delenv("MY_KEY")
    assert make_backend(LLMConfig(backend="openai", model="m", api_key_env="MY_KEY"), ModelConfig()).api_key == "EMPTY"
