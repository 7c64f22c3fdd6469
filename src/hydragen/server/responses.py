"""OpenAI response bodies: choices, log-probabilities, usage and SSE chunks, built from engine reports."""

from __future__ import annotations

import json

from hydragen.engine.outputs import CompletionOutput, RequestOutput
from hydragen.tools.stream import ToolCallStream, finish_reason


class Shapes:
    """Formats one request's choices; ``chat`` picks the chat or the text-completion shape. ``tools``: the
    request's ToolRequest when its replies may hold tool calls (they are parsed into ``tool_calls``)."""

    def __init__(self, tokenizer, chat: bool, top_logprobs: int, want_logprobs: bool, tools=None):
        self.tok, self.chat, self.top, self.want_lp = tokenizer, chat, top_logprobs, want_logprobs
        self.tools = tools
        self._streams: dict[int, ToolCallStream] = {}  # per choice, while streaming with tools
        self._text_offset: dict[int, int] = {}  # per choice: characters of its tokens' strings sent so far

    def token_str(self, t: int) -> str:
        return self.tok.decode([t], skip_special_tokens=False) if self.tok is not None else str(t)

    def logprobs(self, lps: list[dict[int, float]], ids: list[int], index: int = 0) -> dict | None:
        if not self.want_lp:
            return None
        if not self.chat:
            tokens = [self.token_str(t) for t in ids]
            return {
                "tokens": tokens,
                "token_logprobs": [lp[t] for lp, t in zip(lps, ids, strict=False)],
                "top_logprobs": [{self.token_str(k): v for k, v in lp.items()} for lp in lps],
                "text_offset": self._offsets(index, tokens),
            }
        content = []
        for lp, t in zip(lps, ids, strict=False):
            # A forced token (structured outputs) has {token: None}: null logprob, no alternatives.
            alts = sorted(lp.items(), key=lambda kv: -kv[1])[: self.top] if lp[t] is not None else []
            s = self.token_str(t)
            content.append(
                {
                    "token": s,
                    "logprob": lp[t],
                    "bytes": list(s.encode()),
                    "top_logprobs": [
                        {"token": self.token_str(k), "logprob": v, "bytes": list(self.token_str(k).encode())}
                        for k, v in alts
                    ],
                }
            )
        return {"content": content}

    def _offsets(self, index: int, tokens: list[str]) -> list[int]:
        """Where each token starts in the choice's text, counted over the tokens' own strings and carried
        across stream chunks (as vLLM counts them; a character split over tokens shows in each as U+FFFD)."""
        at = self._text_offset.get(index, 0)
        out = []
        for t in tokens:
            out.append(at)
            at += len(t)
        self._text_offset[index] = at
        return out

    def final_choice(self, index: int, text: str, ids: list[int], lps: list, reason: str | None) -> dict:
        c: dict = {"index": index, "finish_reason": reason}
        if self.chat and self.tools is not None:
            content, calls, c["finish_reason"] = self.tools.reply(text, reason)
            c["message"] = {"role": "assistant", "content": content}
            if calls:
                c["message"]["tool_calls"] = [call.to_openai() for call in calls]
        elif self.chat:
            c["message"] = {"role": "assistant", "content": text}
        else:
            c["text"] = text
        c["logprobs"] = self.logprobs(lps, ids, index)
        return c

    def delta_choices(self, index: int, d: CompletionOutput) -> list[dict]:
        """The stream chunks' choices for one update of choice ``index``: one, or with tools the content
        and tool-call deltas it holds (then one that carries the finish_reason)."""
        if not (self.chat and self.tools is not None):
            return [self.delta_choice(index, d)]
        if index not in self._streams:
            self._streams[index] = self.tools.stream()
        stream = self._streams[index]
        deltas = stream.feed(d.text, d.finish_reason)
        lp = self.logprobs(d.logprobs, d.token_ids, index) if self.want_lp and d.logprobs else None
        out = [{"index": index, "delta": delta, "logprobs": None, "finish_reason": None} for delta in deltas]
        if lp is not None:
            if not out:
                out.append({"index": index, "delta": {}, "logprobs": None, "finish_reason": None})
            out[0]["logprobs"] = lp
        if d.finish_reason is not None:
            reason = finish_reason(d.finish_reason, stream.complete)
            out.append({"index": index, "delta": {}, "logprobs": None, "finish_reason": reason})
        return out

    def delta_choice(self, index: int, d: CompletionOutput) -> dict:
        lp = self.logprobs(d.logprobs, d.token_ids, index) if self.want_lp and d.logprobs else None
        if self.chat:
            return {
                "index": index,
                "delta": {"content": d.text} if d.text else {},
                "logprobs": lp,
                "finish_reason": d.finish_reason,
            }
        return {"index": index, "text": d.text, "logprobs": lp, "finish_reason": d.finish_reason}

    @staticmethod
    def role_choice(index: int) -> dict:
        return {
            "index": index,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }


class Collected:
    """A non-streaming request's choices, accumulated from its reports."""

    def __init__(self):
        self.texts: dict[int, str] = {}
        self.ids: dict[int, list[int]] = {}
        self.lps: dict[int, list] = {}
        self.reasons: dict[int, str | None] = {}

    def add(self, first_index: int, report: RequestOutput) -> None:
        for d in report.outputs:
            k = first_index + d.index
            self.texts[k] = self.texts.get(k, "") + d.text
            self.ids.setdefault(k, []).extend(d.token_ids)
            if d.logprobs:
                self.lps.setdefault(k, []).extend(d.logprobs)
            if d.finish_reason:
                self.reasons[k] = d.finish_reason

    def choices(self, shapes: Shapes) -> list[dict]:
        return [
            shapes.final_choice(
                k, self.texts.get(k, ""), self.ids.get(k, []), self.lps.get(k, []), self.reasons.get(k)
            )
            for k in sorted(self.texts.keys() | self.reasons.keys())
        ]

    @property
    def completion_tokens(self) -> int:
        return sum(len(v) for v in self.ids.values())


def usage(finals: list[RequestOutput], completion_tokens: int) -> dict:
    prompt_tokens = sum(len(r.prompt_token_ids) for r in finals)
    cached = sum(r.cached_prompt_tokens for r in finals)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


SSE_DONE = "data: [DONE]\n\n"
