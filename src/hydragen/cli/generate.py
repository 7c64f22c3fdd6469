"""``hydragen generate`` (n completions of one prompt, with a summary of what sharing saved) and
``hydragen chat``."""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import sys
import time

from hydragen.cli.common import (
    UsageError,
    apply_machine_flags,
    constraint,
    engine_config_of,
    kv_for,
    load_llm,
    sampling_params,
)


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


def speculation_line(m: dict) -> str:
    """What speculative decoding did, from ``SpecMetrics.summary()``."""
    if not m["drafts"]:
        share = m["speculated_step_share"]
        return f"speculation: no drafts verified (none found, or none paid; {share:.0%} of steps)"
    per = ", ".join(str(x) for x in m["accepted_per_position"])
    return (
        f"speculation: {m['drafts']} verifications of {m['draft_tokens']} drafted tokens, "
        f"{m['accepted_tokens']} accepted ({m['acceptance_rate']:.0%}); "
        f"{m['mean_accepted_length']:.2f} tokens per verification; "
        f"{m['speculated_step_share']:.0%} of decode steps speculated; accepted per position: {per}"
    )


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
    threads=None,
    speculation: dict | None = None,
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
    if speculation is not None:  # SpecMetrics.summary() of this run
        lines.append(speculation_line(speculation))
    if threads is not None:  # a cpu_threads.ThreadGovernor
        lines.append(threads.describe())
        if (hint := threads.hint()) is not None:
            lines.append(hint)
    return lines


class RateLine:
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


def _kv_budget(args: argparse.Namespace, n: int) -> dict:
    """The KV cache --max-model-len calls for, unless --kv-cache-tokens says (``kv_for``)."""
    if args.kv_cache_tokens is not None or args.max_model_len is None:
        return {}
    return {"kv_cache_tokens": kv_for(args.max_model_len, n)}


def run_generate(args: argparse.Namespace) -> int:
    from hydragen.streaming import interrupt_flag, stream_request

    if args.n < 1:  # before SamplingParams, so the summary's arithmetic never sees n < 1
        raise UsageError(f"-n must be at least 1, got {args.n}")
    fields = dict(
        n=args.n,
        max_tokens=args.max_tokens,
        stop=args.stop or None,
        ignore_eos=args.ignore_eos,
        structured_outputs=constraint(args),
    )
    sampling_params(args, **fields)  # bad flags are reported before the model loads
    apply_machine_flags(args)
    config = engine_config_of(args, **_kv_budget(args, args.n))
    text = _read_prompt(args.prompt)
    llm, load_s, context = load_llm(args, config)
    params = sampling_params(args, llm.generation_defaults.values, **fields)
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
    speculator = engine.scheduler.speculator
    spec_before = speculator.metrics.copy() if speculator is not None else None
    stream = args.n == 1
    rate = RateLine(args.n, enabled=not stream and not args.quiet and sys.stderr.isatty())

    def show(_: int, piece: str) -> None:
        sys.stdout.write(piece)
        sys.stdout.flush()

    with interrupt_flag() as stop:
        result = stream_request(
            llm.loop, ids, params, on_text=show if stream else None, on_step=rate, should_stop=stop
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
            bytes_per_token=llm.config.kv_bytes_per_token_per_elem * engine.pool.k.element_size(),
            sharing=config.prefix_sharing,
            threads=engine.threads,
            speculation=None if speculator is None else speculator.metrics.since(spec_before).summary(),
        )
        print("\n".join(f"--- {line}" for line in lines), file=sys.stderr)
    return 0


def run_chat(args: argparse.Namespace) -> int:
    from hydragen.chat import Chat
    from hydragen.chat_tools import ChatTools, choice_from_flag, load_tools

    if args.max_tokens is not None and args.max_tokens < 1:
        raise UsageError(f"--max-tokens must be at least 1, got {args.max_tokens}")
    if args.tool_choice is not None and args.tools is None:
        raise UsageError("--tool-choice needs --tools")
    try:  # read before the model loads, so a bad file is reported at once
        tool_list = load_tools(args.tools) if args.tools is not None else None
        template_kwargs = _template_kwargs(args.chat_template_kwargs)
    except ValueError as e:
        raise UsageError(str(e)) from None
    sampling_params(args, max_tokens=args.max_tokens or 1)  # bad flags are reported before the model loads
    apply_machine_flags(args)
    llm, load_s, context = load_llm(args, engine_config_of(args, **_kv_budget(args, 1)))
    params = sampling_params(args, llm.generation_defaults.values, max_tokens=args.max_tokens or 1)
    if llm.tokenizer is None or not llm.tokenizer.has_chat_template:
        raise UsageError(f"{llm.model_path} has no chat template; use `hydragen generate --raw` instead")
    tools = None
    if tool_list is not None:
        try:
            tools = ChatTools(llm, tool_list, choice_from_flag(args.tool_choice))
        except ValueError as e:
            raise UsageError(str(e)) from None
    chat = Chat(
        llm, params, context, system=args.system, max_tokens=args.max_tokens, quiet=args.quiet, tools=tools,
        hide_reasoning=args.hide_reasoning, chat_template_kwargs=template_kwargs,
    )  # fmt: skip
    return chat.run(load_s)


def _template_kwargs(value: str | None) -> dict | None:
    """``--chat-template-kwargs``: a JSON object of template variables, checked as a request's are."""
    if value is None:
        return None
    from hydragen.model.tokenizer import check_template_kwargs

    try:
        kwargs = json.loads(value)
    except json.JSONDecodeError as e:
        raise ValueError(f"--chat-template-kwargs is not JSON: {e}") from None
    try:
        return check_template_kwargs(kwargs)
    except ValueError as e:
        raise ValueError(f"--chat-template-kwargs: {e}") from None
