"""OpenAI rendering: choice deltas → completions / chat objects, stream chunks and usage.

The router's internal view of a logprob is ``float | None`` (``None``: not a finite number,
as it travels between processes, :func:`k3serve.messages.finite`); the public API always
renders a number, :func:`public_logprob`, the one place that maps ``None`` to OpenAI's
``-9999.0``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from json.encoder import encode_basestring_ascii
from typing import Any

from router.preprocess import PromptJob
from router.responses import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatResponseMessage,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionResponse,
    DeltaFunction,
    DeltaMessage,
    DeltaToolCall,
    PromptTokensDetails,
    ResponseFunction,
    ResponseToolCall,
    TopLogprob,
    Usage,
    now,
)
from router.schemas import ChatCompletionRequest, CompletionRequest
from router.stream import Delta, TokenLogprob
from router.tools import ToolStreamParser, parse_tool_calls

#: What the public API shows for a logprob that is not a finite number (vLLM does the same).
NOT_FINITE_LOGPROB = -9999.0


def public_logprob(lp: float | None) -> float:
    """A logprob as the public API renders it: ``None`` (not finite) → ``-9999.0``."""
    return NOT_FINITE_LOGPROB if lp is None else lp


@dataclass
class ChoiceAcc:
    """Everything one choice produced (non-streaming response, usage)."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    token_texts: list[str] = field(default_factory=list)  # text completed by each token
    finish_reason: str | None = None

    def absorb(self, d: Delta) -> None:
        self.text += d.text
        self.token_ids += d.token_ids
        self.logprobs += d.logprobs
        self.token_texts += token_texts(d)
        self.finish_reason = d.finish_reason or self.finish_reason

    def count(self, d: Delta) -> None:
        """A streamed delta: only its tokens and finish are kept (the usage chunk counts the
        tokens; the text went to the client in the chunk). Per chunk, without the text
        concatenation of :meth:`absorb`, which copies the whole text each time (quadratic in
        a long stream)."""
        self.token_ids += d.token_ids
        self.finish_reason = d.finish_reason or self.finish_reason


def token_texts(d: Delta) -> list[str]:
    """Text attributed per token: the text each token completed (``Delta.texts``), else the
    whole delta's text goes to its last token."""
    if d.texts is not None and len(d.texts) == len(d.token_ids):
        return d.texts
    return [d.text if k == len(d.token_ids) - 1 else "" for k in range(len(d.token_ids))]


def _js(x: object) -> str:
    """Compact JSON, as the chunks are written (``json.dumps``, ASCII escapes)."""
    return json.dumps(x, separators=(",", ":"))


def _js_str(s: str) -> str:
    """A string as compact JSON: what :func:`_js` writes for a ``str`` (the C encoder of
    ``json``, without building an encoder per call)."""
    return encode_basestring_ascii(s)


def sse_frame(payload: str) -> bytes:
    """One SSE event: ``data: PAYLOAD`` and the blank line."""
    return b"data: " + payload.encode() + b"\n\n"


