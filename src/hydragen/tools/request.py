"""What one chat request with tools asks, from OpenAI's fields to prompt ids, the output constraint, and
the parsed reply. It keeps no state, so the request's ``ToolSession`` (tools/session.py), which
``LLM.chat(..., tools=...)``, the server and ``hydragen chat`` all go through, adds its streamed reply's.

What each ``tool_choice`` does:

- ``"none"``: the tools are not shown to the model and nothing is parsed: a plain text reply;
- ``"auto"`` (the default with tools): the model writes text or starts a call; once it writes the
  format's call marker the rest of the call is grammar-enforced (a lazy grammar, tools/grammar.py);
- ``"required"``: one call or more (exactly one with ``parallel_tool_calls=False``), grammar-enforced;
- a named function: exactly one call of it, grammar-enforced; the wrapper and name are forced text.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from hydragen.errors import ParamError
from hydragen.structured.params import StructuredOutputsParams
from hydragen.structured.schema_defaults import find_keyword
from hydragen.tools.formats import CallFormat
from hydragen.tools.grammar import special_markers, tool_grammar
from hydragen.tools.parser import parse
from hydragen.tools.render import template_messages, template_tools
from hydragen.tools.spec import Tool, ToolCall, ToolChoice, parse_tool_choice, parse_tools
from hydragen.tools.stream import finish_reason


@dataclass(frozen=True)
class ToolRequest:
    tools: list[Tool]
    choice: ToolChoice
    parallel: bool
    fmt: CallFormat

    @classmethod
    def build(cls, tools, tool_choice, parallel_tool_calls, fmt: CallFormat) -> ToolRequest | None:
        """From OpenAI's fields (None: absent); None when the request has no tools and no choice.
        ParamError naming the field for anything malformed."""
        if not tools and tool_choice in (None, "none"):
            if tools is not None and not isinstance(tools, list):
                raise ParamError("tools", "tools must be a list of function definitions")
            return None
        parsed = parse_tools(tools) if tools else []
        if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
            raise ParamError("parallel_tool_calls", "parallel_tool_calls must be true or false")
        choice = parse_tool_choice(tool_choice, parsed)
        return cls(parsed, choice, parallel_tool_calls is not False, fmt)

    @classmethod
    def history_only(cls, fmt: CallFormat) -> ToolRequest:
        """For a conversation with earlier calls or results but no tools now: rendered, never parsed."""
        return cls([], ToolChoice("none"), True, fmt)

    @property
    def enforced(self) -> bool:
        return self.choice.mode != "none"

    def prompt_ids(self, tokenizer, messages: list[dict], template_kwargs: dict | None = None) -> list[int]:
        """The conversation through the model's chat template, tools included where they belong;
        ``template_kwargs``: the request's ``chat_template_kwargs``."""
        conversation = template_messages(messages, self.tools, self.choice, self.fmt)
        return tokenizer.apply_chat_template(
            conversation,
            add_generation_prompt=True,
            tools=template_tools(self.tools, self.choice, self.fmt),
            chat_template_kwargs=template_kwargs,
        )

    def constraint(
        self, ll_tokenizer, literal_json_schema: bool | None = None
    ) -> StructuredOutputsParams | None:
        """The output grammar (None for "none"), for the grammar engine's view of the tokenizer.
        ``literal_json_schema``: how the argument schemas read objects without additionalProperties (None:
        the peers' default, named properties only)."""
        if not self.enforced:
            return None
        special = special_markers(self.fmt, ll_tokenizer)
        lark = tool_grammar(
            self.tools, self.choice, self.fmt, self.parallel, bool(literal_json_schema), special
        )
        return StructuredOutputsParams(grammar=lark)

    def sampling_params(self, params, constraint: StructuredOutputsParams | None):
        """``params`` (one SamplingParams, a list, or None) with this request's output grammar, decoded with
        special tokens kept where the format's markers may be ones; a request that constrains its output
        another way cannot also call tools (ParamError)."""
        from hydragen.engine.sampling_params import SamplingParams

        many = isinstance(params, list)
        out = []
        for p in params if many else [params or SamplingParams()]:
            if constraint is not None and p.structured_outputs is not None:
                raise ParamError(
                    "tool_choice",
                    f"tool_choice {self.choice.mode!r} constrains the output to tool calls; it cannot be "
                    "combined with another output constraint (use tool_choice 'none')",
                )
            if constraint is not None:
                # the reply keeps its special tokens when the format's markers may be ones (Mistral's
                # [TOOL_CALLS] is special to Hugging Face): skipped, the parser would never see a call
                skip = not self.fmt.tokens and p.skip_special_tokens
                p = dataclasses.replace(p, structured_outputs=constraint, skip_special_tokens=skip)
            out.append(p)
        return out if many else out[0]

    def locate(self, error: ParamError) -> ParamError:
        """A compile error of the tool grammar, pinned on the tool whose parameters hold the keyword it
        names (``tools[i].function.parameters``)."""
        found = re.search(r'keywords? "([^"]+)"', str(error))
        for i, tool in enumerate(self.tools):
            where = find_keyword(tool.parameters, found.group(1)) if found else None
            if where:
                param = f"tools[{i}].function.parameters"
                return ParamError(param, f"{error} (in {param}, at {where})")
        return ParamError("tools", str(error))

    def reply(self, text: str, reason: str | None) -> tuple[str | None, list[ToolCall], str | None]:
        """(content or None, calls, OpenAI finish_reason) of a finished reply: its complete calls, and
        when ``max_tokens`` cut it (reason "length") inside a call, that call too, as far as it was
        written (``ToolCall.complete`` False), as the stream has sent it."""
        if not self.enforced:
            return text, [], reason
        content, calls = parse(text, self.fmt, cut=reason == "length")
        return content, calls, finish_reason(reason, sum(c.complete for c in calls))
