"""Byte-level tokenizer of the embedded model (``k3-tiny``, vocabulary 272).

Ids ``0..255`` are the bytes of the UTF-8 text; ids ``256..271`` are special tokens:

====  =================  ==================================================================
id    token              use
====  =================  ==================================================================
256   ``<|bos|>``        start of a document (training prefixes every file with it)
257   ``<|eos|>``        end of text: generation stops here
258   ``<|pad|>``        padding (never trained on)
259   ``<|im_start|>``   chat template: opens a message
260   ``<|im_end|>``     chat template: closes a message
261   ``<|system|>``     reserved role markers (the default template spells roles as text)
262   ``<|user|>``
263   ``<|assistant|>``
264   ``<|tool_call_argument_begin|>``  Kimi K2/K3 tool-call format (added tokens: 264 and
                         268–271 were reserved slots the model never saw in training)
265   ``<|fim_prefix|>`` reserved for fill-in-the-middle
266   ``<|fim_middle|>``
267   ``<|fim_suffix|>``
268   ``<|tool_calls_section_begin|>``
269   ``<|tool_calls_section_end|>``
270   ``<|tool_call_begin|>``
271   ``<|tool_call_end|>``
====  =================  ==================================================================

Tool calls (Kimi K2/K3, as vLLM's ``kimi_k2`` parser reads them)::

    <|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX
    <|tool_call_argument_begin|>{json}<|tool_call_end|>…<|tool_calls_section_end|>

Chat template (ChatML; specials are inserted as ids, message text is always plain bytes, so a
user who types ``<|im_end|>`` cannot forge a message boundary)::

    <|im_start|>system\\n# Tools\\n{tools as JSON}<|im_end|>\\n   (if tools; first, so it
                                                        stays a shared prefix across turns)
    <|im_start|>{role}\\n{content}{tool calls}<|im_end|>\\n   (one per message; an assistant's
                                                        tool_calls in the Kimi format above;
                                                        a tool message's role text is
                                                        ``tool:{tool_call_id}``)
    <|im_start|>assistant\\n                           (if add_generation_prompt)

Pure Python: imports neither torch nor numpy (the router imports this module).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence

NUM_BYTES = 256

SPECIAL_TOKENS: tuple[str, ...] = (
    "<|bos|>",
    "<|eos|>",
    "<|pad|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|tool_call_argument_begin|>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|tool_calls_section_begin|>",
    "<|tool_calls_section_end|>",
    "<|tool_call_begin|>",
    "<|tool_call_end|>",
)
"""Special tokens in id order, starting at id 256."""

VOCAB_SIZE = NUM_BYTES + len(SPECIAL_TOKENS)  # 272 == k3serve.config.TINY_VOCAB

BOS_ID = 256
EOS_ID = 257
PAD_ID = 258
IM_START_ID = 259
IM_END_ID = 260
TOOL_CALL_ARGUMENT_BEGIN_ID = 264
TOOL_CALLS_SECTION_BEGIN_ID = 268
TOOL_CALLS_SECTION_END_ID = 269
TOOL_CALL_BEGIN_ID = 270
TOOL_CALL_END_ID = 271

_SPECIAL_RE = re.compile("|".join(re.escape(s) for s in SPECIAL_TOKENS))


def content_text(content: object) -> str:
    """A message's content as text: a string, or OpenAI-style parts ``[{"type": "text", …}]``."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, Mapping) and part.get("type") == "text":
                parts.append(str(part.get("text", "")))
            elif isinstance(part, str):
                parts.append(part)
            else:
                raise ValueError(f"chat message: unsupported content part {part!r} (text only)")
        return "".join(parts)
    raise ValueError(f"chat message: content must be a string or a list of text parts, got {type(content).__name__}")


