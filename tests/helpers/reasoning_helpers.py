"""Tiny reasoning models whose replies a test writes: a random Qwen2 with a tokenizer that has ``<think>`` and
``</think>`` (added, non-special tokens, as Qwen3's), under a Qwen3-like chat template (the model opens its
reasoning itself; ``enable_thinking=False`` renders an empty block into the prompt; Hermes tool calls) or an
R1-distill-like one (the generation prompt opens ``<think>``, so replies carry only the closing tag). The
templates are written for these tests, in the style of those families.

``script_replies(engine, script)`` makes the engine's sampler write a reply: at each step it picks the longest
token that continues the script and that the step's mask allows (the real grammar masks run before it), and
once the reply has left the script, the best allowed token of the random model. So a reply follows the
script exactly where nothing constrains it, and a constraint shows as a departure from the script.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tests.helpers.structured_helpers import save_random_model
from tests.helpers.tool_helpers import HERMES_TEMPLATE, byte_level_bpe

_GENERATION = "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
assert HERMES_TEMPLATE.endswith(_GENERATION)
# Qwen3's switch: enable_thinking=False puts an empty reasoning block into the prompt.
QWEN3_TEMPLATE = HERMES_TEMPLATE[: -len(_GENERATION)] + (
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}"
)
# DeepSeek-R1 distills: earlier replies lose their reasoning, and the generation prompt opens it.
R1_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m.role == 'user' %}<|User|>{{ m.content }}"
    "{% elif m.role == 'assistant' %}<|Assistant|>{{ (m.content or '').split('</think>')[-1] }}<|eos|>"
    "{% else %}{{ m.content }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|Assistant|><think>\n{% endif %}"
)


def tiny_reasoning_model(kind: str, dest: Path) -> str:
    """``kind``: "qwen3" (the model opens its reasoning) or "r1" (the prompt does)."""
    if (dest / "config.json").exists():
        return str(dest)
    added = ["<think>", "</think>", "<tool_call>", "</tool_call>"]
    if kind == "qwen3":
        tok = byte_level_bpe(
            ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], added, QWEN3_TEMPLATE, "<|im_end|>"
        )
    elif kind == "r1":
        # (a Qwen2 tokenizer always has <|endoftext|>: transformers adds it on loading when it is missing)
        specials = ["<|endoftext|>", "<|User|>", "<|Assistant|>", "<|eos|>"]
        tok = byte_level_bpe(specials, added, R1_TEMPLATE, "<|eos|>")
    else:
        raise ValueError(kind)
    return save_random_model("Qwen2ForCausalLM", tok, dest, [tok.eos_token_id])


class ScriptedSampler:
    """Replaces a model runner's ``sample``: each row continues its sequence's script where the mask allows,
    else takes the best allowed token. ``script``: the reply text, or a function of the sequence giving it."""

    def __init__(self, tokenizer, vocab: int, script, eos: int):
        self.tok, self.script, self.eos = tokenizer, script, eos
        self.pieces = [tokenizer.decode([t], skip_special_tokens=False) for t in range(vocab)]
        self.steps = 0

    def __call__(self, logits: torch.Tensor, seqs, top=None):
        self.steps += 1
        out = []
        for row, s in zip(logits, seqs, strict=True):
            script = self.script(s) if callable(self.script) else self.script
            done = self.tok.decode(s.generated, skip_special_tokens=False)
            allowed = row > float("-inf")
            choice = None
            if script.startswith(done):
                rest = script[len(done) :]
                if not rest:
                    choice = self.eos if allowed[self.eos] else None
                else:
                    fits = [t for t, p in enumerate(self.pieces) if p and rest.startswith(p) and allowed[t]]
                    if fits:
                        choice = max(fits, key=lambda t: len(self.pieces[t]))
            out.append(int(row.argmax()) if choice is None else choice)
        return torch.tensor(out), None, {}


def script_replies(engine, script) -> ScriptedSampler:
    """Make ``engine``'s sampler write ``script`` (see ScriptedSampler); returns the sampler."""
    tok = engine.tokenizer
    sampler = ScriptedSampler(tok, engine.cfg.vocab_size, script, min(tok.eos_token_ids))
    engine.runner.sample = sampler
    return sampler
