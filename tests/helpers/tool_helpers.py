"""Tiny random models with real tokenizers and tool-calling chat templates, built in the test run (no
downloads): a Qwen2 with a Hermes-style template (``<tool_call>`` JSON, added non-special marker tokens,
as Qwen2.5 has them), a Llama with a Llama-3.x-style template (bare JSON calls, header special tokens)
and a Llama whose SentencePiece-style tokenizer adds a dummy-prefix space (Llama-2 / Mistral v0.1), with
a template that knows nothing of tools; and three for the formats of issue 41: a SentencePiece Mistral
v0.3 (``[TOOL_CALLS] [...]``), a byte-level "tekken" Mistral with a Small-3.2-style template
(``[TOOL_CALLS]f[CALL_ID]id[ARGS]{...}``) and a Phi-4-mini (tools in the system message's ``tools``
field). Their control tokens are *special*, as in the real tokenizers, so a decode that skips special
tokens loses Mistral's markers. The templates are written for these tests, in the style of those
families (what matters for tools is theirs: markers, spacing, the id checks); their weights are random, so
what the models say is noise, but every token boundary is real.
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.helpers.structured_helpers import save_random_model

# Text the byte-level tokenizers are trained on: tool calls, JSON and some prose, so merges such as
# `", "`, `"name"` and `{"` exist and jump-forward meets real token boundaries.
_CORPUS = [
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}',
    '{"name": "search", "parameters": {"query": "owls", "limit": 3}}',
    '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>',
    '{"title": "Blue Hour", "year": 1999, "tags": ["drama", "night"], "ok": true, "note": null}',
    "The weather in Paris is mild today, and the owls are quiet at night.",
    "You may call functions. Answer with a JSON object, or answer the question in plain words.",
    "What is the capital of France? It is Paris. What time is it in Tokyo? Let me check.",
]

# Hermes-style, as Qwen2.5 / Qwen3 (with Qwen3's rendering of an assistant message's reasoning_content).
HERMES_TEMPLATE = (
    "{% set sys = messages[0].content if messages[0].role == 'system' else '' %}"
    "{% set ns = namespace(last_user=-1) %}"
    "{% for m in messages %}{% if m.role == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}"
    "{% endfor %}"
    "{% if tools %}<|im_start|>system\n{% if sys %}{{ sys }}\n\n{% endif %}"
    "You may call functions. Their signatures, one per line:\n<tools>\n"
    "{% for t in tools %}{{ t | tojson }}\n{% endfor %}</tools>\n"
    'To call one, write <tool_call>\n{"name": <name>, "arguments": <object>}\n</tool_call><|im_end|>\n'
    "{% elif sys %}<|im_start|>system\n{{ sys }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'system' %}"
    "{% elif m.role == 'assistant' %}<|im_start|>assistant\n"
    # reasoning as Qwen3's template shows it: for the assistant turns after the last user message
    "{% if m.reasoning_content is string and loop.index0 > ns.last_user %}"
    "<think>\n{{ m.reasoning_content }}\n</think>\n\n{% endif %}{{ m.content or '' }}"
    "{% for c in m.tool_calls or [] %}{% if not loop.first or m.content %}{{ '\\n' }}{% endif %}"
    '<tool_call>\n{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}'
    "\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response>"
    "<|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

LLAMA3_TEMPLATE = (
    "<|begin_of_text|>"
    "{% set sys = messages[0].content if messages[0].role == 'system' else '' %}"
    "<|start_header_id|>system<|end_header_id|>\n\n{{ sys }}"
    "{% if tools %}{{ '\\n\\n' }}To call a function, answer with only a JSON object "
    '{"name": function name, "parameters": argument object}. The functions:\n'
    "{% for t in tools %}{{ t | tojson }}\n{% endfor %}{% endif %}<|eot_id|>"
    "{% for m in messages %}"
    "{% if m.role == 'system' %}"
    "{% elif m.role == 'assistant' and m.tool_calls %}<|start_header_id|>assistant<|end_header_id|>\n\n"
    "{% for c in m.tool_calls %}{% if not loop.first %}; {% endif %}"
    '{"name": "{{ c.function.name }}", "parameters": {{ c.function.arguments | tojson }}}'
    "{% endfor %}<|eom_id|>"
    "{% elif m.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>\n\n{{ m.content }}<|eot_id|>"
    "{% else %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n{{ m.content }}<|eot_id|>"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)

# Llama-2 style, no tools: hydragen renders tools itself for such templates (the generic format).
INST_TEMPLATE = (
    "{% for m in messages %}{% if m.role == 'user' %}<s>[INST] {{ m.content }} [/INST]"
    "{% elif m.role == 'system' %}<<SYS>>{{ m.content }}<</SYS>>"
    "{% else %} {{ m.content }}</s>{% endif %}{% endfor %}"
)


# Mistral 7B v0.3 style (SentencePiece, so "[TOOL_CALLS] [" with a space): the tools before the last user
# message, the system message with the last user message, each earlier call's JSON with its id, results
# as {"content": ..., "call_id": ...}; ids that are not 9 characters are refused, as the real template does.
_ID_CHECK = (
    "{% if {x} is not string or {x} | length != 9 %}"
    "{{ raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{% endif %}"
)
MISTRAL_V03_TEMPLATE = (
    "{% if messages[0].role == 'system' %}{% set sys = messages[0].content %}"
    "{% set loop_messages = messages[1:] %}{% else %}{% set sys = none %}"
    "{% set loop_messages = messages %}{% endif %}"
    "{% set users = loop_messages | selectattr('role', 'equalto', 'user') | list %}"
    "{{ bos_token }}"
    "{% for m in loop_messages %}"
    "{% if m.role == 'user' %}"
    "{% if tools and m == users[-1] %}[AVAILABLE_TOOLS] [{% for t in tools %}{{ t | tojson }}"
    "{% if not loop.last %}, {% endif %}{% endfor %}][/AVAILABLE_TOOLS]{% endif %}"
    "[INST] {% if sys is not none and m == users[-1] %}{{ sys }}\n\n{% endif %}{{ m.content }}[/INST]"
    "{% elif m.tool_calls %}[TOOL_CALLS] [{% for c in m.tool_calls %}"
    + _ID_CHECK.replace("{x}", "c.id")
    + '{{ (c.function | tojson)[:-1] }}, "id": "{{ c.id }}"}{% if not loop.last %}, {% endif %}'
    "{% endfor %}]{{ eos_token }}"
    "{% elif m.role == 'assistant' %} {{ m.content | trim }}{{ eos_token }}"
    "{% elif m.role == 'tool' %}"
    + _ID_CHECK.replace("{x}", "m.tool_call_id")
    + '[TOOL_RESULTS] {"content": {{ m.content }}, "call_id": "{{ m.tool_call_id }}"}[/TOOL_RESULTS]'
    "{% endif %}{% endfor %}"
)

# Mistral Small 3.2 style (tekken v11: no dummy prefix): calls as [TOOL_CALLS]f[CALL_ID]id[ARGS]{...}, one
# after the other, results as [TOOL_RESULTS]id[TOOL_CONTENT]...[/TOOL_RESULTS], 9-character ids checked.
MISTRAL_V11_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages[0].role == 'system' %}[SYSTEM_PROMPT]{{ messages[0].content }}[/SYSTEM_PROMPT]{% endif %}"
    "{% set users = messages | selectattr('role', 'equalto', 'user') | list %}"
    "{% for m in messages %}"
    "{% if m.role == 'user' %}"
    "{% if tools and m == users[-1] %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
    "[INST]{{ m.content }}[/INST]"
    "{% elif m.role == 'assistant' and m.tool_calls %}{% for c in m.tool_calls %}"
    + _ID_CHECK.replace("{x}", "c.id")
    + "[TOOL_CALLS]{{ c.function.name }}[CALL_ID]{{ c.id }}[ARGS]{{ c.function.arguments | tojson }}"
    "{% endfor %}{{ eos_token }}"
    "{% elif m.role == 'assistant' %}{{ m.content }}{{ eos_token }}"
    "{% elif m.role == 'tool' %}"
    + _ID_CHECK.replace("{x}", "m.tool_call_id")
    + "[TOOL_RESULTS]{{ m.tool_call_id }}[TOOL_CONTENT]{{ m.content }}[/TOOL_RESULTS]"
    "{% endif %}{% endfor %}"
)

# Phi-4-mini-instruct's: the functions only as a JSON string in a system message's "tools" field, between
# <|tool|> and <|/tool|>; every other message (tool results too) as <|role|>content<|end|>, nothing of calls.
PHI4_MINI_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'system' and 'tools' in m and m['tools'] is not none %}"
    "{{ '<|system|>' + m['content'] + '<|tool|>' + m['tools'] + '<|/tool|>' + '<|end|>' }}"
    "{% else %}{{ '<|' + m['role'] + '|>' + m['content'] + '<|end|>' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% else %}{{ eos_token }}{% endif %}"
)

MISTRAL_CONTROLS = ["[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]"]
MISTRAL_CONTROLS += ["[TOOL_RESULTS]", "[/TOOL_RESULTS]"]
TEKKEN_CONTROLS = ["<s>", "</s>", *MISTRAL_CONTROLS, "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[ARGS]"]
TEKKEN_CONTROLS += ["[CALL_ID]", "[TOOL_CONTENT]"]
PHI4_SPECIALS = ["<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>", "<|tool|>"]
PHI4_SPECIALS += ["<|/tool|>", "<|tool_call|>", "<|/tool_call|>", "<|tool_response|>"]
# more training text for their BPEs, so their call syntax has merges
_CALL_CORPUS = [
    '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "c"}[TOOL_CALLS]add[ARGS]{"a": 1, "b": 2}',
    'functools[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "add", "arguments": {}}]',
]


def byte_level_bpe(
    specials: list[str], added: list[str], template: str, eos: str, vocab: int = 700, corpus: list[str] = ()
):
    """A byte-level BPE (GPT-2 / Qwen2 / Llama-3 style) trained on ``_CORPUS`` and ``corpus``; ``specials``
    are special tokens, ``added`` are added tokens that are not special (their text stays in decoded
    output)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator([*_CORPUS, *corpus] * 4, trainer)
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    tok.add_tokens([AddedToken(a, special=False, normalized=False) for a in added])
    return PreTrainedTokenizerFast(tokenizer_object=tok, chat_template=template, eos_token=eos)


