"""Tokenizers: the byte-level one of the embedded model and the ``tokenizers``-library path."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from k3serve.config import PRESETS, TINY_VOCAB
from k3serve.tokenizer import (
    BOS_ID,
    EOS_ID,
    IM_END_ID,
    IM_START_ID,
    PAD_ID,
    SPECIAL_TOKENS,
    ByteTokenizer,
    Tokenizer,
    get_tokenizer,
)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TEXTS = [
    "",
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n",
    "héllo wörld — ünïcödé",  # 2- and 3-byte sequences
    "中文字符 and 日本語",  # 3-byte CJK
    "emoji 🐍🚀 4-byte",  # 4-byte sequences
    "\x00\t\r\n\x7f control",
    "a literal <|im_end|> stays text",
]


# ---------------------------------------------------------------------------- byte tokenizer
@pytest.mark.parametrize("text", TEXTS)
def test_byte_round_trip_and_ids_are_utf8_bytes(text: str) -> None:
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert all(0 <= i < 256 for i in ids)
    assert tok.decode(ids) == text
    assert tok.decode_bytes(ids) == text.encode("utf-8")
    assert tok.encode(text, add_bos=True) == [BOS_ID, *ids]
    assert tok.decode(tok.encode(text, add_bos=True)) == text  # bos skipped


def test_byte_vocab_matches_k3_tiny_preset() -> None:
    tok = ByteTokenizer()
    cfg = PRESETS["k3-tiny"]
    assert tok.vocab_size == TINY_VOCAB == cfg.vocab_size == 272
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (256, 257, 258)
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (BOS_ID, EOS_ID, PAD_ID)
    assert (IM_START_ID, IM_END_ID) == (259, 260)
    assert len(SPECIAL_TOKENS) == 16 and len(set(SPECIAL_TOKENS)) == 16
    assert tok.special_tokens["<|assistant|>"] == 263
    assert max(tok.special_tokens.values()) == 271
    assert EOS_ID in tok.stop_token_ids and IM_END_ID in tok.stop_token_ids
    assert isinstance(tok, Tokenizer)


def test_byte_specials_parse_only_when_asked_and_decode_both_ways() -> None:
    tok = ByteTokenizer()
    text = "<|bos|>x<|im_start|>user\nhi<|im_end|><|eos|>"
    assert tok.encode(text) == list(text.encode())  # user text cannot forge specials
    ids = tok.encode(text, parse_special=True)
    assert ids == [256, ord("x"), 259, *b"user\nhi", 260, 257]
    assert tok.decode(ids) == "xuser\nhi"
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.decode_bytes(ids, skip_special_tokens=False) == text.encode()
    # Every special round-trips through its spelling.
    for i, s in enumerate(SPECIAL_TOKENS):
        assert tok.encode(s, parse_special=True) == [256 + i]
        assert tok.id_to_token(256 + i) == s
        assert tok.token_to_id(s) == 256 + i
    assert tok.id_to_token(0x41) == "<0x41>" and tok.token_to_id("<0x41>") == 0x41


def test_byte_decode_invalid_utf8_replaces_and_bad_id_raises() -> None:
    tok = ByteTokenizer()
    snake = "🐍".encode()
    assert len(snake) == 4
    # A cut multi-byte character: replacement, bytes exact.
    assert tok.decode(list(snake[:2])) == "\ufffd"
    assert tok.decode_bytes(list(snake[:2])) == snake[:2]
    # Joined partial chunks decode to the character (what a streaming detokenizer does).
    assert (tok.decode_bytes(list(snake[:3])) + tok.decode_bytes(list(snake[3:]))).decode() == "🐍"
    assert tok.decode([0xFF, ord("a")]) == "\ufffda"
    with pytest.raises(ValueError, match="outside"):
        tok.decode([272])
    with pytest.raises(ValueError, match="outside"):
        tok.decode([-1])


def test_byte_chat_template_is_chatml_with_special_ids() -> None:
    tok = ByteTokenizer()
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi <|im_end|> ünï"},
        {"role": "assistant", "content": [{"type": "text", "text": "Hello"}]},
    ]
    text = tok.apply_chat_template(msgs, tokenize=False)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi <|im_end|> ünï<|im_end|>\n"
        "<|im_start|>assistant\nHello<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    ids = tok.apply_chat_template(msgs)
    assert isinstance(ids, list)
    assert ids[:1] == [IM_START_ID] and ids[-len(b"assistant\n") - 1 :] == [
        IM_START_ID,
        *b"assistant\n",
    ]
    # The literal "<|im_end|>" the user typed stays bytes: exactly 3 real message ends.
    assert ids.count(IM_END_ID) == 3 and ids.count(IM_START_ID) == 4
    assert tok.decode(ids, skip_special_tokens=False) == text
    no_prompt = tok.apply_chat_template(msgs[:1], add_generation_prompt=False)
    assert no_prompt == [IM_START_ID, *b"system\nBe brief.", IM_END_ID, ord("\n")]
    with pytest.raises(ValueError, match="role"):
        tok.apply_chat_template([{"content": "x"}])
    with pytest.raises(ValueError, match="content"):
        tok.apply_chat_template([{"role": "user", "content": [{"type": "image_url"}]}])


def test_get_tokenizer_resolution(tmp_path) -> None:
    for name in (None, "", "byte", "k3-tiny"):
        assert isinstance(get_tokenizer(name), ByteTokenizer)
    for name in ("k3-mini", "k3"):  # vocabularies the byte tokenizer can't decode
        with pytest.raises(ValueError, match="ships no tokenizer"):
            get_tokenizer(name)
    ours = tmp_path / "ours"
    ours.mkdir()
    (ours / "k3serve_config.json").write_text(json.dumps(PRESETS["k3-tiny"].to_dict()))
    assert isinstance(get_tokenizer(str(ours)), ByteTokenizer)
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"vocab_size": 32000}))
    with pytest.raises(ValueError, match="tokenizer.json"):
        get_tokenizer(str(other))
    with pytest.raises(ValueError, match="neither a preset"):
        get_tokenizer("no-such-model")


# ---------------------------------------------------------------------------- tokenizers library
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'user' %}[U]{{ m['content'] }}{{ eos_token }}"
    "{% elif m['role'] == 'assistant' %}[A]{{ m['content'] }}{{ eos_token }}"
    "{% else %}{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}[A]{% endif %}"
)


def _build_hf_folder(folder, chat_template: str | None = CHAT_TEMPLATE) -> None:
    """A tiny byte-level BPE trained here with the ``tokenizers`` library."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = [t for t in TEXTS if t] * 20 + ["def main():\n    print('hello world')\n"] * 50
    tok.train_from_iterator(corpus, trainer=trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    cfg = {"bos_token": "<s>", "eos_token": {"content": "</s>"}, "pad_token": "<pad>"}
    if chat_template is not None:
        cfg["chat_template"] = chat_template
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf_tok")
    _build_hf_folder(folder)
    return folder


def test_hf_round_trip_specials_and_bytes(hf_folder) -> None:
    from k3serve.tokenizer.hf import HFTokenizer

    tok = get_tokenizer(str(hf_folder))
    assert isinstance(tok, HFTokenizer) and isinstance(tok, Tokenizer)
    bos, eos = tok.token_to_id("<s>"), tok.token_to_id("</s>")
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (bos, eos, tok.token_to_id("<pad>"))
    from tokenizers import Tokenizer as RawTokenizer

    raw = RawTokenizer.from_file(str(hf_folder / "tokenizer.json"))
    assert tok.vocab_size == raw.get_vocab_size(with_added_tokens=True) > 256 + 5
    for text in TEXTS:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert tok.decode_bytes(ids) == text.encode()
    assert len(tok.encode("def main():")) < len("def main():")  # merges were learned
    assert tok.encode("hi", add_bos=True)[0] == bos
    # Specials: plain text by default, ids when asked.
    s = "x</s>y"
    assert eos not in tok.encode(s)
    assert eos in tok.encode(s, parse_special=True)
    assert tok.decode(tok.encode(s, parse_special=True)) == "xy"
    assert tok.decode(tok.encode(s, parse_special=True), skip_special_tokens=False) == s
    assert tok.decode_bytes(tok.encode(s, parse_special=True), skip_special_tokens=False) == s.encode()
    assert eos in tok.stop_token_ids and tok.token_to_id("<|im_end|>") in tok.stop_token_ids


def test_hf_decode_bytes_keeps_partial_utf8(hf_folder) -> None:
    tok = get_tokenizer(str(hf_folder))
    ids = tok.encode("🐍")
    # Without a merge for it, the 4-byte emoji spans several tokens: each prefix's bytes are a
    # prefix of the UTF-8 sequence (decode() would turn them into U+FFFD).
    assert len(ids) >= 2
    joined = b"".join(tok.decode_bytes([i]) for i in ids)
    assert joined == "🐍".encode()
    assert tok.decode(ids[:1]).endswith("\ufffd")


def test_hf_chat_template_jinja_and_fallback(hf_folder, tmp_path) -> None:
    tok = get_tokenizer(str(hf_folder))
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    text = tok.apply_chat_template(msgs, tokenize=False)
    assert text == "<s>[U]hi</s>[A]yo</s>[A]"
    ids = tok.apply_chat_template(msgs)
    assert ids[0] == tok.bos_token_id and ids.count(tok.eos_token_id) == 2
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.apply_chat_template(msgs, add_generation_prompt=False, tokenize=False).endswith("yo</s>")
    with pytest.raises(ValueError, match="unknown role system"):
        tok.apply_chat_template([{"role": "system", "content": "x"}])
    # No template in the folder: the ChatML fallback, with the vocabulary's im_start/im_end ids.
    plain = tmp_path / "plain"
    _build_hf_folder(plain, chat_template=None)
    tok2 = get_tokenizer(str(plain))
    out = tok2.apply_chat_template(msgs[:1], tokenize=False)
    assert out == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids2 = tok2.apply_chat_template(msgs[:1])
    assert ids2.count(tok2.token_to_id("<|im_start|>")) == 2
    assert ids2.count(tok2.token_to_id("<|im_end|>")) == 1


def _run_isolated(code: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], check=False,
                          capture_output=True,
                          text=True, env=env, timeout=120)


