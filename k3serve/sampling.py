"""Sampling parameters of one request (vLLM-compatible names): the one definition of every
sampling field's name, type, range and default.

Pure Python, **no torch**. :class:`SamplingParams` is a frozen pydantic model and is itself
the ``sampling`` field of the internal messages (:mod:`k3serve.messages`), so a worker gets
validated params straight from the request body. The router's OpenAI request schemas
(``router/schemas.py``) declare their sampling fields with the field types below
(:data:`Temperature`, :data:`TopP`, …), narrowed where OpenAI's API is narrower, and
``router/preprocess.py`` builds one :class:`SamplingParams` per choice from them. The tensor
code that applies the params lives in ``k3serve.engine.sampler``.

Randomness (DESIGN.md §1): the noise that picks a token is a pure function of
``(seed, choice index, position)``, so a request samples the same tokens in any batch, on any
worker and after a prefill→decode hand-off. A request without a ``seed`` gets one drawn by the
engine at admission (:func:`draw_seed`); from then on the same rule applies.
"""

from __future__ import annotations

import secrets
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    ValidationError,
)

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


def _top_k(v: int) -> int:
    if not (v == -1 or v >= 1):
        raise ValueError("must be -1 (disabled) or an int >= 1")
    return v


def non_empty_stops(stops: tuple[str, ...]) -> tuple[str, ...]:
    """The rule of ``stop``: every stop string is non-empty (an empty one would match
    everywhere).

    Raises:
        ValueError: an empty stop string.
    """
    if any(s == "" for s in stops):
        raise ValueError("stop sequences must be non-empty")
    return stops


def _as_tuple(v: Any) -> Any:
    """A list (JSON array) becomes a tuple; a single string becomes a one-element tuple."""
    if isinstance(v, str):
        return (v,)
    return tuple(v) if isinstance(v, list) else v


# ---------------------------------------------------------------- field types
# Each sampling field's type and range, defined once; SamplingParams and the router's OpenAI
# schemas annotate their fields with these (tests/test_sampling_fields.py checks that).
Number = Annotated[float, Field(allow_inf_nan=False)]
N = Annotated[StrictInt, Field(ge=1)]
MaxTokens = Annotated[StrictInt, Field(ge=1)]
Temperature = Annotated[Number, Field(ge=0.0)]
TopP = Annotated[Number, Field(gt=0.0, le=1.0)]
TopK = Annotated[StrictInt, AfterValidator(_top_k)]
MinP = Annotated[Number, Field(ge=0.0, le=1.0)]
Penalty = Annotated[Number, Field(ge=-2.0, le=2.0)]
RepetitionPenalty = Annotated[Number, Field(gt=0.0, le=2.0)]
Seed = StrictInt
Stop = Annotated[tuple[str, ...], BeforeValidator(_as_tuple), AfterValidator(non_empty_stops)]
TokenId = Annotated[StrictInt, Field(ge=0)]
Logprobs = Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)]
Grammar = Annotated[str, Field(min_length=1)]


class NamedErrors(type(BaseModel)):  # type: ignore[misc]
    """Metaclass of :class:`SamplingParams`: a direct call ``SamplingParams(...)`` raises
    ``ValueError("SamplingParams.<field>: ...")`` instead of pydantic's ``ValidationError``, and
    refuses a keyword that is not a field (``ValueError`` naming it). Validation inside a
    message does not go through ``__call__``, so there pydantic's error names
    ``sampling.<field>`` with the message's other fields."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        unknown = sorted(set(kwargs) - set(cls.model_fields))
        if unknown:  # a typo must not silently keep a default
            raise ValueError(f"{cls.__name__}: unknown field(s) {unknown}")
        try:
            return super().__call__(*args, **kwargs)
        except ValidationError as e:
            raise named_error(e) from None


class SamplingParams(BaseModel, metaclass=NamedErrors):
    """How to pick each generated token of one request, and when to stop.

    Names and defaults follow vLLM's ``SamplingParams`` (and so the OpenAI API). Frozen;
    unknown fields are ignored when it is read from a message (a newer peer may send more),
    refused by :meth:`from_dict` and by a direct call.

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
        ValueError: From the constructor when a field has the wrong type or is out of range;
            the message starts with ``SamplingParams.<field>:`` (:class:`NamedErrors`).
    """

    model_config = ConfigDict(extra="ignore", frozen=True, strict=True)

    n: N = 1
    max_tokens: MaxTokens | None = 16
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: TopK = -1
    min_p: MinP = 0.0
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    repetition_penalty: RepetitionPenalty = 1.0
    seed: Seed | None = None
    stop: Stop = ()
    stop_token_ids: Annotated[tuple[TokenId, ...], BeforeValidator(_as_tuple)] = ()
    ignore_eos: StrictBool = False
    logprobs: Logprobs | None = None
    include_stop_str_in_output: StrictBool = False
    skip_special_tokens: StrictBool = True
    grammar: Grammar | None = None

    # ------------------------------------------------------------------ derived
    @property
    def is_greedy(self) -> bool:
        """True when tokens are picked by argmax (``temperature < GREEDY_EPS``)."""
        return self.temperature < GREEDY_EPS

    def replace(self, **changes: Any) -> SamplingParams:
        """A validated copy with ``changes`` applied (as ``dataclasses.replace``).

        Raises:
            ValueError: a changed field out of range (named), or an unknown field.
        """
        unknown = sorted(set(changes) - set(type(self).model_fields))
        if unknown:
            raise ValueError(f"SamplingParams: unknown field(s) {unknown}")
        return SamplingParams(**{**self.__dict__, **changes})

    def with_seed(self, seed: int) -> SamplingParams:
        """Returns a copy with ``seed`` set (the engine's admission step for unseeded requests).

        Raises:
            ValueError: If ``seed`` is not an int.
        """
        return self.replace(seed=seed)

    # ------------------------------------------------------------------ dict form
    def to_dict(self) -> dict[str, Any]:
        """Returns a JSON-safe dict of every field (tuples become lists)."""
        return self.model_dump(mode="json")

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
        unknown = sorted(set(d) - set(cls.model_fields))
        if unknown:
            raise ValueError(f"SamplingParams: unknown field(s) {unknown}")
        return cls(**d)


def named_error(e: ValidationError) -> ValueError:
    """The first error of a :class:`SamplingParams` validation as
    ``ValueError("SamplingParams.<field>: <what>, got <value>")``."""
    err = e.errors()[0]
    field = str(err["loc"][0]) if err["loc"] else "?"
    return ValueError(f"SamplingParams.{field}: {err['msg']}, got {err.get('input')!r}")
