"""Command line: ``hydragen generate``, ``hydragen chat``, ``hydragen serve``, ``hydragen bench``."""

from __future__ import annotations

import argparse
import copy
import dataclasses
import re
import sys
import time
from pathlib import Path

# SamplingParams field -> the flag that sets it, so a bad value is reported as the user typed it.
SAMPLING_FLAGS = {
    "n": "-n",
    "temperature": "--temperature",
    "top_p": "--top-p",
    "top_k": "--top-k",
    "max_tokens": "--max-tokens",
    "stop": "--stop",
    "seed": "--seed",
}


class UsageError(Exception):
    """A bad command line value, reported as ``error: ...`` with exit code 2 (as argparse does)."""


def flag_named(message: str) -> str:
    """Rewrite a SamplingParams error so it names the CLI flag (``--top-p``, not ``SamplingParams.top_p``)."""
    for field, flag in SAMPLING_FLAGS.items():
        message = re.sub(rf"(?:\bSamplingParams\.|^){field}\b", flag, message)
    return message


def _sampling_params(args: argparse.Namespace, **fields):
    from hydragen import SamplingParams

    try:
        return SamplingParams(
            temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed, **fields
        )
    except ValueError as e:
        raise UsageError(flag_named(str(e))) from None


def _constraint(args: argparse.Namespace):
    """``generate``'s output constraint (--json-schema / --regex / --choice), or None."""
    from hydragen import StructuredOutputsParams

    given = {
        "--json-schema": args.json_schema,
        "--regex": args.regex,
        "--choice": args.choice,
    }
    named = [flag for flag, value in given.items() if value is not None]
    if not named:
        return None
    if len(named) > 1:
        raise UsageError(f"give at most one output constraint, got {' and '.join(named)}")
    if args.json_schema is not None:
        schema = args.json_schema
        if not schema.lstrip().startswith("{") and Path(schema).is_file():
            schema = Path(schema).read_text()
        try:
            return StructuredOutputsParams(json=schema)
        except ValueError as e:
            raise UsageError(f"--json-schema: {e} (give a JSON Schema or a file holding one)") from None
    try:
        return StructuredOutputsParams(regex=args.regex, choice=args.choice)
    except ValueError as e:
        raise UsageError(f"{named[0]}: {e}") from None


def _apply_machine_flags(args: argparse.Namespace) -> None:
    """Flags checked before the (slow) model load."""
    if args.threads is not None and args.threads < 1:
        raise UsageError(f"--threads must be at least 1, got {args.threads}")
    if args.max_model_len is not None and args.max_model_len < 2:
        raise UsageError(f"--max-model-len must be at least 2 tokens, got {args.max_model_len}")
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)


def _load(
    args: argparse.Namespace,
    kv_cache_tokens: int | None = None,
    prefix_sharing: bool = True,
    jump_forward: bool = True,
):
    """(LLM, seconds it took, context length in force): the model plus --max-model-len checked against it."""
    from hydragen import LLM

    t0 = time.perf_counter()
    llm = LLM(
        args.model,
        device=args.device,
        dtype=args.dtype,
        prefix_sharing=prefix_sharing,
        kv_cache_tokens=kv_cache_tokens,
        tensor_parallel_size=_tp_size(args),
        jump_forward=jump_forward,
    )
    load_s = time.perf_counter() - t0
    context = llm.config.max_position_embeddings
    if args.max_model_len is not None:
        if args.max_model_len > context:
            raise UsageError(
                f"--max-model-len {args.max_model_len} exceeds the model's context of {context} tokens"
            )
        context = args.max_model_len
    return llm, load_s, context


def _tp_size(args: argparse.Namespace) -> int:
    """--tensor-parallel-size, defaulting to the number of ranks when torchrun started this process."""
    from hydragen.distributed.group import torchrun_env

    env = torchrun_env()
    size = args.tensor_parallel_size
    if size is None:
        return env.world if env is not None else 1
    if size < 1:
        raise UsageError(f"--tensor-parallel-size must be at least 1, got {size}")
    if env is not None and size != env.world:
        raise UsageError(
            f"--tensor-parallel-size {size} does not match the {env.world} ranks torchrun started"
        )
    return size


