"""Which models reason, with which tags, and where a reply starts: inside its reasoning or not.

A reasoning model (Qwen3, QwQ, the DeepSeek-R1 distills) writes ``<think> ... </think>`` before its answer.
The engine has one ``ReasoningFormat`` (or None), from ``LLM(reasoning_parser=...)`` / ``--reasoning-parser``:

- ``auto`` (the default): the chat template mentions ``</think>`` and the tokenizer has ``<think>`` and
  ``</think>`` as single tokens that decoding keeps (added, not special, as Qwen3's and the distills' are);
  its name is ``deepseek_r1`` when the template's generation prompt ends with ``<think>`` (the distills, QwQ),
  else ``qwen3``;
- ``deepseek_r1`` or ``qwen3`` (vLLM's names): those tags, whatever the template says (an error if the
  tokenizer lacks them); ``none``: no reasoning is parsed, and constraints apply from the first token.

The two names behave alike: where each reply starts is read from its own prompt (``first_phase``), which
covers both families. A prompt that opened ``<think>`` without closing it (the distills' templates put it in
the generation prompt) starts its reply inside the reasoning, which then ends at ``</think>``; a prompt that
ends with a closed block (Qwen3's ``enable_thinking=False`` renders ``<think>\\n\\n</think>\\n\\n``) starts
with the answer; any other prompt starts *opening*: the reply reasons only if its first token is ``<think>``
(Qwen3 writes it itself), else it is all answer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from hydragen.errors import ConfigError

REASONING_PARSERS = ("auto", "none", "deepseek_r1", "qwen3")
START, END = "<think>", "</think>"

# Where a reply starts: inside its reasoning; before it, which its first token opens or not; in its answer.
REASONING, OPENING, CONTENT = "reasoning", "opening", "content"
_TAIL_TOKENS = 16  # a closed block ends the prompt when at most this many whitespace tokens follow it


@dataclass(frozen=True)
class ReasoningFormat:
    name: str  # "deepseek_r1" | "qwen3"
    start: str
    end: str
    start_id: int
    end_id: int
    decode: Callable[[list[int]], str] = field(repr=False, compare=False)

    def first_phase(self, prompt_ids: list[int]) -> str:
        """Where a reply to ``prompt_ids`` starts: REASONING when the prompt opened a block and did not
        close it, CONTENT when it ends with a closed block (reasoning switched off), else OPENING."""
        last_start = _last(prompt_ids, self.start_id)
        last_end = _last(prompt_ids, self.end_id)
        if last_start > last_end:
            return REASONING
        tail = prompt_ids[last_end + 1 :]
        if last_end >= 0 and len(tail) <= _TAIL_TOKENS and not self.decode(tail).strip():
            return CONTENT
        return OPENING


def _last(ids: list[int], token: int) -> int:
    """The index of the last ``token`` in ``ids``, -1 when there is none (a search in C: prompts are long)."""
    try:
        return len(ids) - 1 - ids[::-1].index(token)
    except ValueError:
        return -1


def template_source(tokenizer) -> str:
    """The chat template's text ('' without one; of several named templates, all of them)."""
    template = getattr(getattr(tokenizer, "_tok", tokenizer), "chat_template", None) or ""
    if isinstance(template, dict):
        return "\n".join(t for t in template.values() if isinstance(t, str))
    return template if isinstance(template, str) else ""


def _single_kept_token(tokenizer, text: str) -> int | None:
    """The id of ``text`` when it is one token that decoding keeps (not dropped as special), else None."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) != 1 or tokenizer.decode(ids) != text:
        return None
    return ids[0]


def _tags(tokenizer) -> tuple[int, int] | str:
    """(start id, end id), or why the tokenizer cannot carry the tags."""
    ids = [_single_kept_token(tokenizer, tag) for tag in (START, END)]
    if None in ids:
        missing = [tag for tag, i in zip((START, END), ids, strict=True) if i is None]
        return (
            f"the tokenizer has no {' or '.join(missing)} token that decoding keeps (one added, non-special "
            "token each, as Qwen3's and the DeepSeek-R1 distills' tokenizers have)"
        )
    return ids[0], ids[1]


def _opens_in_prompt(tokenizer) -> bool:
    """Whether the template's generation prompt ends with ``<think>`` (the reply starts reasoning)."""
    try:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": "1 + 1?"}], add_generation_prompt=True
        )
    except Exception:  # noqa: BLE001  a template that wants another conversation: no opinion
        return False
    return tokenizer.decode(ids, skip_special_tokens=False).rstrip().endswith(START)


def detect_reasoning(tokenizer) -> ReasoningFormat | None:
    """The format the model's chat template and tokenizer speak, or None for a model that does not reason."""
    if tokenizer is None or END not in template_source(tokenizer):
        return None
    tags = _tags(tokenizer)
    if isinstance(tags, str):
        return None
    name = "deepseek_r1" if _opens_in_prompt(tokenizer) else "qwen3"
    return ReasoningFormat(name, START, END, tags[0], tags[1], tokenizer.decode)


def resolve_reasoning(tokenizer, name: str) -> ReasoningFormat | None:
    """``name`` ("auto", "none", "deepseek_r1", "qwen3"): the engine's format, detected for "auto"; a
    ConfigError when the tokenizer cannot carry a named format's tags."""
    if name not in REASONING_PARSERS:
        choices = ", ".join(REASONING_PARSERS)
        raise ConfigError("reasoning_parser", f"reasoning_parser must be one of {choices}, got {name!r}")
    if name == "none":
        return None
    if name == "auto":
        return detect_reasoning(tokenizer)
    if tokenizer is None:
        raise ConfigError("reasoning_parser", f"reasoning_parser {name!r} needs a model with a tokenizer")
    tags = _tags(tokenizer)
    if isinstance(tags, str):
        raise ConfigError("reasoning_parser", f"reasoning_parser {name!r}: {tags}")
    return ReasoningFormat(name, START, END, tags[0], tags[1], tokenizer.decode)
