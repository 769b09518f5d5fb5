"""Reliability of a real ``nectar serve`` process on 127.0.0.1 serving two documents with an API key,
driven by real HTTP clients (httpx, the ``openai`` client): keys, load, disconnects, unknown models,
SIGTERM under load. Every server is stopped by its PID in teardown."""
from __future__ import annotations

import asyncio
import signal
import time

import httpx
import openai
import pytest
from serve_procs import ServerProcess

pytestmark = pytest.mark.slow

KEY = "sk-test-0123456789abcdef"
ASK = [{"role": "user", "content": "Who bought the island?"}]


@pytest.fixture(scope="module")
def two_docs(served_run, second_run, tmp_path_factory):
    srv = ServerProcess([served_run, second_run], tmp_path_factory.mktemp("two"), "--max-batch", "8",
                        "--max-queue", "24", "--max-tokens", "256", api_key=KEY)
    yield srv
    srv.terminate()


def test_a_missing_or_wrong_key_gets_401_and_the_server_keeps_serving(two_docs):
    srv = two_docs
    body = {"model": srv.model, "messages": ASK, "max_tokens": 3}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {KEY}"},
                    {"Authorization": f"Bearer {KEY}x"}):
        r = httpx.post(f"{srv.url}/chat/completions", json=body, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert r.headers["www-authenticate"] == "Bearer" and KEY not in r.text
    assert httpx.get(f"{srv.url}/models").status_code == 401
    assert httpx.get(f"{srv.root}/metrics").status_code == 401
    assert httpx.get(f"{srv.root}/health").status_code == 200  # probes carry no key
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=srv.url, api_key="wrong", max_retries=0).chat.completions.create(
            model=srv.model, messages=ASK, max_tokens=3)
    ok = openai.OpenAI(base_url=srv.url, api_key=KEY, max_retries=0).chat.completions.create(
        model=srv.model, messages=ASK, max_tokens=3, temperature=0)
    assert ok.usage.completion_tokens > 0
    assert KEY not in srv.out.read_text() + srv.err.read_text()  # never logged


def test_an_unknown_model_gets_404_naming_the_models_served(two_docs):
    srv = two_docs
    c = openai.OpenAI(base_url=srv.url, api_key=KEY, max_retries=0)
    assert len(srv.models) == 2 and [m.id for m in c.models.list().data] == srv.models
    with pytest.raises(openai.NotFoundError) as nf:
        c.chat.completions.create(model="gpt-4o", messages=ASK, max_tokens=3)
    assert all(repr(m) in str(nf.value) for m in srv.models)


def test_64_concurrent_requests_over_two_documents_are_all_answered_or_refused_by_a_named_limit(two_docs):
    srv = two_docs

    async def one(c: httpx.AsyncClient, i: int):
        body = {"model": srv.models[i % 2], "messages": [{"role": "user", "content": f"Question {i}: who?"}],
                "max_tokens": 8, "temperature": 0.7, "seed": i}
        return await c.post(f"{srv.url}/chat/completions", json=body, headers=srv.headers)

    async def main():
        async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=64)) as c:
            return await asyncio.gather(*(one(c, i) for i in range(64)))

    replies = asyncio.run(main())
    assert len(replies) == 64
    answered = [r for r in replies if r.status_code == 200]
    refused = [r for r in replies if r.status_code != 200]
    assert all(r.status_code == 503 and r.json()["error"]["code"] == "queue_full"
               and "nectar serve --max-queue" in r.json()["error"]["message"] and int(r.headers["retry-after"]) >= 1
               for r in refused), {r.status_code: r.text for r in refused}
    assert {r.json()["model"] for r in answered} == set(srv.models)  # both documents answered
    assert all(r.json()["usage"]["completion_tokens"] > 0 for r in answered)
    health = srv.health()
    assert health["largest_batch"] == 8 and health["waiting"] == 0 and health["running"] == 0


def test_a_client_that_disconnects_mid_stream_frees_its_batch_row(two_docs):
    srv = two_docs
    body = {"model": srv.models[1], "messages": ASK, "max_tokens": 250, "temperature": 1.0, "stream": True}
    with httpx.Client(timeout=60) as c:
        with c.stream("POST", f"{srv.url}/chat/completions", json=body, headers=srv.headers) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            next(lines)
            assert srv.health()["running"] == 1
        # the connection is closed here, long before 250 tokens
    deadline = time.monotonic() + 20
    while srv.health()["running"]:
        assert time.monotonic() < deadline, "the abandoned stream kept its row"
        time.sleep(0.05)
    metrics = httpx.get(f"{srv.root}/metrics", headers=srv.headers).text
    assert f'nectar_requests_total{{model="{srv.models[1]}",status="499"}} 1.0' in metrics
    assert srv.health()["completion_tokens"] < 250 * 64  # it did not decode to its budget


def test_sigterm_under_load_answers_every_admitted_request_then_exits_0(served_run, second_run, tmp_path):
    srv = ServerProcess([served_run, second_run], tmp_path, api_key=KEY)
    try:
        async def main():
            c = openai.AsyncOpenAI(base_url=srv.url, api_key=KEY, max_retries=0)
            tasks = [asyncio.create_task(c.chat.completions.create(
                model=srv.models[i % 2], messages=ASK, max_tokens=40 + 10 * i, temperature=0)) for i in range(6)]
            deadline = time.monotonic() + 60
            while await asyncio.to_thread(lambda: srv.health()["running"]) < 6:
                assert time.monotonic() < deadline, "the requests were not all admitted"
                await asyncio.sleep(0.02)
            srv.proc.send_signal(signal.SIGTERM)
            return await asyncio.gather(*tasks)

        replies = asyncio.run(main())
        assert srv.proc.wait(120) == 0
    finally:
        srv.terminate()
    assert len(replies) == 6 and all(r.choices[0].finish_reason in ("stop", "length") for r in replies)