def _torchrun_worker(args: argparse.Namespace) -> int | None:
    """Under torchrun, ranks 1..N-1 follow rank 0 instead of running the command (None on rank 0, or
    without torchrun)."""
    from hydragen.distributed.group import torchrun_env

    env = torchrun_env()
    if env is None or env.rank == 0 or args.command not in ("generate", "serve", "chat"):
        return None
    _tp_size(args)
    from hydragen.distributed.launcher import run_torchrun_worker
    from hydragen.model.loader import resolve_device, resolve_dtype

    random = getattr(args, "random_weights", False)
    return run_torchrun_worker(args.model, resolve_device(args.device), resolve_dtype(args.dtype), random)


def _kv_for(context: int | None, n: int) -> int | None:
    """KV cache for --max-model-len: room for the prompt once plus n full contexts, twice over (the decode
    tail block is rebuilt while the old one is still held). None: the engine's default."""
    return None if context is None else 2 * (n + 1) * (context + 1) + 1024


def _read_prompt(prompt: str) -> str:
    if prompt != "-":
        return prompt
    if sys.stdin.isatty():
        print("reading the prompt from the terminal; end it with Ctrl-D", file=sys.stderr)
    text = sys.stdin.read()
    if not text.strip():
        raise UsageError("the prompt read from standard input (-) is empty")
    return text.rstrip("\n")


def _prompt_ids(llm, args: argparse.Namespace, text: str) -> list[int]:
    tok = llm.tokenizer
    if tok is None:
        raise UsageError(f"{llm.model_path} has no tokenizer files, so a text prompt cannot be encoded")
    if args.raw or not tok.has_chat_template:
        if args.system is not None:
            why = "--raw sends the prompt as is" if args.raw else "this model has no chat template"
            raise UsageError(f"--system needs the chat template, but {why}")
        return tok.encode(text)
    messages = [{"role": "system", "content": args.system}] if args.system is not None else []
    return tok.apply_chat_template(messages + [{"role": "user", "content": text}])


def _ending(c, max_tokens: int) -> str:
    """Why a completion ended, in words."""
    if c.finish_reason == "stop":
        return f"stop string {c.stop_reason!r}" if isinstance(c.stop_reason, str) else "ended by the model"
    if c.finish_reason == "length":
        return "hit --max-tokens" if len(c.token_ids) >= max_tokens else "hit the context limit"
    return str(c.finish_reason)


def _mib(tokens: int, bytes_per_token: int) -> str:
    return f"{tokens * bytes_per_token / 2**20:.1f} MiB"


def summary_lines(
    *,
    model: str,
    load_s: float,
    result,
    n: int,
    max_tokens: int,
    prompt_len: int,
    computed: int,
    reused: int,
    peak_kv_tokens: int,
    copies_kv_tokens: int,
    bytes_per_token: int,
    sharing: bool,
) -> list[str]:
    """The closing summary of `hydragen generate`: each number says what it counts, and numbers that
    cannot be compared (a rate over one token, a memory saving that sharing did not make) are left out."""
    lines = [f"{model} loaded in {load_s:.1f} s (not counted below)"]
    what = f"{n} completion{'s' if n > 1 else ''}, {result.tokens} tokens"
    if n == 1 and result.output is not None:
        what += f" ({_ending(result.output.outputs[0], max_tokens)})"
    timing = f"{what} in {result.ended - result.started:.2f} s"
    if result.time_to_first_token is not None:
        timing += f": first token after {result.time_to_first_token:.2f} s"
        if result.decode_rate is not None:
            timing += f", then {result.decode_rate:.1f} tokens/s" + (" over all completions" if n > 1 else "")
    lines.append(timing)
    total = prompt_len * n
    prompt = f"prompt: {prompt_len} tokens" + (f" x {n} completions = {total}" if n > 1 else "")
    if reused <= 0:
        prompt += ", all computed"
    elif not sharing:  # the engine still prefills a request once, then copies it into every sequence
        prompt += f"; {computed} computed, then copied into each completion's own KV (sharing off)"
    else:
        prompt += f"; {computed} computed, {reused} reused from the prefix cache"
    lines.append(prompt)
    kv = f"KV cache: {_mib(peak_kv_tokens, bytes_per_token)} at peak"
    if not sharing:
        kv += " (sharing off: each completion holds its own copy)"
    elif n > 1 and peak_kv_tokens < copies_kv_tokens:
        saved = copies_kv_tokens / max(peak_kv_tokens, 1)
        copies = _mib(copies_kv_tokens, bytes_per_token)
        kv += f"; a private copy of prompt and output per completion would total {copies} ({saved:.1f}x)"
    elif n > 1:
        kv += " (this prompt is too short for a shared read to pay, so each completion reads its own copy)"
    lines.append(kv)
    return lines


