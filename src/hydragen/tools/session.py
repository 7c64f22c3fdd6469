"""One request's tool calling, from OpenAI's fields to its reply: the one object ``LLM.chat``, the server
(``server/serving_chat.py``) and ``hydragen chat`` go through, so the three render, constrain and parse
alike and a change to tool calling lands in one place.

A ``ToolSession`` holds what the request asks (its ``ToolRequest``: functions, choice, format) and the
state its reply is read with: per choice, the scanner that finds calls in the text as it streams. Its
steps, in order:

- ``ToolSession.open``: from the request's fields (None when it has no tools and no earlier calls);
- ``prompt_ids``: the conversation through the chat template, the functions where they belong;
- ``constraint`` and ``sampling_params``: the call grammar when ``tool_choice`` enforces calls, built for
  the grammar engine's tokenizer (the server builds it on a worker thread: ``EngineClient.compile``);
- as the reply streams, ``deltas`` (OpenAI's content and tool-call deltas of a choice) or ``content``
  (its text without the call markup, what the CLI prints);
- ``reply``: the finished text's content, calls and finish reason.
"""

from __future__ import annotations

from hydragen.engine.sampling_params import ParamError
from hydragen.structured.params import StructuredOutputsParams
from hydragen.tools.formats import CallFormat
from hydragen.tools.parser import Content
from hydragen.tools.request import ToolRequest
from hydragen.tools.spec import Tool, ToolCall
from hydragen.tools.stream import ToolCallStream, finish_reason


class ToolSession:
    """One chat request's tool calling. ``literal_json_schema``: the request's own reading of argument
    schemas (None: the engine's default). ``whole_calls``: stream each call once complete (a request with
    stop strings or stop tokens, which could end the reply inside a call: tools/stream.py)."""

    def __init__(
        self, request: ToolRequest, literal_json_schema: bool | None = None, whole_calls: bool = False
    ) -> None:
        self.request, self.literal_json_schema, self.whole_calls = request, literal_json_schema, whole_calls
        self._choices: dict[int, ToolCallStream] = {}  # per choice, once its reply streams

    @classmethod
    def open(
        cls,
        tools,
        tool_choice,
        parallel_tool_calls,
        fmt: CallFormat,
        history: bool,
        *,
        literal_json_schema: bool | None = None,
        whole_calls: bool = False,
    ) -> ToolSession | None:
        """From OpenAI's fields (None: absent); ``history``: whether the conversation holds earlier calls or
        results, which a session renders even without tools (tool_choice "none"). None when there are
        neither tools nor history; ParamError naming the field for anything malformed."""
        request = ToolRequest.build(tools, tool_choice, parallel_tool_calls, fmt)
        if request is None and history:
            request = ToolRequest.history_only(fmt)
        return None if request is None else cls(request, literal_json_schema, whole_calls)

    @property
    def enforced(self) -> bool:
        """Whether replies may hold calls: parsed, and grammar-constrained (tool_choice is not "none")."""
        return self.request.enforced

    @property
    def tools(self) -> list[Tool]:
        return self.request.tools

    # ---- the prompt and the constraint --------------------------------------------------------------
    def prompt_ids(self, tokenizer, messages: list[dict], template_kwargs: dict | None = None) -> list[int]:
        """The conversation through the model's chat template, tools included where they belong;
        ``template_kwargs``: the request's ``chat_template_kwargs`` (Qwen3's ``enable_thinking``)."""
        return self.request.prompt_ids(tokenizer, messages, template_kwargs)

    def constraint(self, ll_tokenizer, default_literal: bool) -> StructuredOutputsParams | None:
        """The call grammar for the grammar engine's view of the tokenizer (None: calls are not enforced);
        ``default_literal``: the engine's ``literal_json_schema``, unless the request set its own. An
        ``EngineClient`` ``ConstraintBuilder``."""
        literal = default_literal if self.literal_json_schema is None else self.literal_json_schema
        return self.request.constraint(ll_tokenizer, literal)

    def sampling_params(self, params, constraint: StructuredOutputsParams | None):
        """``params`` (one SamplingParams, a list, or None) with the call grammar; ParamError when a
        request constrains its output another way too."""
        return self.request.sampling_params(params, constraint)

    def locate(self, error: ParamError) -> ParamError:
        """A compile error of the call grammar, pinned on the tool whose parameters are at fault."""
        return self.request.locate(error)

    # ---- the reply, as it streams ---------------------------------------------------------------------
    def deltas(self, index: int, piece: str, reason: str | None = None) -> tuple[list[dict], str | None]:
        """(OpenAI's deltas for choice ``index``'s new text, the choice's finish_reason once ``reason``,
        the engine's, says it ended: "tool_calls" after complete calls)."""
        stream = self._stream(index)
        deltas = stream.feed(piece, reason)
        return deltas, None if reason is None else finish_reason(reason, stream.complete)

    def content(self, piece: str, final: bool = False, index: int = 0) -> str:
        """Of choice ``index``'s new text, its content, never the call markup (``final``: the reply ended,
        so text held back as a possible call marker is content after all)."""
        if not self.enforced:
            return piece
        events = self._stream(index).scanner.feed(piece, final)
        return "".join(e.text for e in events if isinstance(e, Content))

    def _stream(self, index: int) -> ToolCallStream:
        if index not in self._choices:
            self._choices[index] = ToolCallStream(self.request.fmt, self.whole_calls)
        return self._choices[index]

    # ---- the finished reply -----------------------------------------------------------------------
    def reply(self, text: str, reason: str | None) -> tuple[str | None, list[ToolCall], str | None]:
        """(content or None, calls, OpenAI finish_reason) of a finished reply; a call that ``max_tokens``
        cut is among the calls as far as it was written (``ToolCall.complete`` False)."""
        return self.request.reply(text, reason)