def sentencepiece_bpe(template: str, specials: list[str] = ()):
    """A Llama-2-style tokenizer: the normalizer prepends the dummy-prefix "▁" and turns spaces into "▁",
    BPE with byte fallback (<0x00>..<0xFF>), and the decoder strips the leading space again. Its merges
    include `▁"`, so `",` encodes as `▁"` `,`: one space more than the text. ``specials``: control tokens
    (special, as Mistral's [INST] and [TOOL_CALLS]); with them, text is split at them and each piece gets
    the dummy prefix only at the start of the text (a Metaspace pre-tokenizer, prepend scheme "first")."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for ch in "▁" + "".join(chr(c) for c in range(33, 127)):
        vocab.setdefault(ch, len(vocab))
    merges = []
    pieces = ['▁"', '",', '":', '{"', '"}', "▁{", "na", "name", "ar", "arg", "▁t", "▁th", "▁the", "er", "es"]
    pieces += ["▁[", "▁[{"] if specials else []
    for word in pieces:
        left = word[0]
        for ch in word[1:]:
            merges.append((left, ch))
            left += ch
            vocab.setdefault(left, len(vocab))
    bpe = models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True)
    tok = Tokenizer(bpe)
    if specials:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
        tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    else:
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, chat_template=template, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def tiny_tool_tokenizer(kind: str):
    """The Hugging Face tokenizer of ``tiny_tool_model(kind)`` (only the new formats' kinds)."""
    if kind == "mistral":
        return sentencepiece_bpe(MISTRAL_V03_TEMPLATE, MISTRAL_CONTROLS)
    if kind == "mistral_v11":
        tok = byte_level_bpe(TEKKEN_CONTROLS, [], MISTRAL_V11_TEMPLATE, eos="</s>", corpus=_CALL_CORPUS)
        tok.bos_token = "<s>"
        return tok
    if kind == "phi4":
        return byte_level_bpe(PHI4_SPECIALS, [], PHI4_MINI_TEMPLATE, eos="<|end|>", corpus=_CALL_CORPUS)
    raise ValueError(kind)


def tiny_tool_model(kind: str, dest: Path) -> str:
    """``kind``: "qwen2" (Hermes-style template), "llama3" (Llama-3.x-style template), "llama_sp"
    (SentencePiece tokenizer with a dummy prefix, a template without tools), "mistral" (Mistral v0.3
    style), "mistral_v11" (Mistral Small 3.2 style) or "phi4" (Phi-4-mini style)."""
    if (dest / "config.json").exists():
        return str(dest)
    if kind in ("mistral", "mistral_v11", "phi4"):
        tok = tiny_tool_tokenizer(kind)
        eos = [tok.eos_token_id]
        if kind == "phi4":
            eos.append(tok.convert_tokens_to_ids("<|endoftext|>"))
        return save_random_model("LlamaForCausalLM", tok, dest, eos)
    if kind == "qwen2":
        tok = byte_level_bpe(
            ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
            ["<tool_call>", "</tool_call>"],
            HERMES_TEMPLATE,
            eos="<|im_end|>",
        )
        return save_random_model("Qwen2ForCausalLM", tok, dest, [tok.eos_token_id])
    if kind == "llama3":
        specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>"]
        specials += ["<|eot_id|>", "<|eom_id|>", "<|python_tag|>"]
        tok = byte_level_bpe(specials, [], LLAMA3_TEMPLATE, eos="<|eot_id|>")
        tok.bos_token = "<|begin_of_text|>"
        eom = tok.convert_tokens_to_ids("<|eom_id|>")
        return save_random_model("LlamaForCausalLM", tok, dest, [tok.eos_token_id, eom])
    if kind == "llama_sp":
        tok = sentencepiece_bpe(INST_TEMPLATE)
        return save_random_model("LlamaForCausalLM", tok, dest, [tok.eos_token_id])
    raise ValueError(kind)


def tool_json(name: str, properties: dict, required: list[str] | None = None, description: str = "") -> dict:
    """An OpenAI tool definition."""
    params = {"type": "object", "properties": properties, "required": required or list(properties)}
    return {"type": "function", "function": {"name": name, "description": description, "parameters": params}}


def dumps(value) -> str:
    return json.dumps(value)


def arguments_parse(arguments: str) -> bool:
    """Whether a call's ``arguments`` text is JSON (a call cut by max_tokens has text that is not)."""
    try:
        json.loads(arguments)
    except json.JSONDecodeError:
        return False
    return True