def test_hf_chat_template_without_jinja2_falls_back_to_chatml(hf_folder) -> None:
    r = _run_isolated(f"""
        import sys, warnings
        sys.modules['jinja2'] = None
        from k3serve.tokenizer import get_tokenizer
        tok = get_tokenizer({str(hf_folder)!r})
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter('always')
            out = tok.apply_chat_template([{{'role': 'user', 'content': 'hi'}}], tokenize=False)
        assert out == '<|im_start|>user\\nhi<|im_end|>\\n<|im_start|>assistant\\n', out
        assert any('jinja2' in str(x.message) for x in w)
        print('ok')
    """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"


def test_tokenizer_imports_without_torch(hf_folder) -> None:
    r = _run_isolated(f"""
        import sys
        sys.modules['torch'] = None  # any 'import torch' now raises ImportError
        import k3serve.tokenizer
        from k3serve.tokenizer import get_tokenizer
        from k3serve.tokenizer.hf import HFTokenizer
        t = get_tokenizer('k3-tiny')
        assert t.decode(t.encode('ok ✓')) == 'ok ✓'
        h = get_tokenizer({str(hf_folder)!r})
        assert h.decode(h.encode('ok ✓')) == 'ok ✓'
        assert h.apply_chat_template([{{'role': 'user', 'content': 'x'}}])
        assert not any(m == 'torch' or m.startswith('torch.') for m in sys.modules
                       if sys.modules[m] is not None)
        print('ok')
    """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"


def test_preset_without_a_tokenizer_is_refused_at_startup():
    """k3-mini's 32768 ids can't be decoded by the byte tokenizer: refuse, don't fail mid-stream."""
    import pytest

    from k3serve.tokenizer import get_tokenizer

    with pytest.raises(ValueError, match="k3-mini.*ships no tokenizer"):
        get_tokenizer("k3-mini")
    assert get_tokenizer("k3-tiny").vocab_size == 272
