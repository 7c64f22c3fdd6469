"""Grammar compilation with llguidance, cached across requests.

llguidance was chosen over XGrammar by measurement (docs/structured_outputs.md): on this project's
schema set with the SmolLM2 tokenizer it compiled 30-85x faster and computed masks 1.7-2.6x faster in
the mean and 2.5-18x at p99 (two runs on a shared machine), with the same coverage. Its tokenizer view
costs 0.5-1.3 s to build, so it is built once per engine, on the first structured request. A compiled
grammar is a matcher in its start state; every sequence gets a deep copy, which shares the compiled
lexer and parser tables.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict

from hydragen.errors import ParamError
from hydragen.structured.params import JSON_DEFAULTS, GrammarSource, StructuredOutputsParams
from hydragen.structured.schema_defaults import explain

CACHE_ENTRIES = 256


class GrammarCompiler:
    def __init__(self, tokenizer, vocab_size: int, eos_ids: set[int]):
        self.tokenizer, self.vocab_size, self.eos_ids = tokenizer, vocab_size, eos_ids
        self._ll_tokenizer = None
        self._cache: OrderedDict[GrammarSource, object] = OrderedDict()
        self.compile_seconds: dict[GrammarSource, float] = {}  # per source, first (uncached) compile
        # Compiles run on request threads (the server compiles before a request reaches the engine
        # thread) as well as on the engine thread: the locks guard the cache and the tokenizer view,
        # never a compile itself, so a slow compile holds up nobody else.
        self._lock = threading.Lock()
        self._view_lock = threading.Lock()

    @property
    def ll_tokenizer(self):
        if self._ll_tokenizer is None:
            with self._view_lock:
                if self._ll_tokenizer is None:
                    self._ll_tokenizer = self._build_tokenizer()
        return self._ll_tokenizer

    def _build_tokenizer(self):
        import llguidance.hf

        hf = getattr(self.tokenizer, "_tok", self.tokenizer)
        if len(hf) > self.vocab_size:
            raise ParamError(
                "structured_outputs",
                f"the tokenizer has {len(hf)} tokens but the model only {self.vocab_size}: "
                "structured outputs need every token to have a logit",
            )
        eos = sorted(self.eos_ids) or None
        return llguidance.hf.from_tokenizer(hf, n_vocab=self.vocab_size, eos_token=eos)

    def compile(self, params: StructuredOutputsParams, literal_json_schema: bool = False):
        """The start-state matcher for ``params`` (cached); ParamError naming the problem if it is bad.
        ``literal_json_schema``: the engine's setting, for params that leave it None."""
        source = params.source(literal_json_schema)
        with self._lock:
            hit = self._cache.get(source)
            if hit is not None:
                self._cache.move_to_end(source)
                return hit
        import llguidance

        t0 = time.perf_counter()
        matcher = self._build(llguidance, source)
        if matcher.is_error():
            why = explain(matcher.get_error(), params.json if params.kind == "json" else None)
            raise ParamError("structured_outputs", f"cannot compile the {params.kind} constraint: {why}")
        # llguidance builds its lexer lazily; the first mask builds the start state's part, which every
        # copy of this matcher then shares. Build it here, off the engine's decode path.
        matcher.deep_copy().compute_bitmask()
        with self._lock:
            self.compile_seconds[source] = time.perf_counter() - t0
            self._cache[source] = matcher
            if len(self._cache) > CACHE_ENTRIES:
                self._cache.popitem(last=False)
        return matcher

    def _build(self, llguidance, source: GrammarSource):
        LLMatcher = llguidance.LLMatcher  # noqa: N806
        try:
            if source.kind == "json_schema":
                grammar = LLMatcher.grammar_from_json_schema(source.text, defaults=JSON_DEFAULTS)
            elif source.kind == "regex":
                grammar = LLMatcher.grammar_from_regex(source.text)
            else:
                from llguidance.gbnf_to_lark import any_to_lark

                # GBNF (llama.cpp's format, rules written with ::=) is converted; Lark passes through.
                grammar = LLMatcher.grammar_from_lark(any_to_lark(source.text))
        except Exception as e:  # noqa: BLE001  any failure to convert is the request's problem
            raise ParamError("structured_outputs", f"cannot compile the constraint: {e}") from None
        return LLMatcher(self.ll_tokenizer, grammar, log_level=0)

    def matcher_for(self, params: StructuredOutputsParams, literal_json_schema: bool = False):
        """A fresh matcher for one sequence."""
        return self.compile(params, literal_json_schema).deep_copy()
