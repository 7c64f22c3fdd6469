"""OpenAI request bodies (pydantic, strict), validated into SamplingParams with errors that name the field.

Strict: a string is not a number and ``true`` is not 1. Closed: a parameter the server does not declare is
refused with a 400 naming it (``unsupported_parameter``), never silently dropped, except the few in
``IGNORED`` that cannot change the output. ``NEUTRAL`` lists unimplemented parameters that clients often
send at their no-op value: that value is accepted, any other is refused. As parameters get implemented,
they become fields here and leave those lists.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from hydragen.engine.sampling_params import MAX_LOGPROBS, ParamError, SamplingParams
from hydragen.server.errors import APIError
from hydragen.server.structured_fields import structured_outputs_from

# Accepted and ignored: bookkeeping for the caller, no effect on what is generated.
IGNORED = frozenset({"user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier"})

# Not implemented; accepted only at the value that means "off".
NEUTRAL: dict[str, tuple] = {
    "presence_penalty": (0,),
    "frequency_penalty": (0,),
    "repetition_penalty": (1,),
    "best_of": (1,),
    "echo": (False,),
    "suffix": ("",),
    "logit_bias": ({},),
    "functions": ([],),  # OpenAI's deprecated spelling of tools (use tools / tool_choice)
    "function_call": ("none",),
    "modalities": (["text"],),
}


def refuse_unsupported(body: dict) -> dict:
    """Drop ignored and neutral-valued parameters; 400 for an unimplemented one set to anything else."""
    out = {}
    for key, value in body.items():
        if key in IGNORED or (key in NEUTRAL and (value is None or _same(value, NEUTRAL[key]))):
            continue
        if key in NEUTRAL:
            allowed = " or ".join(repr(v) for v in NEUTRAL[key])
            raise APIError(
                400,
                f"{key!r} is not supported by this server (only {allowed} or null, which change nothing)",
                key,
                code="unsupported_parameter",
            )
        out[key] = value
    return out


def _same(value: Any, choices: tuple) -> bool:
    """Equal to one of ``choices`` with the same JSON type (``false`` is not ``0``)."""
    for c in choices:
        if isinstance(c, bool) or isinstance(value, bool):
            if value is c:
                return True
        elif isinstance(c, (int, float)) and isinstance(value, (int, float)):
            if value == c:
                return True
        elif type(value) is type(c) and value == c:
            return True
    return False


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class _Common(_Strict):
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
    # Output constraints (server/structured_fields.py): OpenAI's and vLLM's spellings, at most one.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # hydragen's switch (also `serve --literal-json-schema`): read JSON Schemas literally, so an object
    # without additionalProperties may get extra keys; default: only its named properties, as the peers.
    literal_json_schema: bool | None = None

    def structured_field(self) -> str:
        """The request field that carries the output constraint (for naming it in errors)."""
        return structured_outputs_from(self)[1]

    def sampling_params(
        self, max_tokens: int, logprobs: int | None, defaults: dict | None = None
    ) -> SamplingParams:
        """SamplingParams, or a 400 naming the parameter the engine could not represent. A sampling field
        the request leaves unset takes ``defaults`` (the model's own, as vLLM), else OpenAI's default."""
        structured, _ = structured_outputs_from(self)
        given = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
        }
        unset = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, **(defaults or {})}
        chosen = {k: v if v is not None else unset[k] for k, v in given.items()}
        fields = dict(
            structured_outputs=structured,
            n=self.n,
            **chosen,
            max_tokens=max_tokens,
            stop=self.stop or None,
            stop_token_ids=self.stop_token_ids,
            seed=self.seed,
            logprobs=logprobs,
            ignore_eos=self.ignore_eos,
        )
        try:
            return SamplingParams(**fields)
        except ParamError as e:
            param = self.max_tokens_param if e.param == "max_tokens" else e.param
            raise APIError(400, str(e).replace("SamplingParams.", ""), param, code="invalid_value") from None

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def max_tokens_param(self) -> str:
        return "max_tokens"


class CompletionRequest(_Common):
    # Checked by prompts() rather than as a pydantic union: a union of list types validates a
    # million-id prompt several times over (about a second of CPU), these type-set checks run in C.
    prompt: str | list[Any]
    logprobs: int | None = None

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: a string, or a list of token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise APIError(400, "prompt must not be empty", "prompt", code="invalid_value")
        kinds = set(map(type, p))
        if kinds == {int}:
            return [p]
        if kinds == {str}:
            return list(p)
        if kinds == {list}:
            for i, ids in enumerate(p):
                if ids and set(map(type, ids)) != {int}:
                    raise APIError(
                        400,
                        f"prompt[{i}] must be a list of token ids (integers)",
                        f"prompt[{i}]",
                        code="invalid_value",
                    )
            return list(p)
        raise APIError(
            400,
            "prompt must be a string, a list of strings, a list of token ids or a list of lists of token ids",
            "prompt",
            code="invalid_value",
        )

    def logprobs_count(self) -> int | None:
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise APIError(400, f"logprobs must be in [0, {MAX_LOGPROBS}]", "logprobs", code="invalid_value")
        return self.logprobs


# Fields of OpenAI's own response message (openai.types.chat.ChatCompletionMessage) that hydragen cannot
# render into a prompt. A reply sent back as `message.model_dump()` carries them null: accepted. Set, each
# asks for something hydragen does not do, and is refused naming it, never dropped.
UNRENDERABLE = {
    "refusal": "a refusal cannot be rendered into the prompt (send the text as content, refusal null)",
    "annotations": "citations cannot be rendered into the prompt (send null or [])",
    "audio": "hydragen has no audio: an audio reference cannot be rendered (send null)",
    "function_call": "the deprecated function_call is not supported (send the call in tool_calls)",
}


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[Any] | None = None  # assistant: the calls it made (tools/render.py checks them)
    tool_call_id: str | None = None  # tool: the call this result answers
    # OpenAI's response fields, accepted null or empty and refused set (UNRENDERABLE); and `parsed`, the
    # openai SDK's parsed copy of content (its stream helper and .parse() add it): ignored.
    refusal: str | None = None
    annotations: list[Any] | None = None
    audio: dict[str, Any] | None = None
    function_call: dict[str, Any] | None = None
    parsed: Any = None
    # A reasoning model's reasoning: vLLM's field, and `reasoning`, its newer name. The chat template gets it
    # as `reasoning_content`, which templates of reasoning models (Qwen3's) read; other templates ignore it.
    reasoning_content: str | None = None
    reasoning: str | None = None

    def text(self, index: int) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for j, part in enumerate(self.content):
            if (
                part.get("type") != "text"
                or not isinstance(part.get("text"), str)
                or set(part) - {"type", "text"}
            ):
                raise APIError(
                    400,
                    "only text content parts ({'type': 'text', 'text': ...}) are supported",
                    f"messages[{index}].content[{j}]",
                    code="unsupported_parameter",
                )
            parts.append(part["text"])
        return "".join(parts)

    def template_message(self, index: int) -> dict:
        """The message as the chat template gets it, or a 400 naming the field that cannot be rendered."""
        where = f"messages[{index}]"
        for name, why in UNRENDERABLE.items():
            if getattr(self, name):  # null and empty say nothing
                raise APIError(
                    400, f"{where}.{name} is set: {why}", f"{where}.{name}", code="unsupported_parameter"
                )
        if self.role == "tool" and not self.tool_call_id:
            raise APIError(
                400, "a tool message needs its tool_call_id", f"{where}.tool_call_id", code="invalid_value"
            )
        if self.role != "assistant" and self.tool_calls is not None:
            raise APIError(
                400, "only assistant messages carry tool_calls", f"{where}.tool_calls", code="invalid_value"
            )
        for j, call in enumerate(self.tool_calls or []):
            kind = call.get("type", "function") if isinstance(call, dict) else "function"
            if kind != "function":
                raise APIError(
                    400,
                    f"{where}.tool_calls[{j}].type is {kind!r}: only function tool calls are supported",
                    f"{where}.tool_calls[{j}].type",
                    code="unsupported_parameter",
                )
        message = {"role": self.role, "content": self.text(index)}
        if self.tool_calls:
            message["tool_calls"] = self.tool_calls
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if reasoning := self._reasoning(where):
            message["reasoning_content"] = reasoning
        return message

    def _reasoning(self, where: str) -> str | None:
        """reasoning_content, or reasoning (two names for one field: they may not differ)."""
        given = {
            k: v
            for k, v in (("reasoning_content", self.reasoning_content), ("reasoning", self.reasoning))
            if v
        }
        if len(set(given.values())) > 1:
            raise APIError(
                400,
                "reasoning and reasoning_content are two names for one field, and they differ",
                f"{where}.reasoning",
                code="invalid_value",
            )
        if given and self.role != "assistant":
            name = next(iter(given))
            raise APIError(
                400, f"only assistant messages carry {name}", f"{where}.{name}", code="invalid_value"
            )
        return next(iter(given.values()), None)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    # Tool calling (hydragen/tools/): checked by tool_session(), which names the bad field.
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None

    def tool_session(self, fmt):
        """The request's ToolSession (None without tools), or a 400 naming the bad field. A conversation
        holding earlier calls or results gets one too (tool_choice "none"), so they are rendered."""
        from hydragen.tools.session import ToolSession

        history = any(m.role == "tool" or m.tool_calls for m in self.messages)
        try:
            return ToolSession.open(
                self.tools,
                self.tool_choice,
                self.parallel_tool_calls,
                fmt,
                history,
                literal_json_schema=self.literal_json_schema,
                whole_calls=bool(self.stop or self.stop_token_ids),  # a stop could end a reply inside a call
            )
        except ParamError as e:
            raise APIError(400, str(e), e.param, code="invalid_value") from None

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def max_tokens_param(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    def logprobs_count(self) -> int | None:
        top = self.top_logprobs
        if top is not None and not 0 <= top <= MAX_LOGPROBS:
            raise APIError(
                400, f"top_logprobs must be in [0, {MAX_LOGPROBS}]", "top_logprobs", code="invalid_value"
            )
        if top and not self.logprobs:
            raise APIError(400, "top_logprobs requires logprobs=true", "top_logprobs", code="invalid_value")
        return (top or 0) if self.logprobs else None

    def conversation(self) -> list[dict]:
        if not self.messages:
            raise APIError(400, "messages must not be empty", "messages", code="invalid_value")
        return [m.template_message(i) for i, m in enumerate(self.messages)]