class _RateLine:
    """A live "tokens, tokens/s" line on a terminal for n > 1 (redrawn at most 10 times a second)."""

    def __init__(self, n: int, enabled: bool) -> None:
        self.n, self.enabled, self.drawn = n, enabled, 0.0

    def __call__(self, tokens: int, seconds: float) -> None:
        now = time.perf_counter()
        if not self.enabled or now - self.drawn < 0.1 or seconds <= 0:
            return
        self.drawn = now
        rate = tokens / seconds
        line = f"generating {self.n} completions: {tokens} tokens in {seconds:.1f} s, {rate:.1f} tokens/s"
        print(f"\r{line}\x1b[K", end="", file=sys.stderr, flush=True)

    def clear(self) -> None:
        if self.enabled and self.drawn:
            print("\r\x1b[K", end="", file=sys.stderr, flush=True)


def _generate(args: argparse.Namespace) -> int:
    from hydragen.model.loader import resolve_dtype
    from hydragen.streaming import interrupt_flag, stream_request

    if args.n < 1:  # before SamplingParams, so the summary's arithmetic never sees n < 1
        raise UsageError(f"-n must be at least 1, got {args.n}")
    params = _sampling_params(
        args,
        n=args.n,
        max_tokens=args.max_tokens,
        stop=args.stop or None,
        ignore_eos=args.ignore_eos,
        structured_outputs=_constraint(args),
    )
    _apply_machine_flags(args)
    text = _read_prompt(args.prompt)
    llm, load_s, context = _load(
        args,
        _kv_for(args.max_model_len, args.n),
        prefix_sharing=not args.no_sharing,
        jump_forward=not args.no_jump_forward,
    )
    ids = _prompt_ids(llm, args, text)
    if len(ids) >= context:
        flag = "--max-model-len" if args.max_model_len is not None else "the model's context"
        raise UsageError(
            f"the prompt has {len(ids)} tokens; {flag} allows {context} (prompt and output together)"
        )
    if len(ids) + params.max_tokens > context:
        params = dataclasses.replace(params, max_tokens=context - len(ids))  # what the engine would stop at
    engine = llm.engine
    before = copy.copy(engine.stats)
    stream = args.n == 1
    rate = _RateLine(args.n, enabled=not stream and not args.quiet and sys.stderr.isatty())

    def show(_: int, piece: str) -> None:
        sys.stdout.write(piece)
        sys.stdout.flush()

    with interrupt_flag() as stop:
        result = stream_request(
            engine, ids, params, on_text=show if stream else None, on_step=rate, should_stop=stop
        )
    rate.clear()
    if stream:
        print()
    else:
        for c in result.output.outputs if result.output is not None else ():
            print(f"--- completion {c.index} ({_ending(c, args.max_tokens)}, {len(c.token_ids)} tokens) ---")
            print(c.text.strip())
    if result.stopped:
        print("stopped (Ctrl-C)", file=sys.stderr)
        return 130
    sys.stdout.flush()  # the completions before the summary, also when stdout is a pipe
    if not args.quiet:
        st = engine.stats
        prompt_tokens, computed = (
            st.prompt_tokens - before.prompt_tokens,
            st.prefill_tokens - before.prefill_tokens,
        )
        lines = summary_lines(
            model=llm.model_path.name,
            load_s=load_s,
            result=result,
            n=args.n,
            max_tokens=args.max_tokens,  # a lower limit from --max-model-len reads as the context
            prompt_len=len(ids),
            computed=computed,
            reused=prompt_tokens - computed,
            peak_kv_tokens=st.peak_kv_tokens,
            copies_kv_tokens=st.per_sequence_kv_tokens - before.per_sequence_kv_tokens,
            bytes_per_token=llm.config.kv_bytes_per_token_per_elem * resolve_dtype(args.dtype).itemsize,
            sharing=not args.no_sharing,
        )
        print("\n".join(f"--- {line}" for line in lines), file=sys.stderr)
    return 0


