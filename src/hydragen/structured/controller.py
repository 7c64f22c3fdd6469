"""The engine's view of structured outputs: attach grammars to a request's sequences, mask a step's
logits, and turn each sampled token into the tokens to append (jump-forward included).

The engine calls three hooks and nothing else of this package: ``attach`` when a request is added
(a bad constraint raises ParamError there, before anything runs), ``mask`` before sampling, and
``after_sample`` for each constrained sequence's new token.

With a reasoning model (``reasoning``, a ``hydragen.reasoning.ReasoningFormat``), a constraint holds for
what follows the reasoning: each sequence's grammar is an ``AfterReasoning`` that starts where its prompt
says (``ReasoningFormat.first_phase``): after ``</think>``, or at once with ``<think>`` allowed first.
"""

from __future__ import annotations

from hydragen.errors import ParamError
from hydragen.reasoning.formats import CONTENT
from hydragen.structured.after_reasoning import AfterReasoning
from hydragen.structured.compiler import GrammarCompiler
from hydragen.structured.jump import jump_forward
from hydragen.structured.masking import BatchMasker
from hydragen.structured.matcher import GrammarState


class StructuredOutputs:
    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        eos_ids: set[int],
        jump_forward: bool = True,
        literal_json_schema: bool = False,
        reasoning=None,
    ):
        self.tokenizer = tokenizer
        self.reasoning = reasoning  # the model's ReasoningFormat: constraints start after the reasoning
        self.jump_forward = jump_forward
        # How schemas that leave additionalProperties open are read, unless a request says
        # (structured/schema_defaults.py): False generates only the named properties, as the peers do.
        self.literal_json_schema = literal_json_schema
        self.compiler = GrammarCompiler(tokenizer, vocab_size, eos_ids)
        self.masker = BatchMasker(vocab_size)

    def compile(self, constraint):
        """The compiled start state of ``constraint`` (a StructuredOutputsParams), cached. Thread-safe:
        the server calls it on a request thread first, so the engine thread only finds it cached."""
        if self.tokenizer is None:
            raise ParamError("structured_outputs", "structured outputs need a model with a tokenizer")
        return self.compiler.compile(constraint, self.literal_json_schema)

    def attach(self, params, seqs) -> None:
        """Give every sequence of a request its own grammar state (compiled once, cached)."""
        if params.structured_outputs is None:
            return
        start = self.compile(params.structured_outputs)
        r = self.reasoning
        phase = CONTENT if r is None or not seqs else r.first_phase(seqs[0].prompt_ids)
        for s in seqs:
            if phase == CONTENT:
                s.grammar = GrammarState(start.deep_copy())
            else:
                s.grammar = AfterReasoning(start.deep_copy(), r.start_id, r.end_id, phase)

    def mask(self, logits, seqs) -> None:
        """Mask the constrained rows of a decode step's logits in place (one batched op); a row still in
        its reasoning is left alone."""
        rows, extra = [], []
        for i, s in enumerate(seqs):
            g = s.grammar
            if g is not None and g.masked:
                rows.append((g.matcher, i))
                extra += [(i, t) for t in g.also_allowed]
        if rows:
            self.masker.apply(logits, rows, extra)

    def after_sample(self, s, token: int) -> list[int]:
        """The tokens to append for sampled ``token``: it (or its canonical re-split) and, with
        jump-forward on, the tokens the grammar forces after it. Raises GrammarViolation. A token of the
        reasoning is appended as it is; after the one that ends it, what the grammar forces at its start."""
        took = s.grammar.accept(token)
        if not self.jump_forward or s.grammar.done:
            return [token]
        if not took:
            forced = s.grammar.forced_tokens()  # [] unless the reasoning just ended
            if forced:
                s.grammar.accept_all(forced)
            return [token, *forced]
        return jump_forward(s.grammar, self.compiler.ll_tokenizer, self._encode, token)

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)
