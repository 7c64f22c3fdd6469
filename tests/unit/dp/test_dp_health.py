"""The data-parallel front's judgement of its replicas (``dp.health``), driven with its own verdicts and a
clock the test sets: who leaves the rotation, who comes back, who is restarted and when."""

from __future__ import annotations

import json

import pytest

from hydragen.dp.health import NO_ANSWER, OK, HealthWatch, Verdict, server_verdict

FAILED = Verdict("engine_failed", "engine step failed: RuntimeError: boom")
STALLED = Verdict("engine_stalled", "its current step has run 61.0 s")
FINE = Verdict(OK)


class Watched:
    """A HealthWatch of two replicas (pids 100 and 200) recording what it did, on the test's clock."""

    def __init__(self, restart_after: float = 60.0):
        self.now = 0.0
        self.done: list[tuple] = []
        self.watch = HealthWatch(
            2,
            restart_after,
            take_out=lambda i: self.done.append(("out", i)),
            put_back=lambda i: self.done.append(("back", i)),
            replace=lambda i, why: self.done.append(("replace", i, why)),
            clock=lambda: self.now,
        )
        self.watch.up(0, 100)
        self.watch.up(1, 200)

    def judge(self, i: int, verdict: Verdict, at: float, pid: int | None = None) -> list[tuple]:
        self.now, before = at, len(self.done)
        self.watch.judge(i, pid if pid is not None else (100, 200)[i], verdict)
        return self.done[before:]


def test_a_failed_engine_leaves_the_rotation_and_is_restarted_at_once():
    w = Watched()
    assert w.judge(0, FINE, 1) == []
    assert w.judge(0, FAILED, 2) == [("out", 0), ("replace", 0, f"engine_failed ({FAILED.detail})")]
    assert w.watch.states() == {"0": "engine_failed", "1": "ok"}
    assert w.judge(0, FAILED, 3) == [] and w.judge(0, FINE, 3) == []  # that run is being replaced
    w.watch.down(0)
    assert w.watch.states()["0"] == "engine_failed"  # why it is out, until it is back
    w.watch.up(0, 101)
    assert w.watch.states()["0"] == "ok"
    assert (w.watch.unhealthy[0], w.watch.replaced[0]) == ({"engine_failed": 1}, {"engine_failed": 1})
    assert w.watch.unhealthy[1] == {}


def test_a_stalled_replica_comes_back_if_it_recovers_within_the_bound_and_is_restarted_if_not():
    w = Watched(restart_after=60)
    assert w.judge(1, STALLED, 10) == [("out", 1)]
    assert w.judge(1, STALLED, 69.9) == []  # out, not yet restarted
    assert w.judge(1, FINE, 70) == [("back", 1)]  # the step ended: back, cache and all
    assert w.judge(1, STALLED, 100) == [("out", 1)]  # a second stall starts its own count
    assert w.judge(1, Verdict(NO_ANSWER, "ReadTimeout"), 130) == []
    assert w.judge(1, STALLED, 160) == [("replace", 1, "engine_stalled for 60 s")]
    assert w.watch.unhealthy[1] == {"engine_stalled": 2} and w.watch.replaced[1] == {"engine_stalled": 1}


def test_without_a_bound_a_stalled_replica_is_only_kept_out():
    w = Watched(restart_after=0)
    assert w.judge(0, Verdict(NO_ANSWER, "ConnectTimeout"), 1) == [("out", 0)]
    assert w.judge(0, STALLED, 1e6) == []
    assert w.judge(0, FAILED, 1e6 + 1) == [("replace", 0, f"engine_failed ({FAILED.detail})")]


def test_verdicts_about_an_earlier_run_are_ignored():
    w = Watched()
    w.watch.down(0)
    assert w.watch.states()["0"] == "exited"
    assert w.judge(0, FAILED, 1, pid=100) == []  # a late answer of the process that exited
    w.watch.up(0, 101)
    assert w.judge(0, FAILED, 2, pid=100) == []
    assert w.judge(0, FINE, 3, pid=101) == [] and w.watch.states()["0"] == "ok"


def error(status: int, code: str) -> tuple[int, bytes]:
    return status, json.dumps(
        {"error": {"message": f"m {code}", "type": "t", "param": None, "code": code}}
    ).encode()


@pytest.mark.parametrize(
    "status, body, expected",
    [
        (*error(503, "engine_failed"), "engine_failed"),  # refused before it took the request
        (*error(503, "engine_stalled"), "engine_stalled"),
        (*error(500, "engine_failed"), "engine_failed"),  # a request in flight when the engine failed
        (*error(503, "shutting_down"), None),  # draining is not a fault
        (*error(500, "request_failed"), None),  # one request's own failure says nothing of the server
        (*error(400, "invalid_value"), None),
        (503, b"<html>not ours</html>", None),
        (200, b"{}", None),
    ],
)
def test_what_a_servers_error_answer_says_about_the_server(status, body, expected):
    verdict = server_verdict(status, body)
    assert (verdict.code if verdict is not None else None) == expected
