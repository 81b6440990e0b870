"""A checkpoint folder's ``tokenizer.json``, through the ``tokenizers`` library, with the same
interface as :class:`k3serve.tokenizer.byte.ByteTokenizer`.

Files read from the folder:

* ``tokenizer.json`` (required): the tokenizer itself.
* ``tokenizer_config.json`` (optional): ``bos_token`` / ``eos_token`` / ``pad_token`` (a string
  or ``{"content": …}``) and ``chat_template`` (a Jinja string, or Hugging Face's list of
  ``{"name", "template"}`` where ``"default"`` is taken).
* ``config.json`` / ``generation_config.json`` (optional): ``bos_token_id`` / ``eos_token_id``
  when the tokenizer config names none.

Chat template: rendered with ``jinja2`` (sandboxed, the same variables Hugging Face passes:
``messages``, ``add_generation_prompt``, ``bos_token``, ``eos_token``, ``raise_exception``,
``strftime_now``) when both the template and ``jinja2`` are present. Otherwise the documented
fallback is ChatML: ``<|im_start|>{role}\\n{content}<|im_end|>\\n`` per message and
``<|im_start|>assistant\\n`` for the generation prompt, with ``<|im_start|>`` / ``<|im_end|>``
as single ids when the vocabulary has them and as plain text when it does not.

Pure Python plus ``tokenizers`` (a Rust extension): no torch.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Iterable, Mapping, Sequence
from functools import lru_cache
from typing import Any

from k3serve.tokenizer.byte import content_text


@lru_cache(maxsize=1)
def _unicode_to_byte() -> dict[str, int]:
    """Inverse of GPT-2's ``bytes_to_unicode`` table used by the ``ByteLevel`` pre-tokenizer."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def _token_text(v: Any) -> str | None:
    if isinstance(v, str):
        return v
    if isinstance(v, Mapping) and isinstance(v.get("content"), str):
        return v["content"]
    return None


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}


def _has_byte_level_decoder(spec: Mapping[str, Any] | None) -> bool:
    if not spec:
        return False
    if spec.get("type") == "ByteLevel":
        return True
    if spec.get("type") == "Sequence":
        return any(_has_byte_level_decoder(d) for d in spec.get("decoders", []))
    return False