def _chat(args: argparse.Namespace) -> int:
    from hydragen.chat import Chat

    if args.max_tokens is not None and args.max_tokens < 1:
        raise UsageError(f"--max-tokens must be at least 1, got {args.max_tokens}")
    params = _sampling_params(args, max_tokens=args.max_tokens or 1)
    _apply_machine_flags(args)
    llm, load_s, context = _load(args, _kv_for(args.max_model_len, 1))
    if llm.tokenizer is None or not llm.tokenizer.has_chat_template:
        raise UsageError(f"{llm.model_path} has no chat template; use `hydragen generate --raw` instead")
    chat = Chat(llm, params, context, system=args.system, max_tokens=args.max_tokens, quiet=args.quiet)
    return chat.run(load_s)


def _serve(args: argparse.Namespace) -> int:
    import os

    from hydragen.server.launch import LOG_LEVELS, bind_socket, configure_logging
    from hydragen.server.options import ServerOptions

    # Everything that can be checked without the model is checked first: a bad option is one line, at once.
    api_key = args.api_key if args.api_key is not None else os.environ.get("HYDRAGEN_API_KEY") or None
    hosts = [h.strip() for h in args.allowed_hosts.split(",")] if args.allowed_hosts else None
    options = ServerOptions(
        api_key=api_key,
        allowed_hosts=hosts,
        max_request_bytes=args.max_request_bytes,
        read_timeout=args.read_timeout,
        shutdown_timeout=args.shutdown_timeout,
    )
    problems = []
    if not 0 <= args.port <= 65535:
        problems.append(f"--port must be in [0, 65535], got {args.port}")
    if args.log_level.lower() not in LOG_LEVELS:
        problems.append(f"--log-level must be one of {', '.join(LOG_LEVELS)}, got {args.log_level!r}")
    if args.api_key is not None and not args.api_key.strip():
        problems.append("--api-key must not be empty")
    if args.kv_cache_tokens is not None and args.kv_cache_tokens < 1:
        problems.append(f"--kv-cache-tokens must be >= 1, got {args.kv_cache_tokens}")
    if args.max_num_seqs < 1:
        problems.append(f"--max-num-seqs must be >= 1, got {args.max_num_seqs}")
    if args.tensor_parallel_size is not None and args.tensor_parallel_size < 1:
        problems.append(f"--tensor-parallel-size must be >= 1, got {args.tensor_parallel_size}")
    if args.model is not None and not os.path.exists(args.model):
        problems.append(f"--model {args.model!r} does not exist")
    try:
        options.check()
    except ValueError as e:
        problems.append(str(e))
    if problems:
        print(f"error: {problems[0]}", file=sys.stderr)
        return 2
    log_level = args.log_level.lower()
    try:
        sock = bind_socket(args.host, args.port)
    except OSError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    configure_logging(log_level)

    from hydragen import LLM
    from hydragen.server.app import create_app
    from hydragen.server.launch import run

    try:
        llm = LLM(
            args.model,
            device=args.device,
            dtype=args.dtype,
            kv_cache_tokens=args.kv_cache_tokens,
            max_num_seqs=args.max_num_seqs,
            prefix_sharing=not args.no_sharing,
            tensor_parallel_size=_tp_size(args),
            jump_forward=not args.no_jump_forward,
        )
    except BaseException:
        sock.close()
        raise
    name = args.served_model_name or llm.model_path.stem
    kv = llm.engine.pool.num_slots
    mib = kv * llm.engine.pool.bytes_per_token / 2**20
    host = f"[{args.host}]" if ":" in args.host else args.host
    ready = (
        f"ready: serving {name!r} on http://{host}:{{port}}/v1 | KV cache {kv} tokens ({mib:.0f} MiB)"
        f" | API key {'required' if api_key else 'not required'}"
    )
    try:
        run(create_app(llm, name, options), sock, options, log_level, ready)
    finally:
        llm.close()
    return 0


BENCHMARKS = {
    "attention": "hydragen.bench.attention",
    "e2e": "hydragen.bench.e2e",
    "longdoc": "hydragen.bench.longdoc",
    "tree": "hydragen.bench.tree",
    "serve": "hydragen.bench.serve",
    "structured": "hydragen.bench.structured",
}
# Calibrations, run on their own (not part of `bench all`).
EXTRA_BENCHMARKS = {
    "cost-rule": "hydragen.bench.cost_rule",
    "exactness": "hydragen.bench.exactness",
    "versus": "hydragen.bench.versus",
    "tp": "hydragen.bench.tp",
}


