"""The base of every internal message, its field types, and the wire helpers
(:func:`finite`, :func:`top_pairs`, :func:`same_secret`); the error body and the sampling
fields every hop that starts a request carries."""

from __future__ import annotations

import math
import secrets
from collections.abc import Iterable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

from k3serve.sampling import SamplingParams

# ============================================================================ helpers


def finite(x: Any) -> float | None:
    """A logprob for the wire: ``None`` stays ``None``, non-finite floats become ``None``.

    Args:
        x: a number (python or numpy/torch scalar) or ``None``.

    Returns:
        ``float(x)`` when finite, else ``None``.
    """
    if x is None:
        return None
    x = float(x)
    return x if math.isfinite(x) else None


def top_pairs(top: Iterable[tuple[int, float]] | None) -> list[tuple[int, float | None]] | None:
    """``((token_id, logprob), ...)`` → ``[(token_id, logprob | None), ...]`` or ``None``."""
    if top is None:
        return None
    return [(int(t), finite(lp)) for t, lp in top]


def same_secret(got: str | None, want: str) -> bool:
    """Constant-time comparison of a presented secret (API key, cluster token) with the
    expected one. Compares UTF-8 bytes (with ``surrogateescape``), so a non-ASCII header value is
    a plain mismatch, never an exception.

    Args:
        got: the presented value (``None``: nothing presented).
        want: the expected value.

    Returns:
        True when equal.
    """
    if got is None:
        return False
    return secrets.compare_digest(got.encode("utf-8", "surrogateescape"),
                                  want.encode("utf-8", "surrogateescape"))


class Message(BaseModel):
    """Base of every internal message: unknown fields ignored, instances immutable."""

    model_config = ConfigDict(extra="ignore", frozen=True)


TokenId = StrictInt
Logprob = float | None
TopLogprobs = list[tuple[StrictInt, float | None]] | None
FinishReason = Literal["stop", "length", "abort"]
Role = Literal["prefill", "decode"]

# ============================================================================ errors


class ErrorBody(Message):
    """Every internal error answer: ``{"error": CODE, "message": TEXT}``.

    Codes (HTTP status): ``invalid_request`` / ``invalid_sampling`` (400), ``forbidden`` (403),
    ``unknown_request`` (404), ``fingerprint_mismatch`` / ``ticket_refused`` / ``aborted`` /
    ``stream_taken`` (409), ``transfer_pairing_failed`` / ``transfer_setup_failed`` (502),
    ``busy`` (503: no cache for a reservation now, retry elsewhere), ``draining`` (503: the
    worker is shutting down, place the request elsewhere), ``timeout`` (504),
    ``internal_error`` / ``engine_error`` (500).
    """

    error: str
    message: str = ""


# ============================================================================ sampling


class SamplingSpec(Message):
    """:class:`~k3serve.sampling.SamplingParams` on the wire (same names and defaults).

    Only the types are checked here; the ranges are checked by :meth:`to_params`, which
    raises ``ValueError("SamplingParams.<field>: ...")``.
    """

    n: StrictInt = 1
    max_tokens: StrictInt | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: StrictInt = -1
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: StrictInt | None = None
    stop: list[str] = Field(default_factory=list)
    stop_token_ids: list[StrictInt] = Field(default_factory=list)
    ignore_eos: StrictBool = False
    logprobs: StrictInt | None = None
    include_stop_str_in_output: StrictBool = False
    skip_special_tokens: StrictBool = True
    grammar: str | None = None  # structured output (SamplingParams.grammar)

    @classmethod
    def of(cls, params: SamplingParams) -> SamplingSpec:
        """The wire form of ``params``."""
        return cls.model_validate(params.to_dict())

    def to_params(self, require_single: bool = True) -> SamplingParams:
        """The validated :class:`SamplingParams`.

        Args:
            require_single: refuse ``n != 1`` (the router splits ``n > 1`` into sub-requests
                with derived seeds before any internal call).

        Raises:
            ValueError: a field out of range (the message names it).
        """
        params = SamplingParams.from_dict(self.model_dump())
        if require_single and params.n != 1:
            raise ValueError("sampling.n: must be 1 (the router splits n > 1 into sub-requests)")
        return params


__all__ = ["ErrorBody", "FinishReason", "Logprob", "Message", "Role", "SamplingSpec", "TokenId",
           "TopLogprobs", "finite", "same_secret", "top_pairs"]
