"""The HTTP API in-process (FastAPI's TestClient / httpx over ASGI) on the real engine and the tiny
run's trained module: answers equal ``nectar ask``'s, the SSE format, stop strings, every limit."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from fastapi.testclient import TestClient

from nectar.serving.ask import ask
from nectar.serving.app import create_app
from nectar.serving.limits import ServeLimits

Q = "Who bought the island?"


@pytest.fixture(scope="module")
def api(served):
    limits = ServeLimits(max_tokens=64, max_prompt_tokens=300, max_body_bytes=20_000, max_stop=2)
    with TestClient(create_app(served, limits)) as c:
        yield c


def chat(api, served, **kw):
    body = {"model": served.name, "messages": [{"role": "user", "content": Q}], **kw}
    return api.post("/v1/chat/completions", json=body)


def stream_events(api, served, **kw) -> list:
    with api.stream("POST", "/v1/chat/completions",
                    json={"model": served.name, "messages": [{"role": "user", "content": Q}], "stream": True, **kw}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[6:]) for line in lines[:-1]]


def test_models_and_health(api, served):
    card = api.get("/v1/models").json()["data"][0]
    assert card["id"] == served.name and card["root"] == "tiny:llama"
    assert card["nectar"]["n_context"] == served.layout.n and card["nectar"]["module_bytes"] > 0
    assert api.get(f"/v1/models/{served.name}").json()["id"] == served.name
    health = api.get("/health").json()
    assert health["status"] == "ok" and health["max_batch"] == 8


def test_greedy_answer_is_the_nectar_ask_answer(api, served, served_run):
    r = chat(api, served, max_tokens=16, temperature=0).json()
    want = ask(served_run, Q, max_new_tokens=16, temperature=0.0)  # batch of one: the same computation
    assert r["choices"][0]["message"]["content"] == want.text
    assert r["usage"] == {"prompt_tokens": len(served.layout.prompt(Q).ids),
                          "completion_tokens": len(want.token_ids),
                          "total_tokens": len(served.layout.prompt(Q).ids) + len(want.token_ids)}
    assert r["choices"][0]["finish_reason"] == ("length" if len(want.token_ids) == 16 else "stop")


def test_seeded_sampling_repeats_and_is_the_nectar_ask_answer(api, served, served_run):
    a = chat(api, served, max_tokens=12, temperature=1.0, top_p=0.9, seed=5).json()
    b = chat(api, served, max_tokens=12, temperature=1.0, top_p=0.9, seed=5).json()
    want = ask(served_run, Q, max_new_tokens=12, temperature=1.0, top_p=0.9, seed=5)
    assert a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"] == want.text


def test_stream_follows_the_openai_event_format(api, served):
    plain = chat(api, served, max_tokens=12, temperature=1.0, seed=3).json()
    events = stream_events(api, served, max_tokens=12, temperature=1.0, seed=3, stream_options={"include_usage": True})
    assert {e["id"] for e in events} == {events[0]["id"]} and events[0]["object"] == "chat.completion.chunk"
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    body = events[1:-2]
    assert body and all(e["choices"][0]["finish_reason"] is None for e in body)
    assert "".join(e["choices"][0]["delta"]["content"] for e in body) == plain["choices"][0]["message"]["content"]
    assert events[-2]["choices"][0] == {"index": 0, "delta": {}, "finish_reason": "length"}
    assert events[-1]["choices"] == [] and events[-1]["usage"] == plain["usage"]


def test_stop_string_ends_the_answer_before_it(api, served):
    full = chat(api, served, max_tokens=24, temperature=1.0, seed=9).json()["choices"][0]["message"]["content"]
    stop = full[len(full) // 2:len(full) // 2 + 3]
    assert len(stop) == 3
    want = full[:full.index(stop)]
    r = chat(api, served, max_tokens=24, temperature=1.0, seed=9, stop=[stop, "\u2603never"]).json()
    assert r["choices"][0]["message"]["content"] == want and r["choices"][0]["finish_reason"] == "stop"
    events = stream_events(api, served, max_tokens=24, temperature=1.0, seed=9, stop=stop)
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events) == want
    assert events[-1]["choices"][0]["finish_reason"] == "stop"


def test_each_limit_is_named_and_the_server_keeps_serving(api, served):
    def refused(status, code, pattern, **kw):
        r = chat(api, served, **kw)
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert err["code"] == code and pattern in err["message"], err
        return r

    refused(400, "max_tokens_exceeded", "over this server's limit of 64 (nectar serve --max-tokens)", max_tokens=65)
    refused(400, "too_many_stop_strings", "limit of 2 (nectar serve --max-stop)", stop=["a", "b", "c"])
    refused(400, "invalid_value", "temperature", temperature=3)
    refused(400, "unsupported_parameter", "n=2", n=2)
    refused(404, "model_not_found", "is not served here", model="gpt-4o")
    r = api.post("/v1/chat/completions", json={"model": served.name, "max_tokens": 4,
                                               "messages": [{"role": "user", "content": "island " * 400}]})
    assert r.status_code == 400 and "limit of 300 (nectar serve --max-prompt-tokens)" in r.json()["error"]["message"]
    r = api.post("/v1/chat/completions", json={"model": served.name,
                                               "messages": [{"role": "user", "content": "x" * 30_000}]})
    assert r.status_code == 413
    assert "limit of 20000 bytes (nectar serve --max-body-bytes)" in r.json()["error"]["message"]
    r = api.post("/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert chat(api, served, max_tokens=3, temperature=0).status_code == 200


def test_the_model_window_bounds_prompt_plus_answer(served):
    window = served.base.max_context_tokens
    room = window - served.layout.n
    limits = ServeLimits(max_tokens=room, max_prompt_tokens=room)
    with TestClient(create_app(served, limits)) as c:
        r = c.post("/v1/chat/completions", json={"model": served.name, "max_tokens": room - 5,
                                                 "messages": [{"role": "user", "content": Q}]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert f"the model's window of {window} tokens" in r.json()["error"]["message"]


def test_multi_turn_conversation_is_answered_and_a_system_prompt_refused(api, served):
    turns = [{"role": "user", "content": Q}, {"role": "assistant", "content": "Ilse Brandt."},
             {"role": "user", "content": "When?"}]
    r = api.post("/v1/chat/completions", json={"model": served.name, "messages": turns, "max_tokens": 4})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] > len(served.layout.prompt(Q).ids)
    r = api.post("/v1/chat/completions", json={"model": served.name, "max_tokens": 4,
                                               "messages": [{"role": "system", "content": "Be brief."}] + turns})
    assert r.status_code == 400 and "system prompt sits before the document" in r.json()["error"]["message"]


def test_full_queue_gives_503_with_retry_after_then_the_waiting_requests_are_answered(served):
    """Without the ASGI lifespan the scheduler is not started, so admitted requests wait in its queue."""
    app = create_app(served, ServeLimits(max_queue=2))
    scheduler = app.state.nectar.scheduler
    body = {"model": served.name, "messages": [{"role": "user", "content": Q}], "max_tokens": 3, "temperature": 0}

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            waiting = [asyncio.create_task(c.post("/v1/chat/completions", json=body)) for _ in range(2)]
            while scheduler.waiting < 2:
                await asyncio.sleep(0.01)
            refused = await c.post("/v1/chat/completions", json=body)
            scheduler.start()
            answered = await asyncio.gather(*waiting)
            scheduler.close()
            return refused, answered

    refused, answered = asyncio.run(main())
    assert refused.status_code == 503 and int(refused.headers["retry-after"]) >= 1
    err = refused.json()["error"]
    assert err["code"] == "queue_full" and "queue limit is 2 (nectar serve --max-queue)" in err["message"]
    assert [r.status_code for r in answered] == [200, 200]
    assert scheduler.stats.batches == 1 and scheduler.stats.largest_batch == 2


def test_a_failing_batch_answers_500_and_the_server_keeps_serving_with_fake_failing_provider(served):
    """Failure injection: the document-state provider raises inside the engine for some requests."""
    app = create_app(served, ServeLimits())
    engine = app.state.nectar.scheduler.engine
    real = engine.provider

    def failing(layer, q, scaling):
        raise RuntimeError("injected failure")

    with TestClient(app) as c:
        engine.provider = failing
        r = chat(c, served, max_tokens=3, temperature=0)
        assert r.status_code == 500 and r.json()["error"]["code"] == "engine_error"
        assert "injected failure" in r.json()["error"]["message"]
        with c.stream("POST", "/v1/chat/completions", json={"model": served.name, "stream": True, "max_tokens": 3,
                                                            "messages": [{"role": "user", "content": Q}]}) as s:
            lines = [line for line in s.iter_lines() if line]
        assert "injected failure" in lines[-2] and lines[-1] == "data: [DONE]"
        engine.provider = real
        assert chat(c, served, max_tokens=3, temperature=0).status_code == 200
        assert c.get("/health").json()["failed_batches"] == 2
