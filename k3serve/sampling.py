"""Sampling parameters of one request (vLLM-compatible names), validated at construction.

Pure Python, **no torch**: the router builds and validates these from OpenAI requests and
sends them to workers with :meth:`SamplingParams.to_dict` / :meth:`SamplingParams.from_dict`
(JSON-safe). The tensor code that applies them lives in ``k3serve.engine.sampler``.

Randomness (DESIGN.md §1): the noise that picks a token is a pure function of
``(seed, choice index, position)``, so a request samples the same tokens in any batch, on any
worker and after a prefill→decode hand-off. A request without a ``seed`` gets one drawn by the
engine at admission (:func:`draw_seed`); from then on the same rule applies.
"""

from __future__ import annotations

import dataclasses
import math
import secrets
from dataclasses import dataclass
from typing import Any

#: Temperatures below this are treated as greedy (vLLM's ``_SAMPLING_EPS``): dividing logits by
#: a smaller number only risks overflow without changing the argmax.
GREEDY_EPS = 1e-5

#: Largest ``logprobs`` (top-n alternatives per token) a request may ask for (OpenAI's limit).
MAX_LOGPROBS = 20


def draw_seed() -> int:
    """Draws a fresh random seed for a request that did not set one.

    Called once per request at admission; the seed then travels with the request (prefill →
    decode, migration), so the continuation is identical wherever it runs.

    Returns:
        A uniformly random int in ``[0, 2**63)`` (fits int64 and JSON).
    """
    return secrets.randbits(63)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each generated token of one request, and when to stop.

    Names and defaults follow vLLM's ``SamplingParams`` (and so the OpenAI API).

    Attributes:
        n: Number of independent completions (choices) of the prompt; >= 1.
        max_tokens: Most tokens to generate per choice (>= 1), or ``None`` for "until the
            model's length limit" (the engine caps it).
        temperature: Softmax temperature, >= 0. Below ``GREEDY_EPS`` (e.g. 0) sampling is
            greedy (argmax of the penalised logits); ``top_p``, ``top_k``, ``min_p`` and the
            seed then have no effect.
        top_p: Nucleus sampling: keep the smallest set of most likely tokens whose probability
            mass reaches ``top_p``; in (0, 1], 1 disables.
        top_k: Keep the ``top_k`` most likely tokens; -1 disables, otherwise >= 1.
        min_p: Drop tokens whose probability is below ``min_p`` × the top token's; in [0, 1],
            0 disables.
        presence_penalty: Subtracted once from the logit of every token already generated
            (OpenAI semantics); in [-2, 2].
        frequency_penalty: Subtracted from a token's logit once per time it was generated;
            in [-2, 2].
        repetition_penalty: Multiplicative penalty (CTRL / HF / vLLM) on every token seen in the
            prompt or the output: positive logits are divided by it, negative ones multiplied;
            > 0 and <= 2, 1 disables.
        seed: Seed of the sampling noise; any int (reduced modulo 2**64). ``None``: the engine
            draws one at admission (:func:`draw_seed`).
        stop: Strings that end generation when they appear in the output text; the text is cut
            before them (after them with ``include_stop_str_in_output``). A single string is
            accepted and stored as a one-element tuple.
        stop_token_ids: Token ids that end generation (besides EOS).
        ignore_eos: Keep generating after the EOS token.
        logprobs: Number of top alternatives (with log-probabilities) to return per generated
            token, in [0, 20]; ``None`` returns none. The sampled token's own log-probability is
            always computed.
        include_stop_str_in_output: Keep the matched stop string (or the stop token's text) in
            the output.
        skip_special_tokens: Leave special tokens out of the detokenized text.
        grammar: Structured output: a grammar in llguidance's Lark dialect
            (:mod:`k3serve.structured`; ``%json {schema}`` for JSON Schema, special tokens
            spelled ``<|name|>``) that every generated token must keep satisfiable; the
            engine masks the logits with it and then allows only the stop tokens once the
            grammar is complete. ``None``: unconstrained. Plain text here (the router builds
            it, torch-free); the grammar engine parses it when the request is admitted.

    Raises:
        ValueError: From ``__post_init__`` when a field has the wrong type or is out of range;
            the message starts with ``SamplingParams.<field>:``.
    """

    n: int = 1
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    grammar: str | None = None

    # ------------------------------------------------------------------ validation
    def __post_init__(self) -> None:
        def fail(fld: str, msg: str) -> None:
            raise ValueError(f"SamplingParams.{fld}: {msg}, got {getattr(self, fld)!r}")

        def is_int(v: Any) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def as_float(fld: str) -> float:
            v = getattr(self, fld)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                fail(fld, "must be a finite number")
            object.__setattr__(self, fld, float(v))
            return float(v)

        if not is_int(self.n) or self.n < 1:
            fail("n", "must be an int >= 1")
        if self.max_tokens is not None and (not is_int(self.max_tokens) or self.max_tokens < 1):
            fail("max_tokens", "must be an int >= 1 or None")
        if as_float("temperature") < 0:
            fail("temperature", "must be >= 0")
        if not 0 < as_float("top_p") <= 1:
            fail("top_p", "must lie in (0, 1]")
        if not is_int(self.top_k) or not (self.top_k == -1 or self.top_k >= 1):
            fail("top_k", "must be -1 (disabled) or an int >= 1")
        if not 0 <= as_float("min_p") <= 1:
            fail("min_p", "must lie in [0, 1]")
        for fld in ("presence_penalty", "frequency_penalty"):
            if not -2 <= as_float(fld) <= 2:
                fail(fld, "must lie in [-2, 2]")
        if not 0 < as_float("repetition_penalty") <= 2:
            fail("repetition_penalty", "must lie in (0, 2]")
        if self.seed is not None and not is_int(self.seed):
            fail("seed", "must be an int or None")

        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
            fail("stop", "must be a string or a list of non-empty strings")
        object.__setattr__(self, "stop", tuple(stop))
        ids = self.stop_token_ids
        if not isinstance(ids, (list, tuple)) or not all(is_int(t) and t >= 0 for t in ids):
            fail("stop_token_ids", "must be a list of ints >= 0")
        object.__setattr__(self, "stop_token_ids", tuple(ids))

        for fld in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, fld), bool):
                fail(fld, "must be a bool")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar):
            fail("grammar", "must be a non-empty string or None")
        if self.logprobs is not None and (
            not is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            fail("logprobs", f"must be an int in [0, {MAX_LOGPROBS}] or None")

    # ------------------------------------------------------------------ derived
    @property
    def is_greedy(self) -> bool:
        """True when tokens are picked by argmax (``temperature < GREEDY_EPS``)."""
        return self.temperature < GREEDY_EPS

    def with_seed(self, seed: int) -> SamplingParams:
        """Returns a copy with ``seed`` set (the engine's admission step for unseeded requests).

        Raises:
            ValueError: If ``seed`` is not an int.
        """
        return dataclasses.replace(self, seed=seed)

    # ------------------------------------------------------------------ wire format
    def to_dict(self) -> dict[str, Any]:
        """Returns a JSON-safe dict of every field (tuples become lists)."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            out[f.name] = list(v) if isinstance(v, tuple) else v
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SamplingParams:
        """Builds params from :meth:`to_dict` output (missing keys take their defaults).

        Args:
            d: Mapping of field name to value.

        Returns:
            The validated params.

        Raises:
            ValueError: On an unknown key (named in the message) or an invalid value.
        """
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"SamplingParams: unknown field(s) {unknown}")
        return cls(**d)
