"""Speculative decoding settings (:class:`SpecConfig`), chosen per server."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

METHODS = ("ngram", "draft")


@dataclass(frozen=True)
class SpecConfig:
    """How a decode step speculates.

    Attributes:
        method: ``"ngram"`` (prompt lookup over the request's prompt and output) or
            ``"draft"`` (a draft model with the target's vocabulary and its own cache).
        num_speculative_tokens: ``k``, the most tokens proposed per sequence and step
            (the verify forward feeds ``k + 1``).
        ngram_min, ngram_max: n-gram lengths the lookup tries, longest first (tokens).
        draft_model: the draft model (``method="draft"``): a preset name, a checkpoint
            folder, or a ``ModelConfig`` (random weights), as ``load_model`` takes it.
        max_batch_size: no speculation when more sequences decode in the step.
        cost_per_token: the policy's cost of one proposed token, as a fraction of a decode
            step, per sequence of the batch (:class:`~k3serve.engine.spec.policy.SpecPolicy`).
        probe_interval: steps between one-token probes of a sequence whose acceptance turned
            its speculation off.

    Raises:
        ValueError: an unknown method, ``k`` outside ``[1, 64]``, bad n-gram bounds, a draft
            method without a draft model, a negative cost or limit.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    ngram_min: int = 2
    ngram_max: int = 6
    draft_model: Any = None
    max_batch_size: int = 32
    cost_per_token: float = 1.0 / 64
    probe_interval: int = 16

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"SpecConfig.method: must be one of {METHODS}, got {self.method!r}")
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= 64:
            raise ValueError(f"SpecConfig.num_speculative_tokens: must be in [1, 64], got {k!r}")
        if not (isinstance(self.ngram_min, int) and isinstance(self.ngram_max, int)
                and 1 <= self.ngram_min <= self.ngram_max):
            raise ValueError(
                f"SpecConfig.ngram_min/ngram_max: need 1 ≤ min ≤ max, got "
                f"{self.ngram_min!r}, {self.ngram_max!r}"
            )
        if self.method == "draft" and self.draft_model is None:
            raise ValueError("SpecConfig.draft_model: required with method='draft'")
        if not isinstance(self.max_batch_size, int) or self.max_batch_size < 0:
            raise ValueError(
                f"SpecConfig.max_batch_size: must be an int ≥ 0, got {self.max_batch_size!r}"
            )
        if not isinstance(self.cost_per_token, (int, float)) or self.cost_per_token < 0:
            raise ValueError(
                f"SpecConfig.cost_per_token: must be a number ≥ 0, got {self.cost_per_token!r}"
            )
        if not isinstance(self.probe_interval, int) or self.probe_interval < 1:
            raise ValueError(
                f"SpecConfig.probe_interval: must be an int ≥ 1, got {self.probe_interval!r}"
            )


__all__ = ["METHODS", "SpecConfig"]
