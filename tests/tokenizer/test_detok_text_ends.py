"""``IncrementalDetokenizer.text_ends``: the record of the text each token released, from
which the decode worker sends per-token text (``decode.stream.token_texts``)."""

from __future__ import annotations

import pytest

from decode.stream import token_texts
from k3serve.sampling import SamplingParams
from k3serve.tokenizer import ByteTokenizer
from k3serve.tokenizer.detok import IncrementalDetokenizer

TOK = ByteTokenizer()


@pytest.mark.parametrize("stop", [(), ("lo w",), ("xyz",)])
def test_text_ends_split_the_text_as_the_steps_released_it(stop):
    ids = list("hello world, héllo wxy".encode())
    det = IncrementalDetokenizer(TOK, SamplingParams(max_tokens=100, stop=stop))
    pieces = []
    for t in ids:
        o = det.step(t)
        pieces.append(o.new_text)
        if o.finished:
            break
    assert len(det.text_ends) == det.num_tokens == len(pieces)
    assert token_texts(det.text, det.text_ends, 0) == pieces
    for k in range(1, len(pieces)):  # any split point, as events of several tokens
        assert token_texts(det.text, det.text_ends[k:], len("".join(pieces[:k]))) == pieces[k:]


def test_a_finish_flush_goes_to_the_last_token():
    det = IncrementalDetokenizer(TOK, SamplingParams(max_tokens=100, stop=("xyz",)))
    for t in b"ax":
        det.step(t)
    assert det.text == "a" and det.text_ends == [1, 1]
    assert det.finish("abort").new_text == "x"
    assert det.text_ends == [1, 2] and token_texts(det.text, det.text_ends, 0) == ["a", "x"]


def test_a_batched_run_gives_its_text_to_its_last_token():
    det = IncrementalDetokenizer(TOK, SamplingParams(max_tokens=100))
    det.update(list(b"hello"))
    assert det.text == "hello" and det.text_ends == [0, 0, 0, 0, 5]
