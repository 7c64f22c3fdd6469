"""The workload's chats as a replica sees them: token ids and text of each turn, answers included.

The measured part of ``bench dp`` (its hit-rate ceiling) and the simulation read the same turns from here.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from hydragen.bench.dp.workload import Session, Workload


class ChatTokens:
    """Token ids and text of each turn, as the replica sees them (ChatML, the embedded model's template).
    Message blocks are encoded once each; answers are synthetic token ids, the same in every policy."""

    def __init__(
        self, workload: Workload, encode: Callable[[str], list[int]], answer_len: Callable[[int], int]
    ):
        self.w, self.encode, self.answer_len = workload, encode, answer_len
        self._system: dict[int, tuple[list[int], str]] = {}
        self.opener = encode("<|im_start|>assistant\n")
        self.closer = encode("<|im_end|>\n")

    @classmethod
    def for_model(cls, model: str | None, workload: Workload, answer_tokens: dict[str, float]) -> ChatTokens:
        """With the served model's tokenizer, and answers of the mean length a real run produced for each
        ``max_tokens`` (``answer_tokens``, keyed by its string)."""
        from hydragen.model.default_model import default_model_path
        from hydragen.model.tokenizer import load_tokenizer

        tok = load_tokenizer(model or default_model_path())
        means = {int(k): v for k, v in answer_tokens.items()}
        return cls(
            workload,
            lambda text: tok.encode(text, add_special_tokens=False),
            lambda max_tokens: max(1, round(means.get(max_tokens, max_tokens))),
        )

    def _block(self, role: str, content: str) -> tuple[list[int], str]:
        text = f"<|im_start|>{role}\n{content}<|im_end|>\n"
        return self.encode(text), text

    def answer(self, session: Session, turn: int) -> tuple[list[int], str]:
        rng = random.Random(session.index * 1009 + turn)
        ids = [rng.randrange(1000, 40000) for _ in range(self.answer_len(session.turns[turn].max_tokens))]
        return ids, " ".join(f"w{i}" for i in ids)

    def turn(self, session: Session, turn: int) -> tuple[list[int], str]:
        if session.tenant not in self._system:
            self._system[session.tenant] = self._block("system", self.w.tenants[session.tenant].system_prompt)
        ids, text = list(self._system[session.tenant][0]), self._system[session.tenant][1]
        for k in range(turn + 1):
            q_ids, q_text = self._block("user", session.turns[k].question)
            ids += q_ids + self.opener
            text += q_text + "<|im_start|>assistant\n"
            if k < turn:
                a_ids, a_text = self.answer(session, k)
                ids += a_ids + self.closer
                text += a_text + "<|im_end|>\n"
        return ids, text