class HFTokenizer:
    """``tokenizers.Tokenizer`` from a folder, wrapped to :class:`ByteTokenizer`'s interface.

    Args:
        folder: a directory holding ``tokenizer.json`` (and optionally the files listed in the
            module docstring).

    Raises:
        FileNotFoundError: no ``tokenizer.json`` in ``folder``.
    """

    def __init__(self, folder: str) -> None:
        from tokenizers import Tokenizer

        path = os.path.join(folder, "tokenizer.json")
        if not os.path.exists(path):
            raise FileNotFoundError(f"tokenizer: no tokenizer.json in {folder!r}")
        self.name = os.path.basename(os.path.normpath(folder))
        with open(path, encoding="utf-8") as f:
            raw = f.read()
        spec = json.loads(raw)
        # Two instances so that neither mutates a shared flag per call (thread safety):
        # _tok matches special-token spellings in text; _plain treats them as ordinary text.
        self._tok = Tokenizer.from_str(raw)
        self._plain = Tokenizer.from_str(raw)
        self._plain.encode_special_tokens = True
        self._byte_level = _has_byte_level_decoder(spec.get("decoder"))
        self._added_special = {
            int(t["id"]): t["content"] for t in spec.get("added_tokens", []) if t.get("special")
        }

        cfg = _read_json(os.path.join(folder, "tokenizer_config.json"))
        model_cfg = {**_read_json(os.path.join(folder, "config.json")),
                     **_read_json(os.path.join(folder, "generation_config.json"))}
        self.bos_token_id = self._special_id(cfg.get("bos_token"), model_cfg.get("bos_token_id"))
        self.eos_token_id = self._special_id(cfg.get("eos_token"), model_cfg.get("eos_token_id"))
        self.pad_token_id = self._special_id(cfg.get("pad_token"), model_cfg.get("pad_token_id"))
        self.bos_token = None if self.bos_token_id is None else self._tok.id_to_token(self.bos_token_id)
        self.eos_token = None if self.eos_token_id is None else self._tok.id_to_token(self.eos_token_id)

        tmpl = cfg.get("chat_template")
        if isinstance(tmpl, list):  # [{"name": "default", "template": "..."}, ...]
            named = {t.get("name"): t.get("template") for t in tmpl if isinstance(t, Mapping)}
            tmpl = named.get("default") or next(iter(named.values()), None)
        self.chat_template: str | None = tmpl if isinstance(tmpl, str) else None
        self._im_start = self._tok.token_to_id("<|im_start|>")
        self._im_end = self._tok.token_to_id("<|im_end|>")

    def _special_id(self, token: Any, fallback_id: Any) -> int | None:
        text = _token_text(token)
        if text is not None:
            i = self._tok.token_to_id(text)
            if i is not None:
                return int(i)
        if isinstance(fallback_id, list):
            fallback_id = fallback_id[0] if fallback_id else None
        return int(fallback_id) if isinstance(fallback_id, int) else None

    # ------------------------------------------------------------------ properties
    @property
    def vocab_size(self) -> int:
        """Vocabulary size including added tokens."""
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    @property
    def special_tokens(self) -> dict[str, int]:
        """Special (added) token string → id."""
        return {s: i for i, s in self._added_special.items()}

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """Ids that end a generation: eos, and ``<|im_end|>`` when the vocabulary has it."""
        ids = [i for i in (self.eos_token_id, self._im_end) if i is not None]
        return tuple(dict.fromkeys(ids))

    # ------------------------------------------------------------------ encode / decode
    def encode(self, text: str, add_bos: bool = False, parse_special: bool = False) -> list[int]:
        """Token ids of ``text`` (the tokenizer's own post-processor is not applied).

        Args:
            text: the text.
            add_bos: prepend ``bos_token_id`` (ignored when the tokenizer has none).
            parse_special: match special-token spellings in ``text`` to their ids; off by
                default, so user text cannot forge them.
        """
        tok = self._tok if parse_special else self._plain
        ids = list(tok.encode(text, add_special_tokens=False).ids)
        if add_bos and self.bos_token_id is not None:
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids`` (incomplete UTF-8 from byte-level tokens becomes U+FFFD)."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def decode_bytes(self, ids: Iterable[int], skip_special_tokens: bool = True) -> bytes:
        """Bytes of ``ids``. Exact for ``ByteLevel`` tokenizers (GPT-2 style: partial UTF-8
        sequences survive, so a streaming detokenizer can join chunks); for other decoders,
        the UTF-8 encoding of :meth:`decode`.
        """
        ids = [int(i) for i in ids]
        if not self._byte_level:
            return self.decode(ids, skip_special_tokens).encode("utf-8")
        table = _unicode_to_byte()
        out = bytearray()
        for i in ids:
            if i in self._added_special:
                if not skip_special_tokens:
                    out.extend(self._added_special[i].encode("utf-8"))
                continue
            tok = self._tok.id_to_token(i)
            if tok is None:
                raise ValueError(f"token id {i} outside the vocabulary [0, {self.vocab_size})")
            if all(ch in table for ch in tok):
                out.extend(table[ch] for ch in tok)
            else:  # a non-special added token stored as plain text
                out.extend(tok.encode("utf-8"))
        return bytes(out)

    def id_to_token(self, i: int) -> str | None:
        return self._tok.id_to_token(int(i))

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    # ------------------------------------------------------------------ chat
    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, object]],
        add_generation_prompt: bool = True,
        tokenize: bool = True,
        tools: Sequence[Mapping[str, object]] | None = None,
    ) -> list[int] | str:
        """Render a conversation (see the module docstring for which template is used).

        ``tools`` (OpenAI tool definitions) reach the Jinja template as ``tools`` (``None``
        when absent), as ``transformers`` passes them; messages keep their ``tool_calls`` /
        ``tool_call_id``. The ChatML fallback renders neither (a folder that serves tools
        needs a template that knows its format).

        Returns:
            ids (``tokenize=True``) or the rendered string.

        Raises:
            ValueError: a message without a string role, or non-text content (fallback path);
                whatever the Jinja template raises through ``raise_exception``.
        """
        if self.chat_template is not None:
            try:
                import jinja2  # noqa: F401
            except ImportError:
                warnings.warn("jinja2 is not installed: using the ChatML fallback template",
                              stacklevel=2)
            else:
                text = _render_jinja(self.chat_template, messages, add_generation_prompt,
                                     self.bos_token, self.eos_token, tools)
                return self.encode(text, parse_special=True) if tokenize else text
        return self._chatml(messages, add_generation_prompt, tokenize)

    def _chatml(self, messages: Sequence[Mapping[str, object]], add_generation_prompt: bool,
                tokenize: bool) -> list[int] | str:
        start, end = "<|im_start|>", "<|im_end|>"
        ids: list[int] = []

        def marker(tok_id: int | None, spelling: str) -> None:
            ids.extend([tok_id] if tok_id is not None else self.encode(spelling))

        for msg in messages:
            role = msg.get("role")
            if not isinstance(role, str) or not role:
                raise ValueError(f"chat message needs a non-empty string 'role': {msg!r}")
            marker(self._im_start, start)
            ids.extend(self.encode(f"{role}\n{content_text(msg.get('content'))}"))
            marker(self._im_end, end)
            ids.extend(self.encode("\n"))
        if add_generation_prompt:
            marker(self._im_start, start)
            ids.extend(self.encode("assistant\n"))
        return ids if tokenize else self.decode(ids, skip_special_tokens=False)

    def __repr__(self) -> str:
        return (f"HFTokenizer({self.name!r}, vocab_size={self.vocab_size}, "
                f"bos={self.bos_token_id}, eos={self.eos_token_id})")


def _render_jinja(template: str, messages: Sequence[Mapping[str, object]],
                  add_generation_prompt: bool, bos_token: str | None,
                  eos_token: str | None,
                  tools: Sequence[Mapping[str, object]] | None = None) -> str:
    """Render a Hugging Face chat template the way ``transformers`` does (sandboxed)."""
    from datetime import datetime

    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise ValueError(f"chat template: {message}")

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: Any = None, sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template).render(
        messages=[dict(m) for m in messages],
        tools=None if tools is None else [dict(t) for t in tools],
        add_generation_prompt=add_generation_prompt,
        bos_token=bos_token or "",
        eos_token=eos_token or "",
    )
