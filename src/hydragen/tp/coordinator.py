"""Rank 0's side of tensor parallelism: the one scheduler drives every rank, step by step.

Rank 0 runs the EngineCore (scheduler, radix tree, KV manager) unchanged. Its model runner and page pool are
subclasses that first tell the other ranks what to do: ``TPRunner.forward`` broadcasts the packed batch
and then runs the same forward as every rank; ``TPPagePool.copy_physical`` broadcasts the slot copies of the
no-sharing baseline. Every rank's pool has the same pages and slots (holding its own KV heads), so the
one set of block tables rank 0 builds serves all ranks.

Failure handling: a forward that raises on some ranks is finished in step by all of them
(``lockstep.py``): rank 0 then raises that rank's error as an ordinary exception, and the engine ends the
request it belongs to, as in one process. Before each command rank 0 checks that its spawned workers are
alive; a collective that fails (a peer died, hung past the timeout, or disagreed), or anything else that
leaves the ranks out of step, marks the group broken, and every later step raises at once with the first
reason. While idle, a heartbeat keeps the workers' wait for the next command under the collective timeout.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch

from hydragen.engine.model_runner import ModelRunner, PackedBatch
from hydragen.errors import EngineBroken
from hydragen.kv.pool import PagePool
from hydragen.tp import commands
from hydragen.tp.group import CollectiveError, TPGroup, collective_timeout
from hydragen.tp.lockstep import RankFailed, run_step

DEATH_GRACE_S = 1.0


class TPGroupBroken(EngineBroken):
    """The tensor-parallel ranks can no longer work together (a worker died, hung or failed)."""


class Coordinator:
    """Rank 0's channel to the other ranks: one command at a time, liveness checked, failure remembered."""

    def __init__(self, group: TPGroup, dead_workers: Callable[[], list[str]] = lambda: []):
        self.group = group
        self.dead_workers = dead_workers
        self.lock = threading.RLock()
        self.broken: str | None = None
        self.stopped = False
        self.last_sent = time.monotonic()
        self.heartbeat_s = max(0.05, min(10.0, collective_timeout() / 4))
        self._halt = threading.Event()  # ends the heartbeat at once (see stop)
        self._heartbeat = threading.Thread(target=self._beat, name="hydragen-tp-heartbeat", daemon=True)
        self._heartbeat.start()

    def check(self) -> None:
        """Raise TPGroupBroken if the group cannot run a step."""
        if self.stopped:
            raise TPGroupBroken("tensor-parallel group is down: the LLM was closed")
        if self.broken is None:
            dead = self.dead_workers()
            if dead:
                self.broken = "; ".join(dead)
        if self.broken is not None:
            raise TPGroupBroken(f"tensor-parallel group is down: {self.broken}")

    def failure(self) -> str | None:
        """Why the group cannot run a step, or None: ``check`` without raising. A server asks it while idle,
        so a worker that died between requests is seen before the next request comes."""
        try:
            self.check()
        except TPGroupBroken as e:
            return str(e)
        return None

    def fail(self, why: BaseException | str) -> None:
        """Mark the group broken, naming a dead worker if there is one: a collective with a killed peer
        fails as the peer's sockets close, a moment before its process can be reaped, so a failed
        collective waits up to DEATH_GRACE_S for that."""
        if self.broken is None:
            dead = self.dead_workers()
            deadline = time.monotonic() + (DEATH_GRACE_S if isinstance(why, CollectiveError) else 0.0)
            while not dead and time.monotonic() < deadline:
                time.sleep(0.01)
                dead = self.dead_workers()
            reason = why if isinstance(why, str) else f"{type(why).__name__}: {why}".strip()
            self.broken = "; ".join(dead) or f"the ranks could not finish a step together ({reason})"

    def send(self, command: int, payload: torch.Tensor | None = None) -> None:
        with self.lock:
            self.check()
            try:
                commands.send(self.group, command, payload)
            except BaseException as e:
                self.fail(e)
                self.check()
                raise
            self.last_sent = time.monotonic()

    def report(self) -> str:
        """The errors the workers met in the last step, one line; "" when none did (a REPORT round)."""
        with self.lock:
            self.send(commands.REPORT)
            texts = self.group.gather_texts("")
        return "; ".join(f"tensor-parallel rank {rank}: {text}" for rank, text in enumerate(texts) if text)

    def stop(self) -> bool:
        """Tell the workers to exit; False when they could not be told (broken group)."""
        with self.lock:
            if self.stopped:
                return True
            ok = self.broken is None and not self.dead_workers()
            if ok:
                try:
                    commands.send(self.group, commands.STOP)
                except Exception:  # noqa: BLE001  the launcher kills what is left
                    ok = False
            self.stopped = True
        # The heartbeat thread holds this coordinator, and through ``dead_workers`` the group's handle and
        # its model: it ends now, not after its sleep, so that a closed LLM's memory is free once closed.
        self._halt.set()
        self._heartbeat.join(timeout=1.0)
        return ok

    def _beat(self) -> None:
        while not self._halt.wait(self.heartbeat_s / 2):
            if self.stopped or self.broken is not None:
                return
            if time.monotonic() - self.last_sent < self.heartbeat_s:
                continue
            if not self.lock.acquire(timeout=0.1):
                continue  # a step is running: it is the heartbeat
            try:
                if not self.stopped and self.broken is None:
                    self.send(commands.NOOP)
            except Exception:  # noqa: BLE001  recorded in self.broken; the next step reports it
                pass
            finally:
                self.lock.release()


class TPPagePool(PagePool):
    """This rank's KV pages (its KV heads); slot copies are repeated on every rank."""

    coordinator: Coordinator

    def copy_physical(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        with self.coordinator.lock:  # the slots of every group, as stored: the workers keep no page map
            self.coordinator.send(commands.COPY, commands.pack_copy(dst, src))
            super().copy_physical(dst, src)


class TPRunner(ModelRunner):
    """The model runner on rank 0: every forward is broadcast first, then run by all ranks together."""

    coordinator: Coordinator

    def setup_workers(self) -> None:
        pool = self.pool
        code = commands.ATTENTION_CODES.index(self.attention_name)
        kv_code = commands.KV_DTYPE_CODES.index(pool.k.dtype)
        self.coordinator.send(commands.SETUP, torch.tensor([pool.num_pages, pool.page_size, code, kv_code]))

    def forward(self, batch: PackedBatch) -> torch.Tensor | None:
        """Every rank's forward of ``batch``; the full logits of its sampling rows. A forward that raised on
        some ranks raises here as an ordinary exception (rank 0's own, or ``RankFailed`` with a worker's);
        ``TPGroupBroken`` when the ranks could not finish the step together."""
        coordinator = self.coordinator
        with coordinator.lock:
            coordinator.send(commands.STEP, commands.pack_step(batch))
            try:
                outcome = run_step(super().forward, self.model, batch)
                failures = coordinator.report() if outcome.error is None and outcome.worker_flagged else ""
                if failures:
                    raise RankFailed(failures)
            except RankFailed:
                raise
            except BaseException as e:  # the ranks may now be out of step: the group is done
                coordinator.fail(e)
                raise TPGroupBroken(f"tensor-parallel group is down: {coordinator.broken}") from e
            if outcome.error is not None:
                raise outcome.error  # rank 0's own, after every rank finished the step
            return outcome.logits