def _replot(module_name: str, folder: str) -> None:
    """Redraw a benchmark's plots from the JSON a run saved in ``folder`` (no measuring)."""
    import importlib

    from hydragen.bench.common import read_results

    module = importlib.import_module(module_name)
    for path in module.plots(read_results(Path(folder), module.RESULT_NAME), Path(folder)):
        print(path)


def _bench(args: argparse.Namespace) -> int:
    import importlib

    rest = list(args.rest)
    if "--replot" in rest:  # `hydragen bench NAME --replot DIR`: the plots again, from DIR/NAME.json
        at = rest.index("--replot")
        if at + 1 >= len(rest) or args.which == "all":
            raise UsageError(
                "--replot takes one results folder, after a benchmark's name: bench e2e --replot DIR"
            )
        _replot({**BENCHMARKS, **EXTRA_BENCHMARKS}[args.which], rest[at + 1])
        return 0
    if args.which != "all":
        importlib.import_module({**BENCHMARKS, **EXTRA_BENCHMARKS}[args.which]).main(rest)
        return 0
    # The whole suite at its defaults (or --quick), each benchmark into its own folder under --out.
    extra = argparse.ArgumentParser(prog="hydragen bench all")
    extra.add_argument("--quick", action="store_true", help="tiny sizes: checks that every benchmark runs")
    extra.add_argument("--out", default="bench-out")
    opts = extra.parse_args(rest)
    for name, module in BENCHMARKS.items():
        print(f"=== hydragen bench {name} ===", file=sys.stderr)
        argv = ["--out", f"{opts.out}/{name}"] + (["--quick"] if opts.quick else [])
        importlib.import_module(module).main(argv)
    return 0


def _version() -> str:
    import platform

    from hydragen import __version__

    try:
        import torch

        torch_version = torch.__version__
    except ImportError:  # --version must work even where torch is broken
        torch_version = "not installed"
    return f"hydragen {__version__} (torch {torch_version}, Python {platform.python_version()})"


class _VersionAction(argparse.Action):
    """--version, computed only when asked (it imports torch)."""

    def __init__(self, option_strings, dest, **kwargs) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        print(_version())
        parser.exit()


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=None,
        help="a .gguf file or Hugging Face model directory (default: embedded SmolLM2-135M-Instruct)",
    )
    p.add_argument("--system", default=None, help="system prompt (the chat template's system message)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--dtype", default="float32", help="float32, bfloat16 or float16 (default float32)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads for torch (default: every core)")
    p.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        metavar="TOKENS",
        help="context limit, prompt and output together; also sizes the KV cache (default: the model's)",
    )
    p.add_argument("--version", action=_VersionAction, help="print the version and exit")
    _add_tp_arg(p)


def _add_tp_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=None,
        metavar="N",
        help="split the model over N processes (attention heads, MLP columns, vocabulary); hydragen starts "
        "them itself, or, under torchrun, uses its ranks (default 1, or torchrun's number of ranks)",
    )


