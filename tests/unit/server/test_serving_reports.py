"""The shared serving steps' stream helper without an engine: ``Reports`` merges a request's streams as their
reports come, ends on a failed request's error or on its ``stop`` future, and aborts exactly the requests
that have not finished when it is left (a finished one costs the engine thread no abort)."""

from __future__ import annotations

import asyncio

import pytest

from hydragen.engine.outputs import CompletionOutput, RequestOutput
from hydragen.server.engine_client import RequestStream
from hydragen.server.errors import APIError
from hydragen.server.serving import Reports


class Client:
    def __init__(self) -> None:
        self.aborted: list[str] = []

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


def stream(name: str) -> RequestStream:
    s = RequestStream()
    s.request_id = name
    return s


def report(text: str, finished: bool = False) -> RequestOutput:
    piece = CompletionOutput(0, text, [1], "stop" if finished else None)
    return RequestOutput("r", None, [1], [piece], finished=finished)


def test_reports_merge_as_they_come_and_abort_the_unfinished():
    async def run():
        client, a, b = Client(), stream("a"), stream("b")
        got = []
        with Reports(client, [a, b]) as reports:
            b.put(report("b0"))
            async for p_idx, r in reports:
                got.append((p_idx, r.outputs[0].text))
                if r.outputs[0].text == "b0":
                    a.put(report("a0", finished=True))
                elif r.outputs[0].text == "a0":
                    break
        return got, client.aborted

    got, aborted = asyncio.run(run())
    assert got == [(1, "b0"), (0, "a0")]
    assert aborted == ["b"]  # "a" had finished


def test_a_failed_request_raises_and_the_others_are_aborted():
    async def run():
        client, a, b = Client(), stream("a"), stream("b")
        a.put(APIError(500, "engine failed", code="engine_failed"))
        with pytest.raises(APIError, match="engine failed"), Reports(client, [a, b]) as reports:
            async for _ in reports:
                pass
        return client.aborted

    assert asyncio.run(run()) == ["a", "b"]


def test_stop_ends_the_iteration_and_says_so():
    async def run():
        client, a = Client(), stream("a")
        stop = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().call_later(0.01, stop.set_result, None)
        with Reports(client, [a], stop=stop) as reports:
            async for _ in reports:
                pass
        return reports.stopped, client.aborted

    assert asyncio.run(run()) == (True, ["a"])


def test_every_report_until_each_prompt_finished():
    async def run():
        client, a, b = Client(), stream("a"), stream("b")
        for s, name in ((a, "a"), (b, "b")):
            s.put(report(name + "0"))
            s.put(report(name + "1", finished=True))
        with Reports(client, [a, b]) as reports:
            got = [(p_idx, r.outputs[0].text) async for p_idx, r in reports]
        return sorted(got), reports.stopped, client.aborted

    assert asyncio.run(run()) == ([(0, "a0"), (0, "a1"), (1, "b0"), (1, "b1")], False, [])
