"""Tokenizers: the byte-level tokenizer of the embedded model, or a folder's ``tokenizer.json``.

``get_tokenizer(name_or_dir)`` picks one:

=====================================================  =========================================
``name_or_dir``                                        tokenizer
=====================================================  =========================================
``None``, ``""``, ``"byte"``                           :class:`ByteTokenizer`
a preset name (``"k3-tiny"``, ``"k3-mini"``, ``"k3"``)  :class:`ByteTokenizer` (presets carry no
                                                       weights; byte ids fit every preset's
                                                       vocabulary)
a folder with ``tokenizer.json``                       :class:`HFTokenizer` (``tokenizers``)
a folder without one whose config has vocab 272        :class:`ByteTokenizer` (the embedded
                                                       ``k3serve/assets/k3-tiny`` is one)
=====================================================  =========================================

Both implement :class:`Tokenizer`. This package never imports torch (the router imports it).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol, runtime_checkable

from k3serve.tokenizer.byte import (
    BOS_ID,
    EOS_ID,
    IM_END_ID,
    IM_START_ID,
    PAD_ID,
    SPECIAL_TOKENS,
    VOCAB_SIZE,
    ByteTokenizer,
)


@runtime_checkable
class Tokenizer(Protocol):
    """What the engine and the router need from a tokenizer. Calls never mutate it."""

    name: str
    bos_token_id: int | None
    eos_token_id: int | None
    pad_token_id: int | None

    @property
    def vocab_size(self) -> int: ...

    @property
    def stop_token_ids(self) -> tuple[int, ...]: ...

    def encode(self, text: str, add_bos: bool = False, parse_special: bool = False) -> list[int]:
        ...

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str: ...

    def decode_bytes(self, ids: Iterable[int], skip_special_tokens: bool = True) -> bytes: ...

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, object]],
        add_generation_prompt: bool = True,
        tokenize: bool = True,
        tools: Sequence[Mapping[str, object]] | None = None,
    ) -> list[int] | str: ...


def _folder_vocab(folder: str) -> int | None:
    for fname in ("k3serve_config.json", "config.json"):
        path = os.path.join(folder, fname)
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                cfg = json.load(f)
            if "text_config" in cfg:
                cfg = cfg["text_config"]
            v = cfg.get("vocab_size")
            return int(v) if v is not None else None
    return None


def get_tokenizer(name_or_dir: str | os.PathLike[str] | None = None) -> Tokenizer:
    """The tokenizer for a model name or checkpoint folder (table in the module docstring).

    Raises:
        ValueError: a folder with neither ``tokenizer.json`` nor a vocab-272 config, a preset
            whose vocabulary is not the byte tokenizer's (it ships no tokenizer: sampled ids could
            not be decoded), or a name that is neither a preset nor a folder.
    """
    if name_or_dir is None or str(name_or_dir) in ("", "byte"):
        return ByteTokenizer()
    path = os.fspath(name_or_dir)
    if os.path.isdir(path):
        if os.path.exists(os.path.join(path, "tokenizer.json")):
            from k3serve.tokenizer.hf import HFTokenizer

            return HFTokenizer(path)
        vocab = _folder_vocab(path)
        if vocab == VOCAB_SIZE:
            return ByteTokenizer()
        raise ValueError(
            f"tokenizer: folder {path!r} has no tokenizer.json and its vocabulary ({vocab}) is "
            f"not the byte tokenizer's ({VOCAB_SIZE})"
        )
    from k3serve.config import PRESETS

    if path in PRESETS:
        if PRESETS[path].vocab_size != VOCAB_SIZE:
            raise ValueError(
                f"tokenizer: preset {path!r} (vocabulary {PRESETS[path].vocab_size}) ships no "
                f"tokenizer and the byte tokenizer covers only {VOCAB_SIZE} ids; load a "
                "checkpoint folder with tokenizer.json or pass a tokenizer"
            )
        return ByteTokenizer()
    raise ValueError(
        f"tokenizer: {path!r} is neither a preset {sorted(PRESETS)} nor a folder; "
        "use 'byte' for the byte-level tokenizer"
    )


__all__ = [
    "BOS_ID",
    "EOS_ID",
    "IM_END_ID",
    "IM_START_ID",
    "PAD_ID",
    "SPECIAL_TOKENS",
    "VOCAB_SIZE",
    "ByteTokenizer",
    "Tokenizer",
    "get_tokenizer",
]


def __getattr__(name: str) -> object:
    """Lazy ``HFTokenizer`` (loads the ``tokenizers`` extension only when asked for)."""
    if name == "HFTokenizer":
        from k3serve.tokenizer.hf import HFTokenizer

        return HFTokenizer
    raise AttributeError(f"module 'k3serve.tokenizer' has no attribute {name!r}")
