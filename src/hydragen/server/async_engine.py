"""Runs the engine on one background thread and streams per-request updates to asyncio consumers.

The engine is not thread-safe, so only the worker thread touches it: HTTP handlers submit requests and
aborts through a queue and read updates from an asyncio queue per request. Every step, each active
request gets one update (new text and tokens per sequence); the final update carries the outputs.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
import traceback
from dataclasses import dataclass, field

from hydragen.engine.sampling_params import SamplingParams
from hydragen.engine.sequence import Request


@dataclass
class SeqDelta:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None


@dataclass
class Update:
    deltas: list[SeqDelta]
    finished: bool
    error: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0


@dataclass
class _Tracked:
    request: Request
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue
    sent_text: list[str] = field(default_factory=list)
    sent_tokens: list[int] = field(default_factory=list)
    finished_sent: list[bool] = field(default_factory=list)


class AsyncEngine:
    def __init__(self, llm):
        self.llm = llm
        self.engine = llm.engine
        self._commands: queue.Queue = queue.Queue()
        self._wake = threading.Event()
        self._tracked: dict[str, _Tracked] = {}
        self._stop = False
        self._ids = 0
        self.started = time.time()
        self.tokens_per_second = 0.0
        self._thread = threading.Thread(target=self._run, name="hydragen-engine", daemon=True)
        self._thread.start()

    # ---- called from the event loop ---------------------------------------------------------------
    async def submit(
        self, prompt_ids: list[int], params: SamplingParams, prompt: str | None
    ) -> tuple[str, asyncio.Queue]:
        """Queue a request; returns its id and the queue its updates arrive on. Raises ValueError."""
        loop = asyncio.get_running_loop()
        out: asyncio.Queue = asyncio.Queue()
        accepted: asyncio.Future = loop.create_future()
        self._commands.put(("add", (prompt_ids, params, prompt, loop, out, accepted)))
        self._wake.set()
        request_id = await accepted  # raises the engine's ValueError for a bad request
        return request_id, out

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))
        self._wake.set()

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=10)

    # ---- worker thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        window: list[tuple[float, int]] = []
        while not self._stop:
            self._drain_commands()
            if not self.engine.has_unfinished():
                self.tokens_per_second = 0.0
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            before = self.engine.stats.generated_tokens
            try:
                self.engine.step()
            except Exception as e:  # never lose a request: fail everything in flight with the error
                traceback.print_exc()
                self._fail_all(f"engine error: {type(e).__name__}: {e}")
                continue
            now = time.time()
            window.append((now, self.engine.stats.generated_tokens - before))
            window = [(t, n) for t, n in window if now - t < 5.0]
            span = max(now - window[0][0], 1e-3) if len(window) > 1 else 1.0
            self.tokens_per_second = sum(n for _, n in window) / span
            self._publish()

    def _drain_commands(self) -> None:
        while True:
            try:
                kind, payload = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                prompt_ids, params, prompt, loop, out, accepted = payload
                self._ids += 1
                rid = f"req-{self._ids}"
                try:
                    req = self.engine.add_request(prompt_ids, params, prompt=prompt, request_id=rid)
                except (ValueError, TypeError) as e:
                    loop.call_soon_threadsafe(_set_exception, accepted, ValueError(str(e)))
                    continue
                n = len(req.seqs)
                self._tracked[rid] = _Tracked(req, loop, out, [""] * n, [0] * n, [False] * n)
                loop.call_soon_threadsafe(_set_result, accepted, rid)
            elif kind == "abort":
                self.engine.abort(payload)
                self._tracked.pop(payload, None)

    def _publish(self) -> None:
        for rid, tr in list(self._tracked.items()):
            deltas = []
            for i, s in enumerate(tr.request.seqs):
                if tr.finished_sent[i]:
                    continue
                new_tokens = s.generated[tr.sent_tokens[i] :]
                if not new_tokens and not s.finished:
                    continue
                text = self._stable_text(s)
                delta_text = text[len(tr.sent_text[i]) :] if text.startswith(tr.sent_text[i]) else ""
                lp = s.logprobs[tr.sent_tokens[i] :] if s.logprobs is not None else None
                tr.sent_tokens[i] = len(s.generated)
                tr.sent_text[i] = text if text.startswith(tr.sent_text[i]) else tr.sent_text[i]
                tr.finished_sent[i] = s.finished
                deltas.append(SeqDelta(s.index, delta_text, new_tokens, lp, s.finish_reason))
            finished = all(tr.finished_sent)
            if deltas or finished:
                upd = Update(
                    deltas, finished, tr.request.error, len(tr.request.prompt_ids), tr.request.cached_tokens
                )
                tr.loop.call_soon_threadsafe(tr.out.put_nowait, upd)
            if finished:
                del self._tracked[rid]

    def _stable_text(self, s) -> str:
        """Text safe to send now: final text when finished; otherwise hold back an unfinished UTF-8
        character and anything that could still turn out to be the start of a stop string."""
        if s.finished:
            return s.text
        text = self.engine.text_of(s)
        stops = s.request.params.stop or []
        hold = max((len(x) - 1 for x in stops), default=0)
        if hold:
            text = text[: max(0, len(text) - hold)]
        return text.rstrip("\ufffd")

    def _fail_all(self, message: str) -> None:
        for rid, tr in list(self._tracked.items()):
            self.engine.abort(rid)
            tr.loop.call_soon_threadsafe(tr.out.put_nowait, Update([], True, message))
        self._tracked.clear()


def _set_result(fut: asyncio.Future, value) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
