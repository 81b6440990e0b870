"""The Kimi K2/K3 tool-call parser, non-streaming and streaming (torch-free).

Format (what vLLM's ``kimi_k2`` parser reads)::

    text <|tool_calls_section_begin|>
      <|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{json}<|tool_call_end|>
      …
    <|tool_calls_section_end|> text

A call's id is its header, ``functions.NAME:IDX``; its name is what lies between
``functions.`` (optional) and the last ``:``. Text outside the section is the message content.
A section cut off (``max_tokens``) yields the calls completed so far plus the one begun, with
its arguments as far as they went (the client sees ``finish_reason: "length"``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from k3serve.structured import ARG_BEGIN, CALL_BEGIN, CALL_END, SECTION_BEGIN, SECTION_END


@dataclass
class ToolCall:
    """One parsed call: ``id`` (the header), ``name``, ``arguments`` (JSON text)."""

    id: str
    name: str
    arguments: str = ""


@dataclass
class ToolCallDelta:
    """A streamed piece of call ``index``: ``id`` and ``name`` on its first piece only."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


def _name_of(header: str) -> str:
    h = header.strip()
    name = h.rsplit(":", 1)[0] if ":" in h else h
    return name.removeprefix("functions.")


def _held(buf: str, markers: tuple[str, ...]) -> int:
    """Length of the longest suffix of ``buf`` that is a proper prefix of a marker (text that
    may still turn into one and must be held back)."""
    best = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(buf)), best, -1):
            if buf.endswith(m[:k]):
                best = k
                break
    return best


@dataclass
class ToolStreamParser:
    """Incremental parser: :meth:`feed` text pieces, read content and call deltas.

    States: ``text`` (content; waits for the section), ``section`` (between calls),
    ``header`` (``functions.NAME:IDX``), ``args`` (argument text, streamed as it comes).
    """

    state: str = "text"
    buf: str = ""
    calls: list[ToolCall] = field(default_factory=list)

    @property
    def saw_calls(self) -> bool:
        return bool(self.calls)

    def feed(self, piece: str) -> tuple[str, list[ToolCallDelta]]:
        """Consume ``piece``; returns the new content text and call deltas it completes."""
        self.buf += piece
        content, deltas = "", []
        while True:
            if self.state == "text":
                i = self.buf.find(SECTION_BEGIN)
                if i < 0:
                    keep = _held(self.buf, (SECTION_BEGIN,))
                    content += self.buf[: len(self.buf) - keep]
                    self.buf = self.buf[len(self.buf) - keep:]
                    break
                content += self.buf[:i]
                self.buf, self.state = self.buf[i + len(SECTION_BEGIN):], "section"
            elif self.state == "section":
                b, e = self.buf.find(CALL_BEGIN), self.buf.find(SECTION_END)
                if b >= 0 and (e < 0 or b < e):
                    self.buf, self.state = self.buf[b + len(CALL_BEGIN):], "header"
                elif e >= 0:
                    self.buf, self.state = self.buf[e + len(SECTION_END):], "text"
                else:
                    keep = _held(self.buf, (CALL_BEGIN, SECTION_END))
                    self.buf = self.buf[len(self.buf) - keep:]  # stray text inside: dropped
                    break
            elif self.state == "header":
                i = self.buf.find(ARG_BEGIN)
                if i < 0:
                    break
                header = self.buf[:i].strip()
                self.calls.append(ToolCall(header, _name_of(header)))
                deltas.append(ToolCallDelta(len(self.calls) - 1, header, _name_of(header)))
                self.buf, self.state = self.buf[i + len(ARG_BEGIN):], "args"
            else:  # args
                i = self.buf.find(CALL_END)
                if i < 0:
                    keep = _held(self.buf, (CALL_END,))
                    out = self.buf[: len(self.buf) - keep]
                    self.buf = self.buf[len(self.buf) - keep:]
                else:
                    out = self.buf[:i]
                    self.buf, self.state = self.buf[i + len(CALL_END):], "section"
                if out:
                    self.calls[-1].arguments += out
                    deltas.append(ToolCallDelta(len(self.calls) - 1, arguments=out))
                if i < 0:
                    break
        return content, _merge(deltas)

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """End of output: held-back text is released (content, or a cut-off call's
        arguments)."""
        rest, self.buf = self.buf, ""
        if self.state == "text":
            return rest, []
        if self.state == "args" and rest:
            self.calls[-1].arguments += rest
            return "", [ToolCallDelta(len(self.calls) - 1, arguments=rest)]
        return "", []


def _merge(deltas: list[ToolCallDelta]) -> list[ToolCallDelta]:
    out: list[ToolCallDelta] = []
    for d in deltas:
        if out and out[-1].index == d.index and d.id is None:
            out[-1].arguments += d.arguments
        else:
            out.append(d)
    return out


def parse_tool_calls(text: str) -> tuple[str, list[ToolCall]]:
    """Non-streaming: ``(content, calls)`` of a whole output (content = text outside the
    section(s), stripped of nothing)."""
    p = ToolStreamParser()
    content, _ = p.feed(text)
    rest, _ = p.finish()
    return content + rest, p.calls
