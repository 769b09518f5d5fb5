"""Many documents behind one server, in-process on the real engine: two runs' modules over one tiny
base model — listed, batched together in the same decode steps, loaded lazily under an LRU byte
bound — and the metrics of what they served."""
from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from nectar.serving.loader import expand_run_dirs, open_served_run
from nectar.serving.app import create_app
from nectar.serving.engine import ModuleEngine
from nectar.serving.job import Job, SamplingParams
from nectar.serving.limits import ServeLimits
from nectar.serving.registry import open_registry
from nectar.serving.scheduler import Scheduler

Q = "Who planted the orchard?"


@pytest.fixture(scope="module")
def two(served_run, second_run):
    return open_registry([open_served_run(served_run), open_served_run(second_run)], None, 2_000_000_000)


def test_each_run_is_a_model_id_and_the_modules_load_on_first_use(two):
    a, b = two.names
    assert a.startswith("lighthouse-") and b.startswith("orchard-")  # <doc-id>/<run-id>
    assert two.documents[a].n_context != two.documents[b].n_context
    assert two.loaded == [] or set(two.loaded) <= {a, b}
    with TestClient(create_app(two, ServeLimits())) as c:
        cards = c.get("/v1/models").json()["data"]
        assert [m["id"] for m in cards] == [a, b] and {m["root"] for m in cards} == {"tiny:llama"}
        r = c.post("/v1/chat/completions", json={"model": b, "max_tokens": 4, "temperature": 0,
                                                 "messages": [{"role": "user", "content": Q}]})
        assert r.status_code == 200 and r.json()["model"] == b
        assert b in two.loaded
        missing = c.post("/v1/chat/completions", json={"model": "orchard", "messages": [{"role": "user", "content": Q}]})
        assert missing.status_code == 404
        assert f"this server serves {a!r}, {b!r}" in missing.json()["error"]["message"]


def test_rows_of_two_documents_decode_in_the_same_steps(two):
    """Four requests, two per document, start together: one engine run, a batch of four, and each
    row reads its own document's module (its provider and its n)."""
    base = two.base
    names = two.names

    async def main():
        loop = asyncio.get_running_loop()
        s = Scheduler(ModuleEngine(base), max_batch=8, max_queue=8, batch_wait_s=0)
        jobs = []
        for name in names + names:
            doc = two.documents[name]
            jobs.append(Job(doc.layout.prompt(Q).ids, SamplingParams(6, 0.0, 1.0, None), base.tokenizer, loop,
                            model=name, doc=two.provider(name), n=doc.n_context))
        for j in jobs:
            s.submit(j)
        s.start()
        for j in jobs:
            assert [e.kind async for e in j.events()][-1] == "done"
        s.close()
        return s, jobs

    s, jobs = asyncio.run(main())
    assert (s.stats.batches, s.stats.largest_batch) == (1, 4)
    assert all(j.completion_tokens > 0 for j in jobs)
    # the same question to the same document, greedy, in one batch: the same answer
    assert jobs[0].text == jobs[2].text and jobs[1].text == jobs[3].text


def test_modules_past_the_byte_bound_are_dropped_least_recently_used_first(served_run, second_run):
    runs = [open_served_run(served_run), open_served_run(second_run)]
    probe = open_registry(runs, None, 2_000_000_000)
    a, b = probe.names
    one = max(probe.provider(n).module.resident_bytes for n in probe.names)  # what a loaded module holds
    small = open_registry(runs, None, one)  # room for one module
    pa = small.provider(a)
    assert small.provider(a) is pa and small.loads == 1  # a hit, no reload
    small.provider(b)
    assert small.loaded == [b] and small.evictions == 1 and small.loaded_bytes <= one
    small.provider(a)
    assert small.loaded == [a] and small.loads == 3


def test_a_directory_of_runs_stands_for_the_trained_runs_under_it(served_run, tmp_path):
    runs_root = tmp_path / "none"
    runs_root.mkdir()
    with pytest.raises(FileNotFoundError, match="neither a run directory"):
        expand_run_dirs([str(runs_root)])
    parent = str(Path(served_run).parent)  # the folder holding the run (and its document file)
    assert expand_run_dirs([parent]) == [served_run.rstrip("/")]


def test_metrics_count_requests_tokens_and_latency_per_model(two):
    a, b = two.names
    with TestClient(create_app(two, ServeLimits(max_tokens=8))) as c:
        for name in (a, a, b):
            assert c.post("/v1/chat/completions", json={"model": name, "max_tokens": 5, "temperature": 0,
                                                        "messages": [{"role": "user", "content": Q}]}).status_code == 200
        assert c.post("/v1/chat/completions", json={"model": a, "max_tokens": 99,
                                                    "messages": [{"role": "user", "content": Q}]}).status_code == 400
        c.post("/v1/chat/completions", json={"model": "nope", "messages": [{"role": "user", "content": Q}]})
        r = c.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    m = _samples(r.text)
    assert m[f'nectar_requests_total{{model="{a}",status="200"}}'] == 2
    assert m[f'nectar_requests_total{{model="{b}",status="200"}}'] == 1
    assert m[f'nectar_requests_total{{model="{a}",status="400"}}'] == 1
    assert m['nectar_requests_total{model="unknown",status="404"}'] == 1
    gen = m[f'nectar_generation_tokens_total{{model="{a}"}}']
    assert 2 <= gen <= 10 and m[f'nectar_prompt_tokens_total{{model="{a}"}}'] > 0
    assert m[f'nectar_time_to_first_token_seconds_count{{model="{a}"}}'] == 2
    assert m[f'nectar_request_latency_seconds_count{{model="{b}"}}'] == 1
    assert m[f'nectar_queue_depth{{model="{a}"}}'] == 0 and m["nectar_batch_size"] == 0
    assert m[f'nectar_module_loaded{{model="{a}"}}'] == 1


def _samples(text: str) -> dict[str, float]:
    """Prometheus text format → {'name{labels}': value} (comments skipped)."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out