def _add_sampling_args(p: argparse.ArgumentParser, temperature: float) -> None:
    p.add_argument(
        "--temperature",
        type=float,
        default=temperature,
        help=f"sampling temperature, 0 = greedy (default {temperature})",
    )
    p.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling mass (default 0.95)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens, 0 = off (default 0)")
    p.add_argument("--seed", type=int, default=None, help="random seed for reproducible sampling")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hydragen", description="LLM inference built around shared prefixes."
    )
    parser.add_argument("--version", action=_VersionAction, help="print the version and exit")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser(
        "generate",
        help="sample completions of one prompt with shared-prefix attention",
        description="Generate N completions of PROMPT; the prompt's KV is computed and stored once and read "
        "by all N sequences in one batched attention call. One completion streams as it is generated; "
        "several are printed when done, with a live token rate meanwhile. A summary goes to stderr.",
    )
    g.add_argument("prompt", help="the prompt text, or - to read it from standard input")
    g.add_argument("-n", type=int, default=1, help="number of completions (default 1)")
    g.add_argument("--max-tokens", type=int, default=64, help="new tokens per completion (default 64)")
    _add_sampling_args(g, temperature=0.7)
    g.add_argument("--stop", action="append", help="stop string (repeatable); not included in the output")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens")
    g.add_argument("--raw", action="store_true", help="use the prompt as is, without the chat template")
    g.add_argument(
        "--json-schema", default=None, help="output must match this JSON Schema (inline or a file)"
    )
    g.add_argument("--regex", default=None, help="output must match this regular expression")
    g.add_argument("--choice", action="append", help="output must be one of these strings (repeatable)")
    g.add_argument(
        "--no-jump-forward",
        action="store_true",
        help="with a constraint: sample forced text token by token instead of jumping over it",
    )
    g.add_argument(
        "--no-sharing",
        action="store_true",
        help="baseline: every sequence keeps its own full copy of the prompt's KV",
    )
    _add_model_args(g)
    g.add_argument("-q", "--quiet", action="store_true", help="no live rate line and no summary")
    g.set_defaults(func=_generate)

    c = sub.add_parser(
        "chat",
        help="interactive chat in the terminal (earlier turns are served from the prefix cache)",
        description="Chat with the model: replies stream as they are generated, and each turn reuses the KV "
        "of the conversation so far from the prefix cache. /reset starts over, /exit or Ctrl-D leaves, "
        "Ctrl-C stops a reply. With standard input not a terminal, each input line is one user turn.",
    )
    c.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="most new tokens per reply (default: until the model ends its turn or the context is full)",
    )
    _add_sampling_args(c, temperature=0.7)
    _add_model_args(c)
    c.add_argument("-q", "--quiet", action="store_true", help="no banner and no per-turn statistics")
    c.set_defaults(func=_chat)

    v = sub.add_parser(
        "serve",
        help="OpenAI-compatible HTTP server with a persistent prefix cache",
        description="Serve /v1/completions, /v1/chat/completions, /v1/models, /health and "
        "/metrics. Requests that share prefixes share KV, across time.",
    )
    v.add_argument(
        "--model", default=None, help="a .gguf file or Hugging Face model directory (default: embedded)"
    )
    v.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: this machine only)")
    v.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    v.add_argument(
        "--served-model-name", default=None, help="model name clients send (default: file/dir name)"
    )
    v.add_argument(
        "--kv-cache-tokens", type=int, default=None, help="KV cache size in tokens (default: 1/4 of RAM)"
    )
    v.add_argument(
        "--max-num-seqs", type=int, default=256, help="most sequences decoded at once (default 256)"
    )
    v.add_argument("--no-sharing", action="store_true", help="baseline: no prefix cache, no shared attention")
    v.add_argument(
        "--no-jump-forward",
        action="store_true",
        help="structured outputs: sample forced text token by token instead of jumping over it (measurement)",
    )
    v.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    v.add_argument("--dtype", default="float32", help="float32, bfloat16 or float16 (default float32)")
    v.add_argument(
        "--log-level",
        default="info",
        help="critical, error, warning, info (one line per request; default) or debug",
    )
    v.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1/* (default: $HYDRAGEN_API_KEY, else none)",
    )
    v.add_argument(
        "--allowed-hosts",
        default=None,
        help="comma-separated host names accepted in the Host header (default: any)",
    )
    v.add_argument(
        "--max-request-bytes",
        type=int,
        default=8 * 2**20,
        help="largest request body in bytes; larger ones get a 413 (default 8 MiB)",
    )
    v.add_argument(
        "--read-timeout",
        type=float,
        default=30.0,
        help="seconds a client has to send a request's headers and body (default 30)",
    )
    v.add_argument(
        "--shutdown-timeout",
        type=float,
        default=10.0,
        help="on SIGTERM, seconds in-flight requests get before they are aborted (default 10)",
    )
    _add_tp_arg(v)
    v.set_defaults(func=_serve)

    b = sub.add_parser(
        "bench",
        help="benchmark suite (attention, e2e, longdoc, tree, serve, structured; cost-rule, exactness, "
        "versus, tp): `hydragen bench NAME -h`; `hydragen bench NAME --replot DIR` redraws a run's plots "
        "from its JSON",
    )
    b.add_argument(
        "which",
        choices=[*BENCHMARKS, "all", *EXTRA_BENCHMARKS],
        help="which benchmark ('all': the suite; 'cost-rule': calibrates the engine's sharing threshold)",
    )
    b.add_argument("rest", nargs=argparse.REMAINDER, help="the benchmark's own options")
    b.set_defaults(func=_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        worker = _torchrun_worker(args)
        if worker is not None:
            return worker
        return args.func(args)
    except (UsageError, ValueError, FileNotFoundError) as e:  # bad flags, bad input, unreadable model files
        print(f"error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:  # a request the engine could not complete (e.g. out of KV cache memory)
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
