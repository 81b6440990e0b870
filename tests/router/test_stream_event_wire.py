"""The decode stream's event has one definition, :class:`k3serve.messages.StreamEvent`; the
router's fast decoder (:data:`router.sse.StreamEventWire`) is derived from it, so the two
accept and refuse the same payloads with the same values, and a field added to the message
reaches the relay without a second edit."""

from __future__ import annotations

import msgspec
import pytest
from pydantic import ValidationError

from k3serve.messages import StreamEvent, TokenLogprob
from router.sse import StreamEventWire, decode_event, wire_struct

GOOD = [
    b'{}',
    b'{"token_ids":[5,6],"text":"ab","logprobs":[{"logprob":-0.5,"top_logprobs":[[1,-0.2],'
    b'[2,null]]},{"logprob":null}]}',
    b'{"token_ids":[7],"finish_reason":"stop","unknown":1}',
    b'{"error":"engine error","finish_reason":"abort"}',
    b'{"token_ids":[],"text":"\\u00e9","logprobs":[]}',
]
BAD = [
    b'{"token_ids":[true]}', b'{"token_ids":["1"]}', b'{"token_ids":[1.5]}',
    b'{"finish_reason":"done"}', b'{"logprobs":[{"top_logprobs":[[1.5,0]]}]}',
    b'{"text":3}', b'[1]', b'not json',
]


def _plain(x):
    """A decoded event as JSON values (tuples as lists)."""
    return msgspec.json.decode(msgspec.json.encode(x) if isinstance(x, msgspec.Struct)
                               else x.model_dump_json())


def test_the_wire_struct_has_the_message_fields_and_defaults():
    for model in (StreamEvent, TokenLogprob):
        s = wire_struct(model)
        assert s.__struct_fields__ == tuple(model.model_fields)
        assert msgspec.to_builtins(s()) == model().model_dump(mode="json")
    assert StreamEventWire is wire_struct(StreamEvent)


@pytest.mark.parametrize("data", GOOD)
def test_both_decode_the_same_values(data):
    assert _plain(decode_event(data)) == _plain(StreamEvent.model_validate_json(data))


@pytest.mark.parametrize("data", BAD)
def test_both_refuse(data):
    with pytest.raises(ValueError):
        decode_event(data)
    with pytest.raises(ValidationError):
        StreamEvent.model_validate_json(data)


def test_what_the_decode_worker_writes_is_read_back():
    from decode.stream import sse

    ev = StreamEvent(token_ids=[3, 4], text="xy", finish_reason="length",
                     logprobs=[TokenLogprob(logprob=-1.0, top_logprobs=[(3, -1.0)]),
                               TokenLogprob(logprob=None)])
    got = decode_event(sse(ev).data.encode())
    assert _plain(got) == _plain(ev)
