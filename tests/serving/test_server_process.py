"""``nectar serve`` as a real process on localhost, driven by the ``openai`` client."""
from __future__ import annotations

import asyncio
import signal
import threading
import time

import httpx
import openai
import pytest
from serve_procs import ServerProcess

pytestmark = pytest.mark.slow

ASK = [{"role": "user", "content": "Who bought the island?"}]


def client(server, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, **kw)


def test_eight_concurrent_requests_are_all_answered_and_batched(server):
    before = server.health()

    async def main():
        c = openai.AsyncOpenAI(base_url=server.url, api_key="unused", max_retries=0)
        questions = [f"Question {i}: who kept the ledger?" for i in range(8)]
        return await asyncio.gather(*(
            c.chat.completions.create(model=server.model, messages=[{"role": "user", "content": q}],
                                      max_tokens=48, temperature=0) for q in questions))

    replies = asyncio.run(main())
    assert len(replies) == 8
    for r in replies:
        assert r.choices[0].finish_reason in ("stop", "length")
        assert r.usage.completion_tokens > 0 and r.choices[0].message.content
        assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    after = server.health()
    assert after["rows"] - before["rows"] == 8
    # Requests that arrive while a batch runs share the next one: fewer batches than requests.
    assert after["batches"] - before["batches"] < 8 and after["largest_batch"] >= 2


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "top_p": 0.95, "seed": 11}],
                         ids=["greedy", "seeded"])
def test_streamed_answer_arrives_in_chunks_and_equals_the_plain_answer(server, sampling):
    c = client(server)
    plain = c.chat.completions.create(model=server.model, messages=ASK, max_tokens=24, **sampling)
    pieces, finish = [], None
    stream = c.chat.completions.create(model=server.model, messages=ASK, max_tokens=24, stream=True,
                                       stream_options={"include_usage": True}, **sampling)
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                pieces.append(choice.delta.content)
            finish = choice.finish_reason or finish
    assert len(pieces) > 1
    assert "".join(pieces) == plain.choices[0].message.content
    assert finish == plain.choices[0].finish_reason
    assert usage is not None and usage.completion_tokens == plain.usage.completion_tokens


def test_oversized_requests_are_refused_naming_the_limit_and_the_server_keeps_serving(server):
    c = client(server)
    with pytest.raises(openai.BadRequestError, match=r"max_tokens: 100000 is over this server's limit of 256 "
                                                     r"\(nectar serve --max-tokens\)"):
        c.chat.completions.create(model=server.model, messages=ASK, max_tokens=100_000)
    with pytest.raises(openai.BadRequestError, match=r"over this server's limit of 200 .*--max-prompt-tokens"):
        c.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "island " * 400}],
                                  max_tokens=4)
    with pytest.raises(openai.APIStatusError, match=r"limit of 20000 bytes \(nectar serve --max-body-bytes\)") as big:
        c.chat.completions.create(model=server.model, messages=[{"role": "user", "content": "x" * 50_000}])
    assert big.value.status_code == 413
    with pytest.raises(openai.NotFoundError, match="is not served here"):
        c.chat.completions.create(model="gpt-4o", messages=ASK, max_tokens=4)
    ok = c.chat.completions.create(model=server.model, messages=ASK, max_tokens=4, temperature=0)
    assert ok.choices[0].finish_reason in ("stop", "length") and ok.usage.completion_tokens > 0
    assert server.health()["status"] == "ok"


def test_sigterm_finishes_in_flight_requests_then_exits_0(served_run, tmp_path):
    srv = ServerProcess(served_run, tmp_path)
    try:
        c = client(srv)
        stream = c.chat.completions.create(model=srv.model, messages=ASK, max_tokens=200, temperature=1.0,
                                           stream=True, stream_options={"include_usage": True})
        chunks = iter(stream)
        next(chunks)  # the stream is open and decoding
        plain: dict = {}
        waiter = threading.Thread(target=lambda: plain.update(reply=client(srv).chat.completions.create(
            model=srv.model, messages=ASK, max_tokens=100, temperature=0)))
        waiter.start()
        deadline = time.monotonic() + 30
        while sum(srv.health()[k] for k in ("waiting", "running")) < 2:  # both admitted, neither done
            assert time.monotonic() < deadline, "the stream ended before the second request was admitted"
            time.sleep(0.02)
        srv.proc.send_signal(signal.SIGTERM)
        rest = list(chunks)
        waiter.join(120)
        assert srv.proc.wait(120) == 0
    finally:
        srv.terminate()
    finish = [ch.choices[0].finish_reason for ch in rest if ch.choices and ch.choices[0].finish_reason]
    assert finish == ["length"] and rest[-1].usage.completion_tokens == 200
    reply = plain["reply"]
    assert reply.choices[0].finish_reason in ("stop", "length") and reply.usage.completion_tokens > 0
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{srv.root}/health")
