"""Whether each data-parallel replica can take requests, from what its server says, not only from whether its
process runs.

A replica's process outlives its engine. A server whose engine failed answers every request at once with a
503 ``engine_failed``; one stuck in a step past ``--step-timeout`` answers 503 ``engine_stalled``
(``server.step_watchdog``). Both answer fast, so by load alone they look idle and draw requests. The front
judges every replica on two kinds of evidence:

* its ``/health``, asked every ``CHECK_INTERVAL_S`` seconds (an answer not in within ``CHECK_TIMEOUT_S`` is
  ``no_answer``);
* the errors it answers proxied requests with (``server_verdict``), judged at once; a 503 among them was
  answered before the server took the request, so the front routes that request again.

A replica judged anything but ok leaves the rotation at once. One whose engine failed is restarted at once
(a failed engine takes no request again). One stalled or not answering is restarted once it has been out
for ``restart_after`` seconds without answering ok (the front's ``--step-timeout``: a stalled step has then
run twice the bound); one that answers ok before that comes back into rotation with its cache.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import httpx

log = logging.getLogger("hydragen.dp")

CHECK_INTERVAL_S = 1.0
CHECK_TIMEOUT_S = 5.0
OK, STARTING, EXITED, NO_ANSWER, ENGINE_FAILED = "ok", "starting", "exited", "no_answer", "engine_failed"
REFUSALS = frozenset({ENGINE_FAILED, "engine_stalled"})  # a server's 503 codes for "not taken: I cannot"


@dataclass(frozen=True)
class Verdict:
    code: str  # OK, or why not: the server's error code, NO_ANSWER, or "status_<n>"
    detail: str = ""


def server_verdict(status: int, body: bytes) -> Verdict | None:
    """What a server's error response says about the server itself: a 503 refusal (``REFUSALS``), or the
    500 ``engine_failed`` its requests in flight end with; None for any other response."""
    if status not in (500, 503):
        return None
    try:
        error = json.loads(body)["error"]
        code, message = error["code"], str(error.get("message", ""))
    except (ValueError, KeyError, TypeError):
        return None
    if code == ENGINE_FAILED or (status == 503 and code in REFUSALS):
        return Verdict(code, message)
    return None


async def ask(client: httpx.AsyncClient, url: str) -> Verdict:
    """The replica's own ``/health``."""
    try:
        response = await client.get(url + "/health", timeout=CHECK_TIMEOUT_S)
    except httpx.HTTPError as e:
        return Verdict(NO_ANSWER, f"/health: {type(e).__name__}: {e}")
    if response.status_code == 200:
        return Verdict(OK)
    verdict = server_verdict(response.status_code, response.content)
    return verdict or Verdict(f"status_{response.status_code}", response.text[:200])


@dataclass
class ReplicaHealth:
    state: str = STARTING  # OK, or why it is out of rotation (until it is back)
    detail: str = ""
    since: float = 0.0  # when it left the rotation
    pid: int | None = None  # the process judged; verdicts about another (an earlier run) are ignored


class HealthWatch:
    """Judges the replicas; acts through ``take_out(i)``, ``put_back(i)`` and ``replace(i, why)``."""

    def __init__(
        self,
        replicas: int,
        restart_after: float,
        *,
        take_out: Callable[[int], None],
        put_back: Callable[[int], None],
        replace: Callable[[int, str], None],
        clock: Callable[[], float] = time.monotonic,
    ):
        """``restart_after``: seconds a replica may stay stalled or silent before it is restarted (0: never;
        it then stays out of rotation until it answers ok)."""
        self.restart_after = restart_after
        self.take_out, self.put_back, self.replace = take_out, put_back, replace
        self.clock = clock
        self.replicas = [ReplicaHealth() for _ in range(replicas)]
        self.unhealthy = [Counter[str]() for _ in range(replicas)]  # times taken out, by reason
        self.replaced = [Counter[str]() for _ in range(replicas)]  # times restarted for it, by reason

    def up(self, i: int, pid: int) -> None:
        """Replica ``i``'s process ``pid`` is ready (in rotation)."""
        self.replicas[i] = ReplicaHealth(OK, pid=pid)

    def down(self, i: int) -> None:
        """Its process ended; the state keeps why it left the rotation, if it was taken out first."""
        h = self.replicas[i]
        if h.state == OK:
            h.state, h.detail, h.since = EXITED, "", self.clock()
        h.pid = None

    def judge(self, i: int, pid: int | None, verdict: Verdict) -> None:
        h = self.replicas[i]
        if pid is None or pid != h.pid:
            return  # about a run that has ended (or one being restarted)
        now = self.clock()
        if verdict.code == OK:
            if h.state != OK:
                log.warning("replica %d is healthy again after %.1f s out (%s)", i, now - h.since, h.state)
                h.state, h.detail = OK, ""
                self.put_back(i)
            return
        if h.state == OK:
            h.since = now
            self.unhealthy[i][verdict.code] += 1
            log.error("replica %d is out of rotation: %s (%s)", i, verdict.code, verdict.detail)
            self.take_out(i)
        h.state, h.detail = verdict.code, verdict.detail
        waited = now - h.since
        if h.state == ENGINE_FAILED or 0 < self.restart_after <= waited:
            why = f"{h.state} ({h.detail})" if h.state == ENGINE_FAILED else f"{h.state} for {waited:.0f} s"
            self.replaced[i][h.state] += 1
            h.pid = None  # nothing more to judge about this run
            self.replace(i, why)

    def states(self) -> dict[str, str]:
        return {str(i): h.state for i, h in enumerate(self.replicas)}

    async def watch(self, client: httpx.AsyncClient, replicas) -> None:
        """Ask every running replica's ``/health`` every ``CHECK_INTERVAL_S`` (``replicas``: the
        ReplicaSet's, read afresh each round), until cancelled."""

        async def check(replica) -> None:
            url, pid = replica.url, replica.pid
            if url is None or pid != self.replicas[replica.index].pid:
                return
            try:
                self.judge(replica.index, pid, await ask(client, url))
            except Exception:  # a fault in one check must not end the watch
                log.exception("checking replica %d's health failed", replica.index)

        while True:
            await asyncio.sleep(CHECK_INTERVAL_S)
            await asyncio.gather(*(check(r) for r in replicas))
