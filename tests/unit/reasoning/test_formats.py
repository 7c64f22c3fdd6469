"""Which models reason (detected from the chat template and the tokenizer, or named), and where each reply
starts, read from its prompt."""

from __future__ import annotations

import pytest

from hydragen.engine.config import EngineConfig
from hydragen.errors import ConfigError, ParamError
from hydragen.model.tokenizer import Tokenizer, load_tokenizer
from hydragen.reasoning.formats import CONTENT, OPENING, REASONING, detect_reasoning, resolve_reasoning
from tests.helpers.tool_helpers import HERMES_TEMPLATE, byte_level_bpe, tiny_tool_model

ASK = [{"role": "user", "content": "What is 2 + 2?"}]


@pytest.fixture(scope="module")
def qwen3(reasoning_models):
    return load_tokenizer(reasoning_models["qwen3"])


@pytest.fixture(scope="module")
def r1(reasoning_models):
    return load_tokenizer(reasoning_models["r1"])


def test_detected_from_the_template_and_the_tokenizer(qwen3, r1, tmp_path):
    q, d = detect_reasoning(qwen3), detect_reasoning(r1)
    assert (q.name, q.start, q.end) == ("qwen3", "<think>", "</think>")
    assert d.name == "deepseek_r1"  # its generation prompt opens <think>
    assert qwen3.decode([q.start_id, q.end_id]) == "<think></think>"
    # A template that mentions </think> (the tiny Qwen2's renders reasoning in history), but a tokenizer
    # without the tags: not a reasoning model.
    plain = load_tokenizer(tiny_tool_model("qwen2", tmp_path / "qwen2"))
    assert "</think>" in plain._tok.chat_template
    assert detect_reasoning(plain) is None and resolve_reasoning(plain, "auto") is None
    # The tags as special tokens, which decoding drops: the text could not be split, so not detected.
    special = Tokenizer(
        byte_level_bpe(["<|im_end|>", "<think>", "</think>"], [], HERMES_TEMPLATE, eos="<|im_end|>")
    )
    assert detect_reasoning(special) is None
    # The tags, but a template that never mentions them: not detected either.
    silent = Tokenizer(
        byte_level_bpe(["<|im_end|>"], ["<think>", "</think>"], "{{ messages }}", "<|im_end|>")
    )
    assert detect_reasoning(silent) is None and resolve_reasoning(silent, "qwen3").name == "qwen3"


def test_named_parsers_and_none(qwen3, tmp_path):
    assert resolve_reasoning(qwen3, "none") is None
    assert resolve_reasoning(qwen3, "deepseek_r1").name == "deepseek_r1"
    plain = load_tokenizer(tiny_tool_model("qwen2", tmp_path / "qwen2"))
    with pytest.raises(ConfigError, match="no <think> or </think> token") as e:
        resolve_reasoning(plain, "qwen3")
    assert e.value.name == "reasoning_parser"
    with pytest.raises(ConfigError, match="reasoning_parser must be one of auto, none, deepseek_r1, qwen3"):
        EngineConfig(reasoning_parser="think")
    assert EngineConfig().reasoning_parser == "auto"


def test_where_a_reply_starts_is_read_from_its_prompt(qwen3, r1):
    q, d = detect_reasoning(qwen3), detect_reasoning(r1)
    # Qwen3 thinking: the model opens the block itself
    assert q.first_phase(qwen3.apply_chat_template(ASK)) == OPENING
    # Qwen3 with enable_thinking=False: the prompt ends with an empty, closed block
    off = qwen3.apply_chat_template(ASK, chat_template_kwargs={"enable_thinking": False})
    assert qwen3.decode(off, skip_special_tokens=False).endswith("<think>\n\n</think>\n\n")
    assert q.first_phase(off) == CONTENT
    # R1 distills: the generation prompt opens it
    assert d.first_phase(r1.apply_chat_template(ASK)) == REASONING
    # earlier reasoning in the conversation (a tool-call turn after the last user message) is closed
    history = [
        *ASK,
        {"role": "assistant", "content": "", "reasoning_content": "Use the tool.", "tool_calls": []},
        {"role": "user", "content": "Go on."},
    ]
    ids = qwen3.apply_chat_template(history[:2])
    assert "</think>" in qwen3.decode(ids, skip_special_tokens=False)
    assert q.first_phase(ids) == OPENING
    # a raw prompt
    assert q.first_phase(qwen3.encode("Once upon a time")) == OPENING
    assert q.first_phase(qwen3.encode("Q: why?\n<think>\n")) == REASONING
    assert q.first_phase(qwen3.encode("<think>a</think> and then")) == OPENING


def test_chat_template_kwargs_reach_the_template_and_cannot_set_what_the_rendering_sets(qwen3):
    on = qwen3.decode(qwen3.apply_chat_template(ASK, chat_template_kwargs={"enable_thinking": True}), False)
    assert on == qwen3.decode(qwen3.apply_chat_template(ASK), False)  # Qwen3's default: thinking on
    assert not on.endswith("</think>\n\n")
    for key in ("add_generation_prompt", "messages", "tools", "tokenize", "chat_template"):
        with pytest.raises(ParamError) as e:
            qwen3.apply_chat_template(ASK, chat_template_kwargs={key: False})
        assert e.value.param == f"chat_template_kwargs.{key}"
    for bad in ([("enable_thinking", False)], {"not a name": 1}):
        with pytest.raises(ParamError) as e:
            qwen3.apply_chat_template(ASK, chat_template_kwargs=bad)
        assert e.value.param == "chat_template_kwargs"
