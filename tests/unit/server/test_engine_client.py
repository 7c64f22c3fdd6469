"""The in-process engine client without HTTP: its request streams carry the engine's own DELTA reports, which
add up to what ``LLM.generate`` returns, and its thread wakes the event loop once per step for all of them
(counted, not timed: ``scripts/bench_client_reports.py`` times it)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from hydragen import LLM, SamplingParams
from hydragen.server.errors import APIError
from hydragen.server.in_process_client import InProcessClient

PROMPTS = [[1 + (5 * i + j) % 200 for j in range(8 + i)] for i in range(8)]


@pytest.fixture(scope="module")
def llm(tiny_models):
    llm = LLM(tiny_models["llama"], kv_cache_tokens=4096)
    yield llm
    llm.close()


def test_streams_add_up_to_generate(llm):
    params = SamplingParams(n=2, temperature=0.8, seed=5, max_tokens=12, logprobs=1)
    expected = llm.generate(PROMPTS, params, use_tqdm=False)
    llm.reset_prefix_cache()
    client = InProcessClient(llm)

    async def collect(ids: list[int]) -> dict[int, tuple[list[int], str, int, str | None]]:
        samples: dict[int, tuple[list[int], str, int, str | None]] = {}
        stream = await client.submit(ids, params, None)
        async for report in stream:
            for c in report.outputs:
                tokens, text, lps, _ = samples.get(c.index, ([], "", 0, None))
                lps += len(c.logprobs)
                samples[c.index] = (tokens + c.token_ids, text + c.text, lps, c.finish_reason)
        assert report.finished and stream.request_id
        return samples

    async def run():
        return await asyncio.gather(*(collect(ids) for ids in PROMPTS))

    try:
        got = asyncio.run(run())
    finally:
        client.shutdown()
    for out, samples in zip(expected, got, strict=True):
        for c in out.outputs:
            assert samples[c.index] == (c.token_ids, c.text, len(c.token_ids), c.finish_reason)


def test_one_wake_per_step_for_every_stream(llm):
    """Eight streams decoding together: after each step the engine thread wakes the event loop once with
    every report of that step (it woke it once per request per step)."""
    client = InProcessClient(llm)
    engine, steps = llm.engine, [0]
    step = engine.step

    def counted_step():
        steps[0] += 1
        return step()

    engine.step = counted_step
    wakes = [0]

    async def run():
        loop = asyncio.get_running_loop()
        threadsafe = loop.call_soon_threadsafe

        def counting(*args, **kwargs):
            wakes[0] += 1
            return threadsafe(*args, **kwargs)

        loop.call_soon_threadsafe = counting
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        streams = [await client.submit(ids, params, None) for ids in PROMPTS]
        before = wakes[0]  # each submission is answered once, with its request id
        for stream in streams:
            async for _ in stream:
                pass
        return wakes[0] - before

    try:
        woke = asyncio.run(run())
    finally:
        client.shutdown()
        del engine.step
    assert steps[0] >= 24 and woke <= steps[0]  # 8 requests x 24 tokens: 192 wakes, one per report


def test_a_stream_raises_the_error_that_ends_its_request(llm):
    """A request ended from outside (here the shutdown's grace period running out) raises its error from
    the stream after the reports it had, and the stream then ends."""
    client = InProcessClient(llm)
    engine, gate, steps = llm.engine, threading.Event(), [0]
    step = engine.step

    def held_step():  # the second step waits until the request is failed: it cannot finish first
        steps[0] += 1
        if steps[0] > 1:
            assert gate.wait(60)
        return step()

    engine.step = held_step

    async def run():
        stream = await client.submit(PROMPTS[0], SamplingParams(max_tokens=64, ignore_eos=True), None)
        await anext(stream)
        client.fail_all(APIError(503, "going away", code="shutting_down"))
        gate.set()
        with pytest.raises(APIError, match="going away"):
            async for report in stream:
                assert not report.finished
        with pytest.raises(StopAsyncIteration):
            await anext(stream)

    try:
        asyncio.run(run())
    finally:
        client.shutdown()
        del engine.step


def test_an_abort_that_fails_while_everything_is_failed_ends_each_stream_once(llm):
    """The grace period runs out (``fail_all``) and the engine's abort of the first request raises: the
    engine has failed, so the second request ends with that failure. Each stream raises one error and
    ends, a new request is refused with the engine's real failure, and the engine thread lives on. (It
    used to remove the second request twice: the KeyError ended the thread's loop mid-queue.)"""
    client = InProcessClient(llm)
    engine, armed, gate = llm.engine, threading.Event(), threading.Event()
    step = engine.step

    def held_step():  # once both are in flight, the next step waits until they are failed
        if armed.is_set():
            assert gate.wait(60)
        return step()

    def failing_abort(request_id: str) -> bool:
        raise RuntimeError("injected abort failure")

    engine.step, llm.loop.abort = held_step, failing_abort
    params = SamplingParams(max_tokens=64, ignore_eos=True)

    async def drain(stream) -> APIError:
        with pytest.raises(APIError) as raised:
            async for report in stream:
                assert not report.finished
        with pytest.raises(StopAsyncIteration):
            await anext(stream)
        return raised.value

    async def run():
        first = await client.submit(PROMPTS[0], params, None)
        await anext(first)
        second = await client.submit(PROMPTS[1], params, None)
        armed.set()
        client.fail_all(APIError(503, "going away", code="shutting_down"))
        gate.set()
        armed.clear()
        errors = [await asyncio.wait_for(drain(s), 60) for s in (first, second)]
        assert "going away" in str(errors[0]) and "engine failed" in str(errors[1])
        assert "abort" in str(errors[1])

        async def later():
            stream = await client.submit(PROMPTS[2], params, None)
            return await drain(stream)

        with pytest.raises(APIError, match="no more requests: abort failed: RuntimeError: injected abort"):
            await asyncio.wait_for(later(), 60)  # answered with the engine's real failure
        assert client._thread.alive  # its command loop went on

    try:
        asyncio.run(run())
    finally:
        client.shutdown()
        del engine.step, llm.loop.abort
