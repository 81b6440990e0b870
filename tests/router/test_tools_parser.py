"""The Kimi K2/K3 tool-call parser on recorded texts: single, parallel, interleaved with text,
cut off (argument text held back as a possible end marker included), whitespace around a
header; streaming split at every byte boundary (through an incremental UTF-8 decoder, as the
detokenizer delivers text) gives exactly the same calls and content as the non-streaming
parse."""

from __future__ import annotations

import codecs

import pytest

from router.tools import ToolCall, ToolStreamParser, parse_tool_calls

S, E = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CB, AB, CE = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"


def call(name: str, idx: int, args: str) -> str:
    return f"{CB}functions.{name}:{idx}{AB}{args}{CE}"


CITY, XS, Y, Q = '{"city": "Paris"}', '{"x": [1, 2]}', '{"y": "<|"}', '{"q": "é"}'

CASES = [
    pytest.param(f"{S}{call('get_weather', 0, CITY)}{E}", "",
                 [ToolCall("functions.get_weather:0", "get_weather", '{"city": "Paris"}')],
                 id="single"),
    pytest.param(f"{S}{call('a', 0, '{}')}{call('b.c', 1, XS)}"
                 f"{call('a', 2, Y)}{E}", "",
                 [ToolCall("functions.a:0", "a", "{}"),
                  ToolCall("functions.b.c:1", "b.c", '{"x": [1, 2]}'),
                  ToolCall("functions.a:2", "a", '{"y": "<|"}')], id="parallel"),
    pytest.param(f"Let me check 天气 <| first.\n{S}\n{call('f', 3, Q)}\n{E}"
                 " and after.", "Let me check 天气 <| first.\n and after.",
                 [ToolCall("functions.f:3", "f", '{"q": "é"}')], id="interleaved"),
    pytest.param("plain text, no calls <|tool_calls", "plain text, no calls <|tool_calls", [],
                 id="no-calls-held-prefix-released"),
    pytest.param(f"x{S}{call('f', 0, '{}')}{CB}functions.g:1{AB}{{\"a\": 1", "x",
                 [ToolCall("functions.f:0", "f", "{}"),
                  ToolCall("functions.g:1", "g", '{"a": 1')], id="cut-off"),
    # cut off while the arguments end in what may become <|tool_call_end|>: the held-back
    # text is still the call's argument text
    pytest.param(f"{S}{CB}functions.f:0{AB}{{\"s\": \"a<|tool_c", "",
                 [ToolCall("functions.f:0", "f", '{"s": "a<|tool_c')], id="cut-off-held-tail"),
    pytest.param(f"{S}{CB}functions.f:0{AB}{{\"s\": \"<", "",
                 [ToolCall("functions.f:0", "f", '{"s": "<')], id="cut-off-held-lt"),
    # whitespace around the header (vLLM's kimi_k2 pattern allows it): id and name stripped
    pytest.param(f"{S}\n{CB} functions.get_weather:0 \n{AB}{CITY}{CE}\n{E}", "",
                 [ToolCall("functions.get_weather:0", "get_weather", CITY)],
                 id="header-whitespace"),
    pytest.param(f"{S}{call('f', 0, '{}')}{E}mid{S}{call('g', 1, '[]')}{E}", "mid",
                 [ToolCall("functions.f:0", "f", "{}"), ToolCall("functions.g:1", "g", "[]")],
                 id="two-sections"),
]


@pytest.mark.parametrize("text, content, calls", CASES)
def test_non_streaming(text, content, calls):
    assert parse_tool_calls(text) == (content, calls)


def _stream(pieces: list[bytes]) -> tuple[str, dict[int, list]]:
    dec = codecs.getincrementaldecoder("utf-8")()
    p = ToolStreamParser()
    content, calls = "", {}
    outs = [p.feed(dec.decode(b)) for b in pieces] + [p.feed(dec.decode(b"", final=True)),
                                                       p.finish()]
    for c, deltas in outs:
        content += c
        for d in deltas:
            if d.index not in calls:
                assert d.id is not None and d.name is not None, d  # first piece names it
                assert d.index == len(calls), d  # calls open in order
                calls[d.index] = [d.id, d.name, ""]
            else:
                assert d.id is None and d.name is None, d
            calls[d.index][2] += d.arguments
    return content, calls


@pytest.mark.parametrize("text, content, calls", CASES)
def test_streaming_split_at_every_byte_boundary(text, content, calls):
    data = text.encode()
    want = {k: [c.id, c.name, c.arguments] for k, c in enumerate(calls)}
    for k in range(len(data) + 1):
        assert _stream([data[:k], data[k:]]) == (content, want), k
    assert _stream([data[i:i + 1] for i in range(len(data))]) == (content, want)


def test_argument_fragments_stream_before_the_call_ends():
    p = ToolStreamParser()
    _, d1 = p.feed(f"{S}{CB}functions.f:0{AB}" + '{"a": ')
    assert [(d.index, d.id, d.name, d.arguments) for d in d1] == [
        (0, "functions.f:0", "f", '{"a": ')]
    _, d2 = p.feed("1}<|tool_c")
    assert [d.arguments for d in d2] == ["1}"]  # "<|tool_c" held: it may become the end
    _, d3 = p.feed("all_end|>")
    assert d3 == [] and p.calls[0].arguments == '{"a": 1}'