class Render:
    """Turns deltas into OpenAI objects (completions or chat) of one request.

    Args:
        tokenizer: The model's tokenizer (token strings and bytes).
        model: The served model name.
        req: The validated request.
        rid: The response id.
    """

    def __init__(self, tokenizer, model: str, req: CompletionRequest | ChatCompletionRequest,
                 rid: str) -> None:
        self.tok, self.model, self.req, self.rid = tokenizer, model, req, rid
        self.chat = isinstance(req, ChatCompletionRequest)
        self.created = now()
        self._offset: dict[int, int] = {}
        self.tools = self.chat and req.tools_active  # type: ignore[union-attr]
        self._parsers: dict[int, ToolStreamParser] = {}  # streaming tool-call parse, by choice
        # The plain chunk (no logprobs, no tools) is written from these two pieces; it is the
        # same JSON as ``chunk`` renders (tests/router/test_relay.py compares them).
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        self._head = (f'{{"id":{_js(rid)},"object":"{obj}","created":{self.created},'
                      f'"model":{_js(model)},"choices":[{{"index":')
        self._plain = not self.tools and not self.want_logprobs()

    def token_str(self, t: int) -> str:
        b = self.tok.decode_bytes([t], skip_special_tokens=False)
        try:
            return b.decode("utf-8")
        except UnicodeDecodeError:
            return "".join(f"bytes:\\x{x:02x}" for x in b)

    def token_bytes(self, t: int) -> list[int]:
        return list(self.tok.decode_bytes([t], skip_special_tokens=False))

    def want_logprobs(self) -> bool:
        if isinstance(self.req, ChatCompletionRequest):
            return self.req.logprobs
        return self.req.logprobs is not None

    def completion_logprobs(self, index: int, lps: list[TokenLogprob],
                            texts: list[str]) -> CompletionLogprobs:
        off = self._offset.get(index, 0)
        res = CompletionLogprobs()
        for lp, piece in zip(lps, texts, strict=True):
            res.tokens.append(self.token_str(lp.token_id))
            res.token_logprobs.append(public_logprob(lp.logprob))
            res.top_logprobs.append({self.token_str(t): public_logprob(v) for t, v in lp.top}
                                    if lp.top or self.req.logprobs else None)
            res.text_offset.append(off)
            off += len(piece)
        self._offset[index] = off
        return res

    def chat_logprobs(self, lps: list[TokenLogprob]) -> ChatLogprobs:
        return ChatLogprobs(content=[
            ChatTokenLogprob(
                token=self.token_str(lp.token_id), logprob=public_logprob(lp.logprob),
                bytes=self.token_bytes(lp.token_id),
                top_logprobs=[TopLogprob(token=self.token_str(t), logprob=public_logprob(v),
                                         bytes=self.token_bytes(t)) for t, v in lp.top])
            for lp in lps])

    def chunk(self, d: Delta, first: bool) -> dict[str, Any]:
        """One SSE chunk for a delta (``first``: the choice's first chunk)."""
        lp_on = self.want_logprobs() and d.logprobs
        if self.chat:
            text, calls, reason = d.text, None, d.finish_reason
            if self.tools:
                parser = self._parsers.setdefault(d.index, ToolStreamParser())
                text, deltas = parser.feed(d.text)
                if d.finish_reason:
                    rest, more = parser.finish()
                    text, deltas = text + rest, deltas + more
                calls = [DeltaToolCall(index=t.index, id=t.id,
                                       type="function" if t.id is not None else None,
                                       function=DeltaFunction(name=t.name,
                                                              arguments=t.arguments))
                         for t in deltas] or None
                if reason == "stop" and parser.saw_calls:
                    reason = "tool_calls"
            delta = DeltaMessage(role="assistant" if first else None,
                                 content=text if (text or first) else None, tool_calls=calls)
            c = ChatChunkChoice(index=d.index, delta=delta,
                                logprobs=self.chat_logprobs(d.logprobs) if lp_on else None,
                                finish_reason=reason)
            return ChatCompletionChunk(id=self.rid, created=self.created, model=self.model,
                                       choices=[c]).model_dump(exclude_none=True)
        c = CompletionChoice(
            index=d.index, text=d.text, finish_reason=d.finish_reason,
            logprobs=self.completion_logprobs(d.index, d.logprobs, token_texts(d))
            if lp_on else None)
        return CompletionChunk(id=self.rid, created=self.created, model=self.model,
                               choices=[c]).model_dump(exclude_none=True)

    def frame(self, d: Delta, first: bool) -> bytes:
        """The SSE event of :meth:`chunk` (``data: {...}`` and the blank line), written
        directly for a plain chunk (no logprobs, no tool parsing): the relay's per-chunk
        cost."""
        if not self._plain:
            return sse_frame(_js(self.chunk(d, first)))
        reason = f',"finish_reason":"{d.finish_reason}"' if d.finish_reason else ""
        if not self.chat:
            return sse_frame(f'{self._head}{d.index},"text":{_js_str(d.text)}{reason}}}]}}')
        parts = []
        if first:
            parts.append('"role":"assistant"')
        if d.text or first:
            parts.append(f'"content":{_js_str(d.text)}')
        return sse_frame(f'{self._head}{d.index},"delta":{{{",".join(parts)}}}{reason}}}]}}')

    def frame_with_usage(self, d: Delta, first: bool, jobs: list[PromptJob],
                         accs: dict[int, ChoiceAcc]) -> bytes:
        """:meth:`frame` with the request's running ``usage`` (``continuous_usage_stats``):
        the prompt tokens of every prompt, the completion tokens every choice has streamed so
        far (``d``'s included; ``accs`` has counted it) and their sum."""
        chunk = self.chunk(d, first)
        chunk["usage"] = self.usage(jobs, accs).model_dump()
        return sse_frame(_js(chunk))

    def chat_choice(self, index: int, a: ChoiceAcc) -> ChatChoice:
        """One non-streaming chat choice; with tools, the Kimi-format calls parsed out of the
        text into ``message.tool_calls`` (``finish_reason`` ``tool_calls`` when it stopped)."""
        content: str | None = a.text
        calls, reason = None, a.finish_reason
        if self.tools:
            content, parsed = parse_tool_calls(a.text)
            if parsed:
                calls = [ResponseToolCall(id=t.id, function=ResponseFunction(
                    name=t.name, arguments=t.arguments)) for t in parsed]
                content = content or None
                if reason == "stop":
                    reason = "tool_calls"
        return ChatChoice(
            index=index, message=ChatResponseMessage(content=content, tool_calls=calls),
            logprobs=self.chat_logprobs(a.logprobs) if self.want_logprobs() else None,
            finish_reason=reason)

    def usage(self, jobs: list[PromptJob], accs: dict[int, ChoiceAcc]) -> Usage:
        prompt = sum(len(j.token_ids) for j in jobs)
        completion = sum(len(a.token_ids) for a in accs.values())
        return Usage(prompt_tokens=prompt, completion_tokens=completion,
                     total_tokens=prompt + completion,
                     prompt_tokens_details=PromptTokensDetails(
                         cached_tokens=sum(j.cached_tokens for j in jobs)))

    def usage_chunk(self, jobs: list[PromptJob], accs: dict[int, ChoiceAcc]) -> dict[str, Any]:
        """The final chunk of a stream with ``stream_options.include_usage``."""
        cls = ChatCompletionChunk if self.chat else CompletionChunk
        return cls(id=self.rid, created=self.created, model=self.model, choices=[],
                   usage=self.usage(jobs, accs)).model_dump()

    def full(self, jobs: list[PromptJob], accs: dict[int, ChoiceAcc]) -> dict[str, Any]:
        """The non-streaming response."""
        usage = self.usage(jobs, accs)
        if self.chat:
            choices = [self.chat_choice(i, a) for i, a in sorted(accs.items())]
            return ChatCompletionResponse(id=self.rid, created=self.created, model=self.model,
                                          choices=choices, usage=usage).model_dump()
        choices = []
        for i, a in sorted(accs.items()):
            lp = None
            if self.want_logprobs():
                self._offset[i] = 0
                lp = self.completion_logprobs(i, a.logprobs, a.token_texts)
            choices.append(CompletionChoice(index=i, text=a.text, logprobs=lp,
                                            finish_reason=a.finish_reason))
        return CompletionResponse(id=self.rid, created=self.created, model=self.model,
                                  choices=choices, usage=usage).model_dump()
