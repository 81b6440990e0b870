"""Structured outputs: grammars (JSON Schema, JSON object, Kimi tool calls) and the grammar
engine's matcher, torch-free (the router builds and validates grammars; the engine masks
logits with :mod:`k3serve.structured.mask`).

Grammar engine: **llguidance** (Microsoft's Rust Earley/derivative-lexer engine, the one vLLM
and SGLang also ship). Chosen over xgrammar on this machine because (1) its wheel is
self-contained (no torch, no TVM-FFI runtime, no transformers: the router can import it and
validate a grammar without the model stack; xgrammar pulls ``apache-tvm-ffi`` +
``transformers`` and requires torch), (2) building a matcher is ~1 ms for a tool schema and
needs no per-vocabulary pre-compilation step, which matters because under disaggregation the
decode side rebuilds the matcher for every admitted request, (3) the CPU mask for the 272-id
byte vocabulary costs a few microseconds (``benchmarks/grammar_mask.py``), and (4) its Lark
dialect embeds JSON Schema (``%json {…}``) and special tokens (``<|name|>``) in one grammar,
exactly what the Kimi tool-call format needs.

A grammar is plain text in llguidance's Lark dialect, carried in
:attr:`k3serve.sampling.SamplingParams.grammar`. Its state is a pure function of the grammar
and the tokens generated so far, so every worker rebuilds it from those two
(:func:`matcher_for`): the prefill worker samples token #1 under the mask, the decode worker
(admit after token #1, or its fallback prefill of ``prompt + outputs``) replays the given
outputs into a fresh matcher and continues.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

#: JSON layout forced by the grammars: compact separators, no free whitespace (a small model
#: left free to emit whitespace can spend its whole budget on it). Not lenient: a schema keyword
#: the grammar engine cannot enforce (``not``, ``contains``, ``uniqueItems``, ``if``/``then``…)
#: refuses the schema, naming the keyword, instead of being dropped (an answer that violates the
#: schema would then end with ``finish_reason: "stop"``).
JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ",",
                                "key_separator": ":", "lenient": False}

SECTION_BEGIN = "<|tool_calls_section_begin|>"
SECTION_END = "<|tool_calls_section_end|>"
CALL_BEGIN = "<|tool_call_begin|>"
ARG_BEGIN = "<|tool_call_argument_begin|>"
CALL_END = "<|tool_call_end|>"
TOOL_TOKENS = (SECTION_BEGIN, SECTION_END, CALL_BEGIN, ARG_BEGIN, CALL_END)

#: Most calls one ``parallel_tool_calls`` section may hold under a forced ``tool_choice``.
MAX_PARALLEL_CALLS = 8


class GrammarError(ValueError):
    """A grammar (or the schema it came from) the grammar engine rejects."""


def _schema_json(schema: Mapping[str, Any]) -> str:
    s = dict(schema)
    s["x-guidance"] = {**JSON_OPTIONS, **(s.get("x-guidance") or {})}
    return json.dumps(s, ensure_ascii=False)  # key order kept: properties come in order


def json_schema_grammar(schema: Mapping[str, Any]) -> str:
    """The Lark grammar of one JSON value validating against ``schema``.

    Raises:
        GrammarError: ``schema`` is not a JSON object.
    """
    if not isinstance(schema, Mapping):
        raise GrammarError("json schema: must be a JSON object")
    return f"start: %json {_schema_json(schema)}\n"


def json_object_grammar() -> str:
    """Any JSON object (``response_format: {"type": "json_object"}``)."""
    return json_schema_grammar({"type": "object"})


def _lark_str(s: str) -> str:
    return json.dumps(s, ensure_ascii=False)


def tool_call_grammar(tools: Sequence[Mapping[str, Any]], parallel: bool = True) -> str:
    """The Lark grammar of a Kimi K2/K3 tool-call section calling only ``tools``::

        <|tool_calls_section_begin|>(<|tool_call_begin|>functions.NAME:IDX
        <|tool_call_argument_begin|>{args valid for NAME's schema}<|tool_call_end|>){1,K}
        <|tool_calls_section_end|>

    Args:
        tools: ``[{"name": str, "parameters": JSON Schema | None}]`` (the OpenAI tool's
            ``function`` objects): a named ``tool_choice`` passes just that one.
        parallel: up to :data:`MAX_PARALLEL_CALLS` calls (else exactly one).

    Raises:
        GrammarError: no tools, a tool without a name.
    """
    if not tools:
        raise GrammarError("tool_call_grammar: no tools")
    rules = []
    for k, fn in enumerate(tools):
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise GrammarError(f"tools[{k}].function.name: must be a non-empty string")
        params = fn.get("parameters") or {"type": "object"}
        rules.append(f"call_{k}: {CALL_BEGIN} {_lark_str('functions.' + name + ':')} /[0-9]{{1,2}}/ "
                     f"{ARG_BEGIN} %json {_schema_json(params)} {CALL_END}")
    alts = " | ".join(f"call_{k}" for k in range(len(tools)))
    reps = f"call{{1,{MAX_PARALLEL_CALLS}}}" if parallel else "call"
    return "\n".join([f"start: {SECTION_BEGIN} {reps} {SECTION_END}", f"call: {alts}",
                      *rules]) + "\n"


# ----------------------------------------------------------------------------- the engine side
class _Vocab:
    """What llguidance's ``TokenizerWrapper`` reads: each id's bytes (specials as ``0xFF`` +
    spelling, llguidance's convention) and an encoder."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        specials = dict(getattr(tokenizer, "special_tokens", None) or {})
        by_id = {i: s for s, i in specials.items()}
        self.tokens: list[bytes] = []
        for i in range(vocab_size):
            if i in by_id:
                self.tokens.append(b"\xff" + by_id[i].encode("utf-8"))
            else:
                try:
                    self.tokens.append(tokenizer.decode_bytes([i], skip_special_tokens=False))
                except ValueError:  # an id past the tokenizer's vocabulary (padded embedding)
                    self.tokens.append(b"")
        self.special_token_ids = sorted(by_id)
        self.eos_token_id = tokenizer.eos_token_id
        self.bos_token_id = tokenizer.bos_token_id
        self._tok = tokenizer

    def __call__(self, s: str | bytes) -> list[int]:
        text = s.decode("utf-8", errors="replace") if isinstance(s, bytes) else s
        return list(self._tok.encode(text))


class GrammarVocab:
    """The grammar engine's view of a tokenizer (built once per worker, ~ms for 272 ids).

    Args:
        tokenizer: a :class:`k3serve.tokenizer.Tokenizer`.
        vocab_size: V, the model's logit width (≥ the tokenizer's; extra ids never allowed).
        stop_token_ids: ids allowed once the grammar is complete (default: the tokenizer's).
    """

    def __init__(self, tokenizer: Any, vocab_size: int | None = None,
                 stop_token_ids: Sequence[int] | None = None) -> None:
        import llguidance as llg

        self.vocab_size = int(vocab_size or tokenizer.vocab_size)
        stops = list(stop_token_ids or tokenizer.stop_token_ids or [tokenizer.eos_token_id])
        self.stop_token_ids = tuple(stops)
        self.llg = llg.LLTokenizer(llg.TokenizerWrapper(_Vocab(tokenizer, self.vocab_size)),
                                   n_vocab=self.vocab_size, eos_token=stops)

    def validate(self, grammar: str) -> None:
        """Raises :class:`GrammarError` (the engine's message) when ``grammar`` is invalid."""
        import llguidance as llg

        err = llg.LLMatcher.validate_grammar(grammar, self.llg)
        if err and not err.startswith("WARNING"):
            raise GrammarError(f"grammar: {err.splitlines()[0]}")  # the rest quotes the grammar

    def matcher(self, grammar: str, generated: Sequence[int] = ()) -> Matcher:
        """A matcher after ``generated`` (tokens #1… already sampled for the request).

        Raises:
            GrammarError: an invalid grammar, or ``generated`` violates it.
        """
        m = Matcher(self, grammar)
        for k, t in enumerate(generated):
            if not m.consume(int(t)):
                raise GrammarError(f"grammar: generated token #{k + 1} (id {t}) violates it: "
                                   f"{m.error()}")
        return m


class Matcher:
    """One request's grammar state (llguidance ``LLMatcher``), advanced token by token.

    Attributes:
        num_consumed: tokens consumed since the start (the engine compares it with the
            sequence's outputs and rebuilds on a mismatch).
    """

    def __init__(self, vocab: GrammarVocab, grammar: str) -> None:
        import llguidance as llg

        self.vocab = vocab
        self._m = llg.LLMatcher(vocab.llg, grammar, log_level=0)
        if self._m.is_error():
            raise GrammarError(f"grammar: {self._m.get_error()}")
        self.num_consumed = 0

    def bitmask(self) -> bytes:
        """Allowed next tokens: ``⌈V / 32⌉ · 4`` bytes, bit ``v % 8`` of byte ``v // 8``
        (little-endian bit order); after an error, only the stop tokens."""
        if self._m.is_error():
            out = bytearray(((self.vocab.vocab_size + 31) // 32) * 4)
            for t in self.vocab.stop_token_ids:
                out[t // 8] |= 1 << (t % 8)
            return bytes(out)
        return self._m.compute_bitmask()

    def allows(self, token_id: int) -> bool:
        """Whether ``token_id`` may come next (one token checked by the parser itself: the
        reference of :func:`k3serve.structured.mask.reference_mask`)."""
        if self._m.is_error():
            return token_id in self.vocab.stop_token_ids
        return self._m.validate_tokens([int(token_id)]) == 1

    def consume(self, token_id: int) -> bool:
        """Advance by a sampled token; False (and an error state) when it is not allowed."""
        self.num_consumed += 1
        return bool(self._m.consume_token(int(token_id)))

    def error(self) -> str:
        return self._m.get_error()

    def is_accepting(self) -> bool:
        return bool(self._m.is_accepting())


__all__ = [
    "ARG_BEGIN", "CALL_BEGIN", "CALL_END", "JSON_OPTIONS", "MAX_PARALLEL_CALLS",
    "SECTION_BEGIN", "SECTION_END", "TOOL_TOKENS", "GrammarError", "GrammarVocab", "Matcher",
    "json_object_grammar", "json_schema_grammar", "tool_call_grammar",
]
