"""The base of every internal message, its field types, and the wire helpers
(:func:`finite`, :func:`top_pairs`, :func:`same_secret`) and the error body. The ``sampling``
field of the messages that start a request is :class:`k3serve.sampling.SamplingParams` itself."""

from __future__ import annotations

import math
import secrets
from collections.abc import Iterable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, StrictInt

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


__all__ = ["ErrorBody", "FinishReason", "Logprob", "Message", "Role", "TokenId",
           "TopLogprobs", "finite", "same_secret", "top_pairs"]