class ByteTokenizer:
    """UTF-8 bytes as ids 0–255 plus the special tokens of :data:`SPECIAL_TOKENS` from 256.

    The mapping is fixed (no files); every string round-trips exactly through
    :meth:`encode` / :meth:`decode`, and any id list decodes (invalid UTF-8 becomes U+FFFD).
    """

    name = "byte"
    vocab_size = VOCAB_SIZE
    bos_token_id = BOS_ID
    eos_token_id = EOS_ID
    pad_token_id = PAD_ID
    chat_template = (
        "<|im_start|>{role}\\n{content}<|im_end|>\\n per message, "
        "then <|im_start|>assistant\\n if add_generation_prompt"
    )

    @property
    def special_tokens(self) -> dict[str, int]:
        """Special token string → id."""
        return {s: NUM_BYTES + i for i, s in enumerate(SPECIAL_TOKENS)}

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """Ids that end a generation: end of text, and the end of a chat message."""
        return (EOS_ID, IM_END_ID)

    # ------------------------------------------------------------------ encode
    def encode(self, text: str, add_bos: bool = False, parse_special: bool = False) -> list[int]:
        """Token ids of ``text``.

        Args:
            text: any Python string (encoded as UTF-8; lone surrogates are rejected by UTF-8).
            add_bos: prepend ``<|bos|>`` (256).
            parse_special: map literal special-token strings in ``text`` (``"<|im_end|>"``) to
                their ids. Off by default: user text is bytes only.

        Returns:
            ``list[int]``, each in ``[0, 272)``.
        """
        ids: list[int] = [BOS_ID] if add_bos else []
        if not parse_special:
            ids.extend(text.encode("utf-8"))
            return ids
        pos = 0
        for m in _SPECIAL_RE.finditer(text):
            ids.extend(text[pos : m.start()].encode("utf-8"))
            ids.append(NUM_BYTES + SPECIAL_TOKENS.index(m.group(0)))
            pos = m.end()
        ids.extend(text[pos:].encode("utf-8"))
        return ids

    # ------------------------------------------------------------------ decode
    def decode_bytes(self, ids: Iterable[int], skip_special_tokens: bool = True) -> bytes:
        """The raw bytes of ``ids`` (a streaming detokenizer joins these and decodes complete
        UTF-8 sequences only). Special tokens become their UTF-8 spelling unless skipped.

        Raises:
            ValueError: an id outside ``[0, vocab_size)``.
        """
        if not isinstance(ids, list | tuple):
            ids = list(ids)
        try:  # every id a byte (the common case): one C call
            return bytes(ids)
        except (ValueError, TypeError):  # a special token, or an id to check one by one
            pass
        out = bytearray()
        for i in ids:
            i = int(i)
            if 0 <= i < NUM_BYTES:
                out.append(i)
            elif NUM_BYTES <= i < VOCAB_SIZE:
                if not skip_special_tokens:
                    out.extend(SPECIAL_TOKENS[i - NUM_BYTES].encode("utf-8"))
            else:
                raise ValueError(f"token id {i} outside the byte vocabulary [0, {VOCAB_SIZE})")
        return bytes(out)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; invalid UTF-8 (e.g. a cut multi-byte character) becomes U+FFFD."""
        return self.decode_bytes(ids, skip_special_tokens).decode("utf-8", errors="replace")

    def id_to_token(self, i: int) -> str:
        """Printable name of one id: a special's spelling, or ``<0xHH>`` for a byte."""
        if 0 <= i < NUM_BYTES:
            return f"<0x{i:02X}>"
        if NUM_BYTES <= i < VOCAB_SIZE:
            return SPECIAL_TOKENS[i - NUM_BYTES]
        raise ValueError(f"token id {i} outside the byte vocabulary [0, {VOCAB_SIZE})")

    def token_to_id(self, token: str) -> int | None:
        """Id of a special token's spelling, ``<0xHH>`` byte name, or single-byte string."""
        if token in SPECIAL_TOKENS:
            return NUM_BYTES + SPECIAL_TOKENS.index(token)
        m = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", token)
        if m:
            return int(m.group(1), 16)
        b = token.encode("utf-8")
        return b[0] if len(b) == 1 else None

    # ------------------------------------------------------------------ chat
    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, object]],
        add_generation_prompt: bool = True,
        tokenize: bool = True,
        tools: Sequence[Mapping[str, object]] | None = None,
    ) -> list[int] | str:
        """Render a conversation with the ChatML template of the module docstring.

        Args:
            messages: ``[{"role": "system"|"user"|"assistant"|"tool", "content": str | parts,
                "tool_calls"?: [{"function": {"name", "arguments"}}], "tool_call_id"?: str}]``.
            tools: OpenAI tool definitions (``[{"type": "function", "function": {…}}]``),
                rendered first as a system message.
            add_generation_prompt: end with ``<|im_start|>assistant\\n`` for the reply.
            tokenize: return ids (default) or the rendered string (specials spelled out;
                ``encode(s, parse_special=True)`` gives the same ids back unless a message
                itself contains a special token's spelling).

        Raises:
            ValueError: a message without a string ``role`` or with non-text content.
        """
        ids: list[int] = []
        if tools:
            ids.append(IM_START_ID)
            ids.extend(b"system\n# Tools\n")
            ids.extend(json.dumps(list(tools), ensure_ascii=False).encode("utf-8"))
            ids.append(IM_END_ID)
            ids.append(ord("\n"))
        for msg in messages:
            role = msg.get("role")
            if not isinstance(role, str) or not role:
                raise ValueError(f"chat message needs a non-empty string 'role': {msg!r}")
            if role == "tool" and msg.get("tool_call_id"):
                role = f"tool:{msg['tool_call_id']}"
            ids.append(IM_START_ID)
            ids.extend(f"{role}\n".encode())
            ids.extend(content_text(msg.get("content")).encode("utf-8"))
            calls = msg.get("tool_calls") or ()
            if calls:
                ids.append(TOOL_CALLS_SECTION_BEGIN_ID)
                for k, call in enumerate(calls):  # type: ignore[arg-type]
                    fn = call.get("function") or {}
                    args = fn.get("arguments", "")
                    if not isinstance(args, str):
                        args = json.dumps(args, ensure_ascii=False)
                    ids.append(TOOL_CALL_BEGIN_ID)
                    ids.extend(f"functions.{fn.get('name', '')}:{k}".encode())
                    ids.append(TOOL_CALL_ARGUMENT_BEGIN_ID)
                    ids.extend(args.encode("utf-8"))
                    ids.append(TOOL_CALL_END_ID)
                ids.append(TOOL_CALLS_SECTION_END_ID)
            ids.append(IM_END_ID)
            ids.append(ord("\n"))
        if add_generation_prompt:
            ids.append(IM_START_ID)
            ids.extend(b"assistant\n")
        if tokenize:
            return ids
        return self.decode(ids, skip_special_tokens=False)

    def __repr__(self) -> str:
        return f"ByteTokenizer(vocab_size={VOCAB_SIZE}, bos={BOS_ID}, eos={EOS_ID}, pad={PAD_ID})"
