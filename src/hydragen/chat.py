"""`hydragen chat`: a conversation in the terminal, replies streamed as they are generated.

Each turn sends the whole conversation through the model's chat template; the engine finds the earlier
turns' KV in its prefix cache (prompt and reply of the last turn were cached when it finished), so only the
new message is computed. The statistics line after each reply shows how many prompt tokens were reused.

With standard input not a terminal (``printf 'Hi\\nAnd then?\\n' | hydragen chat``) every line is one user
turn and only the replies go to standard output.

A reasoning model's reasoning (``hydragen.reasoning``: its ``<think>`` block) is shown before its answer,
dimmed on a terminal and set apart by a blank line, or not at all with ``hide_reasoning``
(``--hide-reasoning``); the conversation keeps it as the reply's ``reasoning_content``, which the model's
template shows or drops. Tool calls are read from the answer only.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import TextIO

from hydragen.chat_tools import MAX_ROUNDS, ChatTools, show_call
from hydragen.prompt_input import TerminalPrompt
from hydragen.reasoning.splitter import ReasoningSplitter, split_reasoning
from hydragen.streaming import StreamResult, interrupt_flag, stream_request
from hydragen.tools.session import ToolSession

COMMANDS = {
    "/reset": "forget the conversation (the system prompt stays)",
    "/exit": "leave (Ctrl-D does too)",
    "/help": "this list",
}
DIM, PLAIN = "\x1b[2m", "\x1b[0m"


class Chat:
    """One conversation with one model. ``run`` reads turns until /exit or end of input."""

    def __init__(
        self,
        llm,
        params,
        context: int,
        *,
        system: str | None = None,
        max_tokens: int | None = None,
        quiet: bool = False,
        tools: ChatTools | None = None,
        hide_reasoning: bool = False,
        chat_template_kwargs: dict | None = None,
        stdin: TextIO | None = None,
        stdout: TextIO | None = None,
        stderr: TextIO | None = None,
    ) -> None:
        self.llm, self.params, self.context, self.max_tokens = llm, params, context, max_tokens
        self.system, self.quiet, self.tools = system, quiet, tools
        self.hide_reasoning, self.template_kwargs = hide_reasoning, chat_template_kwargs
        self.session: ToolSession | None = None  # the reply being streamed's, with tools
        self.splitter: ReasoningSplitter | None = None  # the reply being streamed's, with a reasoning model
        self._shown = ""  # what the reply being streamed shows: "", "reasoning", "ended" or "content"
        self.stdin, self.stdout, self.stderr = stdin or sys.stdin, stdout or sys.stdout, stderr or sys.stderr
        self.interactive = self.stdin.isatty()
        self._hinted = False  # the busy-machine hint is given once
        self.history: list[dict[str, str]] = self._start()

    def _start(self) -> list[dict[str, str]]:
        return [{"role": "system", "content": self.system}] if self.system is not None else []

    # ---- output --------------------------------------------------------------------------------
    def _note(self, text: str) -> None:
        """Statistics and hints: on stderr, dimmed on a terminal, never mixed into piped replies."""
        if self.quiet:
            return
        styled = f"{DIM}{text}{PLAIN}" if self.stderr.isatty() else text
        print(styled, file=self.stderr, flush=True)

    def _write(self, _: int, piece: str, final: bool = False) -> None:
        """Show a piece of the reply: its reasoning (dimmed on a terminal, unless hidden), then its content
        without the tool-call markup (``final``: the reply ended, so what was held back is decided)."""
        thought = ""
        if self.splitter is not None:
            thought, piece = self.splitter.feed(piece, final)
        if self.session is not None:
            piece = self.session.content(piece, final)
        dim, plain = (DIM, PLAIN) if self.stdout.isatty() else ("", "")
        out = []
        if thought and not self.hide_reasoning:
            out += [dim if self._shown != "reasoning" else "", thought]  # dimmed from its start to its end
            self._shown = "reasoning"
        if self._shown == "reasoning" and (piece or final):
            out.append(plain + ("\n\n" if piece else ""))  # the reasoning ends, set apart from the answer
            self._shown = "ended"
        if piece:
            out.append(piece)
            self._shown = "content"
        self.stdout.write("".join(out))
        self.stdout.flush()

    # ---- the loop ------------------------------------------------------------------------------
    def run(self, load_s: float) -> int:
        self._warm_up()
        threads = self.llm.engine.threads
        loaded = f"{self.llm.model_path.name} loaded in {load_s:.1f} s" + (
            f", {threads.describe()}" if threads is not None else ""
        )
        self._note(
            f"{loaded}. Type a message; /help lists the commands, Ctrl-C stops a reply, Ctrl-D leaves."
            if self.interactive
            else f"{loaded}; one user turn per input line."
        )
        if self.interactive:  # a terminal: prompts with line editing and history, one for each kind
            self._messages, self._results = TerminalPrompt(), TerminalPrompt()
        return self._loop()

    def _loop(self) -> int:
        while True:
            try:
                line = self._read()
            except KeyboardInterrupt:  # at the prompt: a fresh line, not an exit
                self._note("(Ctrl-D or /exit to leave)")
                continue
            if line is None:  # end of input: Ctrl-D or the end of a pipe
                return 0
            line = line.strip()
            if not line:
                continue
            if line.startswith("/") and len(line.split()) == 1:  # a command; longer lines are messages
                if self._command(line):
                    return 0
                continue
            self._turn(line)

    def _read(self) -> str | None:
        if self.interactive:
            try:
                return self._messages.input(">>> ")
            except EOFError:
                return None
        line = self.stdin.readline()
        return line if line else None

    def _command(self, name: str) -> bool:
        """Runs a /command; True means leave."""
        if name == "/exit":
            return True
        if name == "/reset":
            self.history = self._start()
            self._note("conversation cleared")
        elif name == "/help":
            self._note("\n".join(f"{c:7s} {what}" for c, what in COMMANDS.items()))
        else:
            self._note(f"unknown command {name}; /help lists the commands")
        return False

    def _warm_up(self) -> None:
        """Compute the template's opening (system prompt) before the first message, so the first reply
        starts as fast as the later ones: a 1-token request whose KV stays in the prefix cache."""
        opening = self.history + [{"role": "user", "content": "Hi"}]
        session = self.tools.session() if self.tools is not None else None
        ids = self._prompt_ids(opening, session)  # with tools, their description is part of the opening
        stream_request(self.llm.loop, ids, dataclasses.replace(self.params, max_tokens=1, stop=None))

    def _turn(self, message: str) -> None:
        conversation = self.history + [{"role": "user", "content": message}]
        for _ in range(MAX_ROUNDS):
            reply = self._reply(conversation)
            if reply is None:
                return
            text, calls, thought = reply
            said = {"reasoning_content": thought} if thought is not None else {}
            if not calls:
                conversation.append({"role": "assistant", "content": text, **said})
                break
            results = []
            for call in calls:
                if (result := self._result(call)) is None:  # end of input, Ctrl-C or Ctrl-D: unanswered
                    if self.interactive:
                        self._note("(the calls are left unanswered; the chat goes on)")
                    return
                results.append(result)
            conversation.append(
                {"role": "assistant", "content": text, "tool_calls": [c.to_openai() for c in calls], **said}
            )
            conversation += [
                {"role": "tool", "tool_call_id": c.id, "content": r}
                for c, r in zip(calls, results, strict=True)
            ]
        self.history = conversation

    def _prompt_ids(self, conversation: list[dict], session: ToolSession | None) -> list[int]:
        if session is not None:
            return session.prompt_ids(self.llm.tokenizer, conversation, self.template_kwargs)
        return self.llm.tokenizer.apply_chat_template(conversation, chat_template_kwargs=self.template_kwargs)

    def _reply(self, conversation: list[dict]) -> tuple[str, list, str | None] | None:
        """Generate and stream one assistant reply: (its content, its tool calls, its reasoning or None), or
        None when the conversation no longer fits the context."""
        session = self.tools.session() if self.tools is not None else None
        ids = self._prompt_ids(conversation, session)
        room = self.context - len(ids)
        if room < 1:
            self._note(
                f"the conversation is {len(ids)} tokens and the context holds {self.context}: "
                "/reset to start over"
            )
            return None
        params = dataclasses.replace(self.params, max_tokens=min(self.max_tokens or room, room))
        if session is not None:
            params = session.sampling_params(params, self.tools.constraint)
        self.session = session
        reasoning = self.llm.engine.reasoning
        phase = reasoning.first_phase(ids) if reasoning is not None else None
        self.splitter = ReasoningSplitter(reasoning, phase) if reasoning is not None else None
        self._shown = ""
        stats = self.llm.engine.stats
        prompt0, computed0 = stats.prompt_tokens, stats.prefill_tokens
        with interrupt_flag() as stop:
            result = stream_request(self.llm.loop, ids, params, on_text=self._write, should_stop=stop)
        self._write(0, "", final=True)
        text, calls, thought = result.texts[0], [], None
        if reasoning is not None:
            thought, text = split_reasoning(text, reasoning, phase)
        reason = result.output.outputs[0].finish_reason if result.output is not None else None
        if session is not None:
            content, calls, _ = session.reply(text, reason) if not result.stopped else (text, [], None)
            text = content or ""
            for call in calls:
                print(f"\n{show_call(call)}", end="", file=self.stdout)
        print(file=self.stdout, flush=True)
        if calls and reason == "length":  # as the server's client sees it: a cut reply, not calls to run
            self._note("(the reply was cut short, finish_reason length: its calls are not run)")
            calls = []
        reused = (stats.prompt_tokens - prompt0) - (stats.prefill_tokens - computed0)
        self._note(turn_summary(result, len(ids), reused))
        threads = self.llm.engine.threads
        if threads is not None and not self._hinted and (hint := threads.hint()) is not None:
            self._hinted = True
            self._note(hint)
        return text, calls, thought

    def _result(self, call) -> str | None:
        """The result of ``call``, typed (or piped) in; None at the end of input, or when Ctrl-C or Ctrl-D
        leaves the calls unanswered (the turn then ends and the chat goes on)."""
        if self.interactive:
            try:
                return self._results.input(f"{call.name} result> ")
            except (EOFError, KeyboardInterrupt):
                return None
        line = self.stdin.readline()
        return line.rstrip("\n") if line else None


def turn_summary(result: StreamResult, prompt_tokens: int, reused: int) -> str:
    """One line per reply: its size and speed, and how much of the conversation came from the cache."""
    parts = [f"{result.tokens} tokens"]
    if result.time_to_first_token is not None:
        parts.append(f"first after {result.time_to_first_token:.2f} s")
    if result.decode_rate is not None:
        parts.append(f"{result.decode_rate:.1f} tokens/s")
    head = ", ".join(parts) + (" (stopped)" if result.stopped else "")
    return f"[{head} | prompt {prompt_tokens} tokens, {max(reused, 0)} from the prefix cache]"
