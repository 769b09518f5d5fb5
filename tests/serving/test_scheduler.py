"""Dynamic batching on the real engine and the tiny run's module: who shares a batch, the queue
limit, per-row max_tokens inside one batch, cancelled requests."""
import asyncio

import pytest

from nectar.modules.provider import ModuleDocState
from nectar.serving.engine import ModuleEngine
from nectar.serving.job import Job, SamplingParams
from nectar.serving.scheduler import QueueFull, Scheduler

GREEDY = {"temperature": 0.0, "top_p": 1.0, "seed": None}


def make_job(served, loop, max_tokens=4, **sampling):
    params = SamplingParams(max_tokens=max_tokens, **{**GREEDY, **sampling})
    return Job(served.layout.prompt("Who bought the island?").ids, params, served.base.tokenizer, loop)


def engine(served):
    return ModuleEngine(served.base, ModuleDocState(served.module), served.n_context)


def test_batches_group_compatible_requests_oldest_first_and_the_queue_is_bounded(served):
    async def main():
        loop = asyncio.get_running_loop()
        s = Scheduler(engine(served), max_batch=2, max_queue=4, batch_wait_s=0)
        jobs = [make_job(served, loop), make_job(served, loop),
                make_job(served, loop, temperature=0.8, top_p=0.9),  # sampled: its own batch key
                make_job(served, loop)]
        for j in jobs:
            s.submit(j)
        with pytest.raises(QueueFull) as full:
            s.submit(make_job(served, loop))
        assert full.value.limit == 4 and full.value.retry_after_s >= 1
        s.start()
        for j in jobs:
            assert [e.kind for e in [e async for e in j.events()]][-1] == "done"
        s.close()
        return s, jobs

    s, jobs = asyncio.run(main())
    # [greedy, greedy], then the sampled one (oldest waiting), then the last greedy one
    assert (s.stats.batches, s.stats.rows, s.stats.largest_batch) == (3, 4, 2)
    assert jobs[0].started_at == jobs[1].started_at < jobs[2].started_at < jobs[3].started_at


def test_rows_of_one_batch_end_at_their_own_max_tokens(served):
    async def main():
        loop = asyncio.get_running_loop()
        short, long = make_job(served, loop, max_tokens=2), make_job(served, loop, max_tokens=9)
        engine(served).run([short, long])
        return short, long

    short, long = asyncio.run(main())
    assert (short.completion_tokens, short.finish_reason) == (2, "length")
    assert (long.completion_tokens, long.finish_reason) == (9, "length")


def test_a_cancelled_waiting_request_is_dropped_and_frees_its_place(served):
    async def main():
        loop = asyncio.get_running_loop()
        s = Scheduler(engine(served), max_batch=4, max_queue=1, batch_wait_s=0)
        gone, kept = make_job(served, loop), make_job(served, loop)
        s.submit(gone)
        gone.cancel()
        s.submit(kept)  # the cancelled one no longer counts against the queue
        s.start()
        events = [e.kind async for e in kept.events()]
        s.close()
        return s, gone, events

    s, gone, events = asyncio.run(main())
    assert events[-1] == "done" and gone.completion_tokens == 0 and s.stats.rows == 1


def test_seeded_sampled_requests_run_alone(served):
    e = engine(served)
    seeded = SamplingParams(max_tokens=4, temperature=0.7, top_p=0.9, seed=1)
    assert e.batch_key(seeded) != e.batch_key(seeded)
    assert e.batch_key(SamplingParams(4, 0.0, 0.5, 3)) == e.batch_key(SamplingParams(9, 0.0, 1.0, None))
    assert e.batch_key(SamplingParams(4, 0.7, 0.9, None)) == e.batch_key(SamplingParams(8, 0.7, 0.9, None))
