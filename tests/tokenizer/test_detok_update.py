"""``IncrementalDetokenizer.update`` (a batch of tokens at once, the router's relay) against
``step`` on each token: the same text, finish, stop reason and tokens consumed, for random
batches of the byte tokenizer (multi-byte and cut UTF-8, specials, EOS, stop ids, lengths)
and of two trained HF tokenizers (byte-level BPE; a sentencepiece-style Metaspace one)."""

from __future__ import annotations

import random

import pytest

from k3serve.sampling import SamplingParams
from k3serve.tokenizer.byte import ByteTokenizer
from k3serve.tokenizer.detok import IncrementalDetokenizer

BYTE = ByteTokenizer()
EOS = BYTE.eos_token_id
TEXT = ("héllo wörld — naïve café ✓ 日本語のテキスト 🙂 emoji, ascii words and more words; "
        "def f(x):\n    return x * 2\n") * 3


class HF:
    """A ``tokenizers.Tokenizer`` as a detokenizer's decoder."""

    def __init__(self, tok) -> None:
        self.tok = tok

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


def _hf(kind: str) -> tuple[HF, list[int]]:
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    if kind == "bytelevel":
        tok = tokenizers.Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    else:
        tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                         decoders.Fuse(), decoders.Strip(" ", 1, 0)])
        alphabet = [f"<0x{b:02X}>" for b in range(256)]
    tok.train_from_iterator([TEXT] * 4, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<unk>", "<eos>"], initial_alphabet=alphabet,
        show_progress=False))
    return HF(tok), tok.encode(TEXT).ids


@pytest.fixture
def bulk(monkeypatch):
    """Counts the runs ``update`` decoded at once (the path under test must be taken)."""
    seen = {"runs": 0}
    extend = IncrementalDetokenizer._extend

    def counted(self, run):
        out = extend(self, run)
        seen["runs"] += out is not None
        return out

    monkeypatch.setattr(IncrementalDetokenizer, "_extend", counted)
    return seen


def _run(tok, ids, params, eos, batches):
    one = IncrementalDetokenizer(tok, params, eos_token_id=eos)
    texts = []
    for t in ids:
        o = one.step(t)
        texts.append(o.new_text)
        if o.finished:
            break
    many = IncrementalDetokenizer(tok, params, eos_token_id=eos)
    got, i = [], 0
    for n in batches:
        if many.finished or i >= len(ids):
            break
        before = many.num_tokens
        o = many.update(ids[i:i + n])
        got.append(o.new_text)
        assert many.num_tokens - before <= n
        # each update's text (one client chunk) is what the steps over its tokens emitted
        assert o.new_text == "".join(texts[before:many.num_tokens])
        i += n
    rest = [many.finish("abort").new_text, one.finish("abort").new_text]
    assert "".join(got) + rest[0] == "".join(texts) + rest[1]
    assert many.token_ids == one.token_ids
    assert (many.finish_reason, many.stop_reason) == (one.finish_reason, one.stop_reason)


def _params(rng: random.Random, eos_ids: list[int]) -> SamplingParams:
    kw = {"max_tokens": rng.choice([None, 5, 17, 60, 400])}
    if rng.random() < 0.3:
        kw["stop_token_ids"] = rng.sample(eos_ids, 1)
    if rng.random() < 0.2:
        kw["stop"] = [rng.choice(["wor", "é", "\n  ", "xyz"])]
    kw["skip_special_tokens"] = rng.random() < 0.7
    kw["include_stop_str_in_output"] = rng.random() < 0.2
    kw["ignore_eos"] = rng.random() < 0.2
    return SamplingParams(**kw)


def test_update_equals_step_byte_tokenizer(bulk):
    rng = random.Random(0)
    base = list(TEXT.encode())
    for _ in range(400):
        k = rng.randrange(0, len(base) - 80)
        ids = base[k:k + rng.randrange(1, 80)]
        for _ in range(rng.randrange(0, 3)):  # specials and EOS in the middle
            ids.insert(rng.randrange(len(ids) + 1), rng.choice([EOS, 256, 257, 258]))
        if rng.random() < 0.3:  # a cut multi-byte character at the end
            ids.append(0xE6)
        batches = [rng.randrange(1, 9) for _ in range(len(ids))]
        _run(BYTE, ids, _params(rng, [EOS, 97, 0xA9]), EOS, batches)
    assert bulk["runs"] > 500


@pytest.mark.parametrize("kind", ["bytelevel", "metaspace"])
def test_update_equals_step_hf_tokenizers(kind, bulk):
    tok, base = _hf(kind)
    eos = tok.tok.token_to_id("<eos>")
    rng = random.Random(1)
    for _ in range(200):
        k = rng.randrange(0, len(base) - 40)
        ids = base[k:k + rng.randrange(1, 40)]
        if rng.random() < 0.3:
            ids.insert(rng.randrange(len(ids) + 1), eos)
        batches = [rng.randrange(1, 9) for _ in range(len(ids))]
        _run(tok, ids, _params(rng, [eos, ids[0]]), eos, batches)
    assert bulk["runs"] > 200


def test_a_decode_error_in_a_run_feeds_nothing():
    """An id the tokenizer refuses (raises in ``decode``) leaves the detokenizer as it was:
    the run is not half fed (its ids and its token count stay in step)."""
    det = IncrementalDetokenizer(BYTE, SamplingParams(max_tokens=50), eos_token_id=EOS)
    with pytest.raises(ValueError, match="outside the byte vocabulary"):
        det.update([97, 98, 10_000])
    assert det.num_tokens == 0 and det.text == ""
    assert det.update([97, 98]).new_text == "ab" and det.token_ids == [97, 98]
