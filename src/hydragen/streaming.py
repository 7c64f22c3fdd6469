"""Run one request through the engine's step API and hand out its text as it grows.

`hydragen generate` (n = 1) and `hydragen chat` print tokens as they come. It runs on the engine's one
step loop (``engine/loop.py``) and reads only the engine's reports (the whole output so far after every
step that changed it), so it does not depend on how the engine batches or stores KV. Ctrl-C is turned
into a flag checked between steps (``interrupt_flag``), so stopping a reply never leaves the engine
half-way through a step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from hydragen.engine.loop import StepLoop
from hydragen.engine.outputs import RequestOutput, RequestOutputKind
from hydragen.engine.sampling_params import SamplingParams

TextSink = Callable[[int, str], None]  # (completion index, new text)
StepSink = Callable[[int, float], None]  # (tokens generated so far over all completions, seconds so far)


@dataclass
class StreamResult:
    """What one request produced, with the times a person cares about (measured around the steps)."""

    output: RequestOutput | None  # the finished request; None when it was stopped early
    texts: list[str]  # each completion's text (for a stopped request: what had been produced)
    stopped: bool  # ended by the caller's stop flag (Ctrl-C) before it finished
    started: float  # perf_counter() when the request was added
    ended: float
    first_token: float | None  # when the first token of any completion appeared
    tokens: int  # tokens generated over all completions
    first_step_tokens: int  # tokens produced by the step that produced the first ones

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.started

    @property
    def decode_rate(self) -> float | None:
        """Tokens per second after the first step (which also ran the prompt), or None if not measurable."""
        if self.first_token is None:
            return None
        later, seconds = self.tokens - self.first_step_tokens, self.ended - self.first_token
        return later / seconds if later > 0 and seconds > 0 else None


def stream_request(
    loop: StepLoop,
    prompt_ids: list[int],
    params: SamplingParams,
    *,
    prompt: str | None = None,
    on_text: TextSink | None = None,
    on_step: StepSink | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> StreamResult:
    """Add one request, step the engine until it finishes, and pass each completion's new text to
    ``on_text`` as soon as it is stable. ``should_stop`` is polled between steps: when it turns true the
    request is aborted (its KV stays in the prefix cache) and the result says ``stopped``.

    A request that fails in the engine raises RuntimeError with the engine's reason.
    """
    shown = [""] * params.n
    started = time.perf_counter()
    first: list[float | int] = []  # (time, tokens) of the step that produced the first tokens
    tokens = 0

    def report(output: RequestOutput) -> None:  # the whole output so far, after each step that changed it
        nonlocal tokens
        tokens = sum(len(c.token_ids) for c in output.outputs)
        if not first and tokens:
            first.extend((time.perf_counter(), tokens))
        if on_text is not None:
            for c in output.outputs:
                if len(c.text) > len(shown[c.index]) and c.text.startswith(shown[c.index]):
                    on_text(c.index, c.text[len(shown[c.index]) :])
                    shown[c.index] = c.text
        if on_step is not None:
            on_step(tokens, time.perf_counter() - started)

    params = dataclasses.replace(params, output_kind=RequestOutputKind.CUMULATIVE)
    req = loop.add(prompt_ids, params, prompt=prompt, on_report=report)
    (output,) = loop.run([req], should_stop=should_stop)
    if output is not None and output.error:
        raise RuntimeError(output.error)
    texts = [c.text for c in output.outputs] if output is not None else shown
    first_token, first_step_tokens = (first[0], first[1]) if first else (None, 0)
    return StreamResult(
        output, texts, output is None, started, time.perf_counter(), first_token, tokens, first_step_tokens
    )


@contextlib.contextmanager
def interrupt_flag() -> Iterator[Callable[[], bool]]:
    """While active, the first Ctrl-C (SIGINT) only raises a flag, which ``stream_request`` polls between
    engine steps; a second one raises KeyboardInterrupt as usual (for a step that takes too long).

    Outside the main thread signals cannot be caught, and the flag simply never rises.
    """
    hit = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield hit.is_set
        return

    def on_sigint(signum, frame) -> None:
        if hit.is_set():
            raise KeyboardInterrupt
        hit.set()

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield hit.is_set
    finally:
        signal.signal(signal.SIGINT, previous)
