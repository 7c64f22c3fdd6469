"""``POST /v1/chat/completions``: a conversation through the model's chat template, with OpenAI's chat
choices, log-probabilities and tool calls (the request's ``ToolSession``, as ``LLM.chat``'s and
``hydragen chat``'s, renders the tools into the prompt, builds the call grammar and reads the calls out of
the reply, whole or as it streams). A reasoning model's reply is split first (``hydragen.reasoning``): its
reasoning goes out as ``reasoning_content`` (vLLM's field, in the message and in stream deltas), and only the
text after it is content, read for tool calls."""

from __future__ import annotations

from fastapi import Request
from fastapi.responses import Response

from hydragen.engine.outputs import CompletionOutput
from hydragen.engine.sampling_params import ParamError, SamplingParams
from hydragen.reasoning.splitter import ReasoningSplitter, split_reasoning
from hydragen.server.errors import APIError
from hydragen.server.protocol import ChatCompletionRequest
from hydragen.server.responses import token_text
from hydragen.server.serving import ParamNames
from hydragen.server.serving_openai import OpenAIServing
from hydragen.tools.session import ToolSession


class ChatChoices:
    """Chat choices. ``tools``: the request's ToolSession when its replies may hold tool calls (they become
    ``tool_calls``); ``top_logprobs`` alternatives per token when ``want_logprobs``. ``reasoning``: the
    model's ReasoningFormat (None: it does not reason) and ``phase`` where the replies start (its
    ``first_phase`` of the prompt); the reasoning is sent as ``reasoning_content`` unless not
    ``include_reasoning``."""

    object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def __init__(
        self,
        tokenizer,
        top_logprobs: int,
        want_logprobs: bool,
        tools: ToolSession | None = None,
        reasoning=None,
        phase: str | None = None,
        include_reasoning: bool = True,
    ):
        self.tok, self.top, self.want_lp, self.tools = tokenizer, top_logprobs, want_logprobs, tools
        self.reasoning, self.phase, self.include_reasoning = reasoning, phase, include_reasoning
        self._splitters: dict[int, ReasoningSplitter] = {}  # per choice, once its reply streams

    def _split(self, index: int, piece: CompletionOutput) -> tuple[str, str]:
        """(reasoning, content) of a streamed piece of choice ``index``."""
        if self.reasoning is None:
            return "", piece.text
        if index not in self._splitters:
            self._splitters[index] = ReasoningSplitter(self.reasoning, self.phase)
        thought, content = self._splitters[index].feed(piece.text, final=piece.finish_reason is not None)
        return (thought if self.include_reasoning else ""), content

    def opening(self, count: int) -> list[dict]:
        role = {"role": "assistant", "content": ""}
        return [{"index": k, "delta": role, "logprobs": None, "finish_reason": None} for k in range(count)]

    def delta(self, index: int, piece: CompletionOutput) -> list[dict]:
        """One choice, or with tools the content and tool-call deltas the piece holds (then one that
        carries the finish_reason)."""
        lp = self.logprobs(piece.logprobs, piece.token_ids) if piece.logprobs else None
        thought, text = self._split(index, piece)
        if self.tools is None:
            delta = {"reasoning_content": thought} if thought else {}
            if text:
                delta["content"] = text
            return [{"index": index, "delta": delta, "logprobs": lp, "finish_reason": piece.finish_reason}]
        deltas, reason = self.tools.deltas(index, text, piece.finish_reason)
        if thought:
            deltas = [{"reasoning_content": thought}, *deltas]
        out = [{"index": index, "delta": delta, "logprobs": None, "finish_reason": None} for delta in deltas]
        if lp is not None:
            if not out:
                out.append({"index": index, "delta": {}, "logprobs": None, "finish_reason": None})
            out[0]["logprobs"] = lp
        if reason is not None:  # the choice ended
            out.append({"index": index, "delta": {}, "logprobs": None, "finish_reason": reason})
        return out

    def final(self, index: int, text: str, ids: list[int], logprobs: list, reason: str | None) -> dict:
        c: dict = {"index": index, "finish_reason": reason}
        thought, reply = None, text
        if self.reasoning is not None:
            thought, reply = split_reasoning(text, self.reasoning, self.phase)
        if self.tools is not None:
            content, calls, c["finish_reason"] = self.tools.reply(reply, reason)
            c["message"] = {"role": "assistant", "content": content}
            if calls:
                c["message"]["tool_calls"] = [call.to_openai() for call in calls]
        else:
            c["message"] = {"role": "assistant", "content": reply}
        if self.reasoning is not None and self.include_reasoning:
            c["message"]["reasoning_content"] = thought
        c["logprobs"] = self.logprobs(logprobs, ids)
        return c

    def logprobs(self, lps: list[dict[int, float]], ids: list[int]) -> dict | None:
        if not self.want_lp:
            return None
        content = []
        for lp, t in zip(lps, ids, strict=False):
            # A forced token (structured outputs) has {token: None}: null logprob, no alternatives.
            alts = sorted(lp.items(), key=lambda kv: -kv[1])[: self.top] if lp[t] is not None else []
            s = token_text(self.tok, t)
            content.append(
                {
                    "token": s,
                    "logprob": lp[t],
                    "bytes": list(s.encode()),
                    "top_logprobs": [
                        {
                            "token": token_text(self.tok, k),
                            "logprob": v,
                            "bytes": list(token_text(self.tok, k).encode()),
                        }
                        for k, v in alts
                    ],
                }
            )
        return {"content": content}


class ChatServing(OpenAIServing):
    async def create(self, http: Request) -> Response:
        body, log = await self.read(http, ChatCompletionRequest, "chatcmpl-")
        logprobs = self.sampling(body)
        prompts, session = await self.encoder.request_prompts(body, True, self.model.tool_format)
        params = self.params(body, prompts, logprobs, lambda i: "messages", None)
        log.record["prompt_tokens"] = sum(len(ids) for ids, _ in prompts)
        field = body.structured_field()
        tools = session if session is not None and session.enforced else None
        if tools is not None:
            params, field = await self.tool_params(tools, params), "tools"
        else:
            await self.precompile(params[0].structured_outputs, field)
        names = ParamNames("messages", body.max_tokens_param, field)
        streams = await self.submit(prompts, params, log.id, names)
        reasoning = self.model.reasoning
        phase = reasoning.first_phase(prompts[0][0]) if reasoning is not None else None
        choices = ChatChoices(
            self.model.tokenizer, body.top_logprobs or 0, logprobs is not None, tools, reasoning, phase,
            body.include_reasoning,
        )  # fmt: skip
        return await self.answer(http, body, streams, choices, log)

    async def tool_params(self, tools: ToolSession, params: list[SamplingParams]) -> list[SamplingParams]:
        """``params`` with the request's tool-call grammar, built and compiled off the event loop (errors
        name the tool whose schema is at fault)."""
        try:
            return tools.sampling_params(params, await self.client.compile(tools.constraint))
        except ParamError as e:
            if e.param == "structured_outputs":  # the grammar did not compile
                e = tools.locate(e)
            raise APIError(400, str(e), e.param, code="invalid_value") from None
