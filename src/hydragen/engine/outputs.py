"""What the engine reports: one RequestOutput per request, each with its n CompletionOutputs.

``generate()`` returns each request's final output. ``EngineCore.step()`` reports, per request, what its
``SamplingParams.output_kind`` asks for (vLLM's ``RequestOutputKind``): the final output only, the whole
output after every step that changed it, or only what is new since the last report (streaming: the server
sends exactly these pieces, it never compares sequences itself).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


class RequestOutputKind(Enum):
    CUMULATIVE = 0  # after every step that changed the request: everything so far
    DELTA = 1  # after every step that changed the request: the new tokens, text and logprobs only
    FINAL_ONLY = 2  # once, when the request has finished (LLM.generate)


@dataclass
class CompletionOutput:
    """One sample. Reported as a DELTA, ``text``, ``token_ids`` and ``logprobs`` hold only what is new since
    the sample's last report (``finish_reason`` is set in the report that ends it)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" | "length"
    # Per generated token: {token_id: logprob} with the sampled token plus the top-`logprobs` alternatives.
    logprobs: list[dict[int, float]] | None = None
    stop_reason: str | int | None = None  # the stop string or stop token that ended it, if any
    # LLM.chat(..., tools=...): the calls the reply made (hydragen.tools.ToolCall; [] when it answered in
    # text) and its text outside them (None when there is none); both None without tools.
    tool_calls: list | None = None
    content: str | None = None
    # LLM.chat with a reasoning model (LLM(reasoning_parser=...)): the text of the reply's <think> block,
    # without the tags and the whitespace around it (None when it did not reason); ``content`` is then the
    # text after the block (and outside any tool calls), while ``text`` stays the whole reply. vLLM's name.
    reasoning_content: str | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    cached_prompt_tokens: int = 0  # prompt tokens on shared pages: cached, or computed by another request
    error: str | None = None  # set when the request could not be completed (e.g. out of KV memory)
    first_scheduled_time: float | None = None  # time.monotonic() when it first got a seat (queueing time)
