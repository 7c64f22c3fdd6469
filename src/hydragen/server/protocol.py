"""OpenAI request bodies (pydantic), validated into SamplingParams with errors that name the field."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from hydragen.engine.sampling_params import SamplingParams


class APIError(Exception):
    """An error answered in OpenAI's JSON shape."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        type_: str = "invalid_request_error",
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type_, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    max_tokens: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    def sampling_params(self, logprobs: int | None, default_max: int) -> SamplingParams:
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise APIError(400, f"{name} is not supported by hydragen (only 0)", name)
        max_tokens = self._max_tokens()
        fields = dict(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            min_p=self.min_p or 0.0,
            max_tokens=default_max if max_tokens is None else max_tokens,
            stop=self.stop or None,
            stop_token_ids=self.stop_token_ids,
            seed=self.seed,
            logprobs=logprobs,
            ignore_eos=self.ignore_eos,
        )
        try:
            return SamplingParams(**fields)
        except ValueError as e:
            param = str(e).split()[0].removeprefix("SamplingParams.")
            raise APIError(400, str(e).replace("SamplingParams.", ""), param) from None

    def _max_tokens(self) -> int | None:
        return self.max_tokens


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None)
    echo: bool = False

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise APIError(400, "prompt must not be empty", "prompt")
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise APIError(400, "only text content parts are supported", "messages")
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None

    def _max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def conversation(self) -> list[dict[str, str]]:
        if not self.messages:
            raise APIError(400, "messages must not be empty", "messages")
        return [{"role": m.role, "content": m.text()} for m in self.messages]
