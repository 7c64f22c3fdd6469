"""The engine core's parts, built from the model and one ``EngineConfig``: each piece of state gets one
owner here, and ``EngineCore`` only wires their calls.

* ``PagePool`` owns the KV tensors and page counts (in the model's KV groups);
* ``KVManager`` owns page tables, the prefix tree and every page's state;
* ``Scheduler`` owns who runs and what each step computes, and its ``Speculator`` (``spec/``) the drafts,
  each sequence's acceptance and the speculation counters;
* ``ModelRunner`` owns the model and the sampler;
* ``OutputProcessor`` owns "finished", the text and each request's report;
* ``StructuredOutputs`` owns the grammars (and knows the model's reasoning format, after which they start).

A tensor-parallel group's rank 0 (``parallel``) builds its own pool and runner, which drive the other ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

from hydragen.engine.config import EngineConfig
from hydragen.engine.model_runner import ModelRunner
from hydragen.engine.output_processor import OutputProcessor
from hydragen.engine.scheduler import Scheduler, Sharing
from hydragen.errors import ConfigError
from hydragen.kv.layout import model_kv_layout
from hydragen.kv.manager import KVManager
from hydragen.kv.pool import PagePool
from hydragen.model.linear import keeps_quantized_weights
from hydragen.model.loader import resolve_device, resolve_dtype, resolve_kv_dtype
from hydragen.reasoning.formats import resolve_reasoning
from hydragen.spec.cost import StepCost
from hydragen.spec.speculator import Speculator
from hydragen.structured.controller import StructuredOutputs

DEFAULT_KV_CACHE_TOKENS = 65536


@dataclass
class Parts:
    device: object
    pool: PagePool
    kv: KVManager
    scheduler: Scheduler
    runner: ModelRunner
    outputs: OutputProcessor
    structured: StructuredOutputs


def build_parts(model, cfg, tokenizer, config: EngineConfig, parallel, min_reads: int) -> Parts:
    """The parts for ``model`` (``cfg`` its configuration) under ``config``; a ``kv_cache_tokens`` of None
    gets a 65,536-token cache, a ``min_shared_reads`` of None ``min_reads``."""
    device = resolve_device(config.device)
    quantized = model is not None and keeps_quantized_weights(model)  # (a test's fake engine has none)
    kv_dtype = resolve_kv_dtype(config.kv_cache_dtype, resolve_dtype(config.dtype), quantized)
    page_size = config.page_size
    num_pages = max(1, (config.kv_cache_tokens or DEFAULT_KV_CACHE_TOKENS) // page_size)
    make_pool = PagePool if parallel is None else parallel.make_pool
    pool = make_pool(
        cfg.num_layers, num_pages, page_size, cfg.num_kv_heads, cfg.head_dim, kv_dtype, device,
        layout=model_kv_layout(cfg),
    )  # fmt: skip
    kv = KVManager(pool)
    make_runner = ModelRunner if parallel is None else parallel.make_runner
    runner = make_runner(model, cfg, pool, device, config.attention)
    reads = config.min_shared_reads
    scheduler = Scheduler(
        kv,
        Sharing(enabled=config.prefix_sharing, limit=config.share_limit),
        max_num_seqs=config.max_num_seqs,
        prefill_chunk=config.prefill_chunk,
        prefill_budget=config.prefill_budget,
        max_wait_steps=config.max_wait_steps,
        min_shared_reads=min_reads if reads is None else reads,
        speculator=build_speculator(config, runner),
        max_context=cfg.max_position_embeddings,
    )
    eos = set(tokenizer.eos_token_ids) if tokenizer is not None else set(cfg.eos_token_ids)
    outputs = OutputProcessor(tokenizer, eos, cfg.max_position_embeddings)
    structured = StructuredOutputs(
        tokenizer,
        cfg.vocab_size,
        eos,
        config.jump_forward,
        config.literal_json_schema,
        reasoning=resolve_reasoning(tokenizer, config.reasoning_parser),
    )
    return Parts(device, pool, kv, scheduler, runner, outputs, structured)


def build_speculator(config: EngineConfig, runner) -> Speculator | None:
    """The speculator ``config.speculative_config`` asks for, its cost rule measured on ``runner`` now."""
    spec = config.speculative_config
    if spec is None:
        return None
    if config.tensor_parallel_size > 1:
        raise ConfigError(
            "speculative_config", "speculative decoding with tensor_parallel_size > 1 is not built yet"
        )
    cost = None
    if spec.cost_rule:
        most = config.max_num_seqs * (spec.num_speculative_tokens + 1)
        cost = StepCost.measure(lambda rows, repeats: runner.time_rows(rows, repeats=repeats), most)
    return Speculator(spec, cost)
