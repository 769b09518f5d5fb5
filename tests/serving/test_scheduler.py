"""Continuous batching on the real engine and the tiny run's module: who shares the running batch,
requests joining it mid-decode, the queue limit, per-row max_tokens, cancelled requests."""
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


def test_requests_run_oldest_first_at_most_max_batch_at_once_and_the_queue_is_bounded(served):
    async def main():
        loop = asyncio.get_running_loop()
        s = Scheduler(engine(served), max_batch=2, max_queue=4, batch_wait_s=0)
        jobs = [make_job(served, loop), make_job(served, loop),
                make_job(served, loop, temperature=0.8, top_p=0.9),  # sampled rows share the batch too
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
    # two rows at a time; the last two join the running batch as the first two leave it (one engine run)
    assert (s.stats.batches, s.stats.rows, s.stats.largest_batch) == (1, 4, 2)
    assert jobs[0].started_at == jobs[1].started_at < jobs[2].started_at <= jobs[3].started_at
    assert jobs[2].started_at >= max(jobs[0].finished_at, jobs[1].finished_at) - 1e-3


def test_a_short_request_arriving_mid_decode_joins_and_finishes_first(served):
    """Continuous batching: two long answers decode; a short request submitted meanwhile joins the
    running batch at the next step and is answered while the long ones are still decoding."""
    async def main():
        loop = asyncio.get_running_loop()
        s = Scheduler(engine(served), max_batch=4, max_queue=8, batch_wait_s=0)
        longs = [make_job(served, loop, max_tokens=60), make_job(served, loop, max_tokens=60)]
        s.start()
        for j in longs:
            s.submit(j)
        while not any(j.completion_tokens >= 3 for j in longs):  # the long ones are decoding
            await asyncio.sleep(0.005)
        short = make_job(served, loop, max_tokens=3)
        s.submit(short)
        assert [e.kind async for e in short.events()][-1] == "done"
        still_running = [j.finish_reason is None for j in longs]
        for j in longs:
            assert [e.kind async for e in j.events()][-1] == "done"
        s.close()
        return s, longs, short, still_running

    s, longs, short, still_running = asyncio.run(main())
    assert all(still_running) and short.completion_tokens == 3
    assert short.finished_at < min(j.finished_at for j in longs)
    assert s.stats.batches == 1 and s.stats.largest_batch == 3  # it joined the running batch


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
