"""What generate() returns: one RequestOutput per prompt, each with n CompletionOutputs."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
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


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    cached_prompt_tokens: int = 0  # prompt tokens on shared pages: cached, or computed by another request
    error: str | None = None  # set when the request could not be completed (e.g. out of KV memory)
