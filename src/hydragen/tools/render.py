"""A conversation with tools, turned into the messages a chat template renders.

Where each part goes is the format's description (tools/formats.py: ``tools_in``, ``calls_in``,
``results_in``). With a template that speaks the format (hermes, llama3_json, mistral, mistral_v11), the
template renders everything: the tools (passed as ``tools=``, Hugging Face's convention), earlier calls
(assistant ``tool_calls`` with their arguments as objects, as templates expect) and results (``role:
"tool"``). Mistral's templates accept only ids of 9 letters and digits: other ids are turned into such ids,
the same for a call and its result (``CallFormat.template_id``). Phi-4-mini's template takes the functions
as a JSON string in the system message's ``tools`` field, and renders no calls: hydragen writes earlier
calls into the assistant's text in the format's markup, adds one sentence showing the call syntax to the
system message, and passes results as ``role: "tool"``. With a template that knows nothing of tools
(generic), hydragen writes all of it as text the template can render: the tools' description joins the
system message, earlier calls become the assistant's text in the format's markup, and results become a
user message of ``<tool_response>`` blocks (consecutive results merged, so templates that insist on
alternating roles accept them). An assistant message's ``reasoning_content`` goes to the template as it
is: templates of reasoning models read it (Qwen3's shows it for the turns after the last user message),
others ignore it.
"""

from __future__ import annotations

import json

from hydragen.errors import ParamError
from hydragen.tools.formats import CallFormat, call_syntax, generic_instructions, system_field_tools
from hydragen.tools.spec import Tool, ToolChoice


def _arguments(value, where: str) -> dict:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ParamError(where, f"{where} must be a JSON object (as a string): {e}") from None
    if not isinstance(value, dict):
        raise ParamError(where, f"{where} must be a JSON object")
    return value


def _reasoning(value, i: int) -> str:
    """An assistant message's reasoning_content, for the template (which decides whether to show it)."""
    if not isinstance(value, str):
        raise ParamError(
            f"messages[{i}].reasoning_content", f"messages[{i}].reasoning_content must be a string"
        )
    return value


def _calls(message: dict, i: int, fmt: CallFormat) -> list[dict]:
    """The assistant message's tool_calls in the template's shape (arguments as objects)."""
    calls = message.get("tool_calls") or []
    if not isinstance(calls, list):
        raise ParamError(f"messages[{i}].tool_calls", f"messages[{i}].tool_calls must be a list")
    out = []
    for j, call in enumerate(calls):
        where = f"messages[{i}].tool_calls[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if (
            not isinstance(fn, dict)
            or not isinstance(fn.get("name"), str)
            or call.get("type", "function") != "function"
        ):
            raise ParamError(
                where, f'{where} must be {{"id", "type": "function", "function": {{"name", "arguments"}}}}'
            )
        args = _arguments(fn.get("arguments", "{}"), f"{where}.function.arguments")
        out.append(
            {
                "id": fmt.template_id(call.get("id") or ""),
                "type": "function",
                "function": {"name": fn["name"], "arguments": args},
            }
        )
    return out


def template_messages(
    messages: list[dict], tools: list[Tool], choice: ToolChoice, fmt: CallFormat
) -> list[dict]:
    """``messages`` (OpenAI's chat shapes, roles and contents already checked) for the chat template."""
    out: list[dict] = []
    results: list[str] = []  # consecutive tool results (generic: merged into one user message)

    def flush_results() -> None:
        if results:
            out.append({"role": "user", "content": "\n".join(results)})
            results.clear()

    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ParamError(f"messages[{i}]", f"messages[{i}] must be an object with a string 'role'")
        if m.get("content") is not None and not isinstance(m["content"], str):
            raise ParamError(f"messages[{i}].content", f"messages[{i}].content must be a string or null")
        role, content = m["role"], m.get("content") or ""
        if role == "tool":
            if not isinstance(m.get("content"), str):
                raise ParamError(
                    f"messages[{i}].content", f"messages[{i}] (a tool result) needs a string content"
                )
            if fmt.results_in == "template":
                call_id = fmt.template_id(m.get("tool_call_id") or "")
                out.append({"role": "tool", "content": content, "tool_call_id": call_id})
            else:
                results.append(f"<tool_response>\n{content}\n</tool_response>")
            continue
        flush_results()
        calls = _calls(m, i, fmt) if role == "assistant" else []
        if not calls:
            out.append({"role": role, "content": content})
        elif fmt.calls_in == "template":
            out.append({"role": role, "content": content, "tool_calls": calls})
        else:
            written = fmt.calls_text(
                [(c["function"]["name"], json.dumps(c["function"]["arguments"])) for c in calls]
            )
            out.append({"role": role, "content": f"{content}\n{written}" if content else written})
        if role == "assistant" and m.get("reasoning_content") is not None:
            out[-1]["reasoning_content"] = _reasoning(m["reasoning_content"], i)
    flush_results()
    if tools and choice.mode != "none" and fmt.tools_in != "template":
        described = generic_instructions(tools) if fmt.tools_in == "text" else call_syntax(fmt)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{described}"}
        else:
            out.insert(0, {"role": "system", "content": described})
        if fmt.tools_in == "system":  # the template reads the functions from the system message's field
            out[0]["tools"] = system_field_tools(tools)
    return out


def template_tools(tools: list[Tool], choice: ToolChoice, fmt: CallFormat) -> list[dict] | None:
    """The ``tools=`` a template gets: the functions in OpenAI's shape, or None (tool_choice "none", or a
    template that takes them another way, or not at all)."""
    if not tools or choice.mode == "none" or fmt.tools_in != "template":
        return None
    return [t.to_openai() for t in tools]
