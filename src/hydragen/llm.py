"""The offline entry point: ``LLM(...).generate(prompts, SamplingParams(...))``, vLLM-style."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from tqdm.auto import tqdm

from hydragen.engine.config import EngineConfig
from hydragen.engine.engine import EngineCore
from hydragen.engine.loop import StepLoop
from hydragen.engine.outputs import RequestOutput
from hydragen.engine.sampling_params import SamplingParams
from hydragen.errors import EngineBroken
from hydragen.model.generation_defaults import GenerationDefaults, read_generation_defaults
from hydragen.model.linear import keeps_quantized_weights
from hydragen.model.loader import DTYPES, load_model, resolve_device, resolve_dtype, resolve_kv_dtype

PromptType = str | list[int]


def thread_governor(threads, device: torch.device, tensor_parallel_size: int = 1):
    """The engine's thread governor for ``LLM(threads=...)`` (None: leave torch's thread count alone)."""
    from hydragen.cpu_threads import ThreadGovernor

    if threads is None or device.type != "cpu" or tensor_parallel_size > 1:
        return None  # tensor-parallel ranks get their share of the cores from the launcher
    return ThreadGovernor() if threads == "auto" else ThreadGovernor(threads)  # checked by EngineConfig


def default_kv_cache_tokens(
    bytes_per_token: int, device: torch.device, max_tokens_useful: int, share: int = 1
) -> int:
    """A quarter of free memory (RAM on CPU, VRAM on GPU), never more than the engine could use; with
    ``share`` engines on the machine (data-parallel replicas), each gets its part of that quarter."""
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
    else:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return max(1024, min(int(free * 0.25 / share) // bytes_per_token, max_tokens_useful))


class LLM:
    """Load a Llama-family model and generate with shared-prefix attention over a radix-tree KV cache.

    ``prefix_sharing=False`` runs the same engine with every sequence holding a private copy of its whole
    KV (the no-sharing baseline); ``attention="none"`` skips attention (a throughput ceiling for
    benchmarks, its text is meaningless); ``attention="torch"`` uses the plain reference kernels;
    ``attention="triton"`` decodes with the Triton kernels (opt-in: not yet measured on a GPU).
    ``min_shared_reads`` is the cost rule's threshold: pages shared by h running sequences are read
    by one batched call only if (h - 1) x (tokens - 16) reaches it (the KV reads saved per step, less
    the merge); otherwise each sequence reads them itself, in place: shared pages are never copied
    (0: one batched call for everything held by two sequences). ``page_size`` is the KV allocation unit
    in tokens (16 by default); only whole pages are shared and cached.
    ``random_weights=True`` builds the model named by ``model`` (a preset such as "codellama-7b", a
    config.json or a model directory) with random weights: for throughput benchmarks without downloads;
    "llama-3.1-8b:Q4_K_M" (a preset and a quantization) writes such a model once as a GGUF file of that
    quantization (cached) and loads it like a downloaded one.
    GGUF weights stay in their quantized format on CPU, and 16-bit checkpoints stay 16-bit when the model
    runs in float32 (docs/quantization.md); ``dequantize=True`` converts them to ``dtype`` at load instead
    (several times the memory: the reference the quantized kernels are measured against).
    ``tensor_parallel_size=N`` splits the model over N processes (``hydragen.tp``): this one is
    rank 0 and starts the others itself, or joins the ranks torchrun started; ``close()`` (or leaving a
    ``with`` block, or the end of the program) stops them.
    ``jump_forward`` (structured outputs): append the text a grammar forces, computed in one forward,
    instead of sampling it token by token (False: plain constrained decoding, for measurement).
    ``threads``: torch's CPU threads. None leaves torch's setting alone; ``"auto"`` (what the CLI uses)
    takes the cores other programs leave free and re-checks every few seconds (``cpu_threads.py``); an
    integer fixes the count.
    ``literal_json_schema`` (structured outputs, tool arguments): read a schema object that does not say
    ``additionalProperties`` as JSON Schema does (any extra keys) instead of as the peers do (only the
    properties it names, the default); a request's ``StructuredOutputsParams`` can say otherwise.
    ``tool_format`` (tool calling): "hermes", "llama3_json" or "generic"; None detects it from the chat
    template (hydragen.tools.formats).
    ``generation_config``: "auto" takes the model's own sampling defaults (its generation_config.json or
    GGUF metadata: temperature, top_p, top_k, min_p) for calls that pass no SamplingParams, as vLLM does
    (``get_default_sampling_params``); "hydragen" keeps SamplingParams' defaults.
    """

    def __init__(
        self,
        model: str | Path | None = None,
        device: str = "cpu",
        dtype: str = "float32",
        prefix_sharing: bool = True,
        attention: str = "auto",
        kv_cache_tokens: int | None = None,
        max_num_seqs: int = 256,
        random_weights: bool = False,
        min_shared_reads: int | None = None,
        page_size: int = 16,
        tensor_parallel_size: int = 1,
        jump_forward: bool = True,
        dequantize: bool = False,
        threads: int | str | None = None,
        literal_json_schema: bool = False,
        tool_format: str | None = None,
        kv_cache_dtype: str = "auto",
        generation_config: str = "auto",
        **engine_options,
    ):
        """The keyword arguments, and ``engine_options`` (``prefill_chunk``, ``prefill_budget``,
        ``max_wait_steps``, ``share_limit``), are the fields of ``EngineConfig`` (engine/config.py), checked
        there; ``engine_config`` holds them (``config`` is the model's configuration)."""
        options = dict(
            model=model, device=str(device), dtype=_dtype_name(dtype), prefix_sharing=prefix_sharing,
            attention=attention, kv_cache_tokens=kv_cache_tokens, max_num_seqs=max_num_seqs,
            random_weights=random_weights, min_shared_reads=min_shared_reads, page_size=page_size,
            tensor_parallel_size=tensor_parallel_size, jump_forward=jump_forward, dequantize=dequantize,
            threads=threads, literal_json_schema=literal_json_schema, tool_format=tool_format,
            kv_cache_dtype=kv_cache_dtype, generation_config=generation_config, **engine_options,
        )  # fmt: skip
        self.engine_config = config = EngineConfig.from_options(**options)
        dev, dt = resolve_device(config.device), resolve_dtype(config.dtype)
        self.tool_format = config.tool_format  # resolved below, once the tokenizer is loaded
        governor = thread_governor(config.threads, dev, config.tensor_parallel_size)  # measures the load
        self.parallel = None
        if config.tensor_parallel_size > 1:
            from hydragen.tp.launcher import start

            self.parallel = start(
                config.model, config.tensor_parallel_size, dev, dt, config.attention, config.random_weights,
                config.dequantize,
            )  # fmt: skip
            self.model, self.config = self.parallel.model, self.parallel.config
            self.model_path = self.parallel.model_path
        else:
            self.model, self.config, self.model_path = load_model(
                config.model, dev, dt, config.random_weights, config.dequantize
            )
        try:
            self._start_engine(dev, dt)
        except BaseException:
            self.close()
            raise
        if governor is not None:
            governor.check(force=True)  # the other load seen while loading decides the first count
        self.engine.threads = governor
        self.generation_defaults = GenerationDefaults({})
        if config.generation_config == "auto":
            self.generation_defaults = read_generation_defaults(self.model_path)
            if self.generation_defaults:
                print(self.generation_defaults.describe(), file=sys.stderr)

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's own defaults (``generation_config="auto"``), what ``generate``
        and ``chat`` use when given none (vLLM's method of the same name)."""
        return SamplingParams(**self.generation_defaults.values)

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLM:
        """An LLM with exactly ``config``'s settings (the CLI builds its config from the flags)."""
        return cls(**config.options())

    def _start_engine(self, dev: torch.device, dt: torch.dtype) -> None:
        """The tokenizer, the KV budget and the engine."""
        from hydragen.model.tokenizer import has_tokenizer_files

        # A directory without tokenizer files still runs on token-id prompts (texts are then empty).
        if has_tokenizer_files(self.model_path):
            from hydragen.model.tokenizer import load_tokenizer
            from hydragen.tools.formats import resolve_format

            self.tokenizer = load_tokenizer(self.model_path)
            self.tool_format = resolve_format(self.tokenizer, self.tool_format)  # how tool calls are written
        else:
            self.tokenizer = None
        c, config = self.config, self.engine_config
        kv_dtype = resolve_kv_dtype(config.kv_cache_dtype, dt, keeps_quantized_weights(self.model))
        if config.kv_cache_tokens is None:
            bytes_per_token = c.kv_bytes_per_token_per_elem * torch.finfo(kv_dtype).bits // 8
            useful = config.max_num_seqs * c.max_position_embeddings
            config = self.engine_config = config.replace(
                kv_cache_tokens=default_kv_cache_tokens(bytes_per_token, dev, useful)
            )
        self.engine = EngineCore(self.model, c, self.tokenizer, config, parallel=self.parallel)
        self.loop = StepLoop(self.engine)

    def close(self) -> None:
        """Stop the tensor-parallel workers (nothing to do with tensor_parallel_size=1); generating after
        closing a tensor-parallel LLM raises, as it does once its group broke (a worker died or hung): such
        an LLM is done, and a new one starts a new group."""
        if self.parallel is not None:
            self.parallel.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- prompts ------------------------------------------------------------------------------
    def _normalise(self, prompts) -> list[tuple[str | None, list[int]]]:
        if isinstance(prompts, str):
            prompts = [prompts]
        elif isinstance(prompts, Sequence) and prompts and all(isinstance(t, int) for t in prompts):
            prompts = [list(prompts)]
        if not isinstance(prompts, Sequence) or isinstance(prompts, (bytes, bytearray)) or len(prompts) == 0:
            raise ValueError("prompts must be a non-empty str, list[str], list[int] or list[list[int]]")
        out = []
        for i, p in enumerate(prompts):
            if isinstance(p, str):
                if self.tokenizer is None:
                    raise ValueError("this model has no tokenizer files: pass prompts as token ids")
                out.append((p, self.tokenizer.encode(p)))
            elif isinstance(p, Sequence) and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
                out.append((None, list(p)))
            else:
                raise ValueError(
                    f"prompt {i} must be a string or a list of token ids, got {type(p).__name__}"
                )
            if not out[-1][1]:
                raise ValueError(f"prompt {i} is empty")
        return out

    def generate(
        self,
        prompts,
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order. Sharing between prompts is discovered from token ids."""
        items = self._normalise(prompts)
        return self._run(items, sampling_params, use_tqdm)

    def chat(
        self,
        messages,
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        tool_choice: str | dict | None = None,
        parallel_tool_calls: bool = True,
    ) -> list[RequestOutput]:
        """``messages``: one conversation (list of {"role", "content"}) or a list of conversations.

        ``tools`` (OpenAI's function definitions), ``tool_choice`` ("auto" by default, "none", "required"
        or {"type": "function", "function": {"name": ...}}) and ``parallel_tool_calls`` as in OpenAI's
        API; conversations may hold assistant ``tool_calls`` and ``role: "tool"`` results. Each output then
        carries ``tool_calls`` (hydragen.tools.ToolCall, [] when the reply is text) and ``content`` (the text
        outside the calls), read by the call's ToolSession (hydragen.tools.session), as the server's."""
        if isinstance(messages, Sequence) and messages and isinstance(messages[0], dict):
            messages = [messages]
        if not isinstance(messages, Sequence) or not messages:
            raise ValueError("messages must be a conversation (list of dicts) or a non-empty list of them")
        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer with a chat template; this model has no tokenizer files")
        session = self._tool_session(tools, tool_choice, parallel_tool_calls, messages)
        items = []
        for conv in messages:
            if session is not None:
                ids = session.prompt_ids(self.tokenizer, list(conv))
            else:
                ids = self.tokenizer.apply_chat_template(
                    list(conv), add_generation_prompt=add_generation_prompt
                )
            items.append((self.tokenizer.decode(ids, skip_special_tokens=False), ids))
        if session is None:
            return self._run(items, sampling_params, use_tqdm)
        structured = self.engine.structured
        constraint = session.constraint(structured.compiler.ll_tokenizer, structured.literal_json_schema)
        outs = self._run(items, session.sampling_params(sampling_params, constraint), use_tqdm)
        for out in outs:
            for c in out.outputs:
                c.content, c.tool_calls, _ = session.reply(c.text, c.finish_reason)
        return outs

    def _tool_session(self, tools, tool_choice, parallel_tool_calls, conversations):
        """The ToolSession of a chat call (None without tools); conversations holding earlier calls or
        results get one too, so those are rendered."""
        from hydragen.tools.session import ToolSession

        history = any(m.get("role") == "tool" or m.get("tool_calls") for c in conversations for m in c)
        return ToolSession.open(tools, tool_choice, parallel_tool_calls, self.tool_format, history)

    def reset_prefix_cache(self) -> None:
        """Drop every cached prefix that no running sequence holds (as vLLM's reset_prefix_cache)."""
        self.engine.reset_prefix_cache()

    def _run(self, items, sampling_params, use_tqdm: bool) -> list[RequestOutput]:
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(items)
        if len(params) != len(items):
            raise ValueError(f"got {len(params)} SamplingParams for {len(items)} prompts")
        loop, engine = self.loop, self.engine
        reqs = []
        try:
            for (text, ids), p in zip(items, params, strict=True):
                reqs.append(loop.add(ids, p, prompt=text))
        except (ValueError, TypeError) as e:
            for r in reqs:  # all or nothing: no half-added batch left behind in the engine
                loop.abort(r.request_id)
            if len(items) > 1 and isinstance(e, ValueError):
                e.args = (f"prompt {len(reqs)}: {e}",)
            raise
        bar = tqdm(total=len(reqs), desc="generate", unit="req", disable=not use_tqdm, dynamic_ncols=True)
        start, generated0 = time.perf_counter(), engine.stats.generated_tokens

        def progress() -> None:
            done = sum(r.finished for r in reqs)
            bar.update(done - bar.n)
            rate = (engine.stats.generated_tokens - generated0) / max(time.perf_counter() - start, 1e-9)
            bar.set_postfix_str(f"{rate:.1f} tok/s", refresh=False)

        try:
            results = loop.run(reqs, on_step=progress if use_tqdm else None)
        except EngineBroken as e:
            if self.parallel is None:
                raise
            raise type(e)(  # the group cannot be mended in place: its processes are gone or out of step
                f"{e}. This LLM cannot generate again: close it and create a new LLM"
            ) from e
        finally:
            bar.close()
        errors = [r.error for r in results if r is not None and r.error]
        if errors:
            raise RuntimeError(f"{len(errors)} request(s) failed: {errors[0]}")
        return results  # type: ignore[return-value]


def _dtype_name(dtype) -> object:
    """A torch dtype the loader knows, by its name (``LLM(dtype=torch.float16)`` works as before)."""
    for name, known in DTYPES.items():
        if dtype is known:
            return name
    return dtype
