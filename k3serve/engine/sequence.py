"""Requests and sequences: the engine's per-request state (no tensors).

A :class:`Request` has ``n`` choices; each running choice is a :class:`Sequence` with its own
tokens, KDA state slot and block table (held by the cache manager under ``seq_id``).

Positions of one sequence (``num_computed`` tokens have their latents + state in the cache)::

    0                     num_computed                 len(token_ids)
    |<------ computed ------->|<--- still to compute --->|
    |<------ prompt (num_prompt_tokens) ------>|<-- output_token_ids -->|

    prefill: num_computed < target (the tokens known at admission): next chunk
    decode:  len(token_ids) - num_computed == 1: feed the last sampled token
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from k3serve.tokenizer.detok import IncrementalDetokenizer
from k3serve.sampling import SamplingParams

if TYPE_CHECKING:
    from k3serve.protocol import CacheHandle


class SeqStatus(enum.Enum):
    WAITING = "waiting"  # queued (new or preempted); holds no memory
    RUNNING = "running"  # admitted: slot + pages
    HELD = "held"  # prefill-only, token #1 sampled: slot + pages kept until released
    RESERVED = "reserved"  # decode side: slot + pages reserved, waiting for admit
    FINISHED = "finished"


class RequestMode(enum.Enum):
    GENERATE = "generate"  # the whole request here (offline, or a colocated worker)
    PREFILL = "prefill"  # stop after token #1, hand back the cache (prefill worker)
    DECODE = "decode"  # cache arrives from a prefill worker; continue from token #2


@dataclass(eq=False)
class Request:
    """One request: prompt, parameters, choices.

    Attributes:
        request_id: caller's id (unique among live requests).
        prompt_token_ids: ``[L]`` prompt.
        params: sampling parameters with the seed resolved.
        seed: the resolved seed (``params.seed``).
        mode: :class:`RequestMode`.
        cache_salt: tenant salt or ``None``.
        snapshot_at: positions where the router wants snapshots.
        seqs: the choices' sequences (index = choice); choice 0 is created at add, the others
            when choice 0's prefill ends (n > 1 forks).
        num_cached_tokens: prompt tokens reused at choice 0's first admission (``None`` until
            admitted).
        layer_hook: prefill mode: ``hook(layer_idx, upto_tokens)`` after each layer of each
            forward that computed this request's tokens.
        on_admit: prefill mode: called with the :class:`CacheHandle` (slot and pages of the
            whole prompt, no token yet) before the first forward.
        handle: prefill mode: the cache handle once token #1 is sampled.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    mode: RequestMode = RequestMode.GENERATE
    cache_salt: str | None = None
    snapshot_at: tuple[int, ...] = ()
    seqs: list[Sequence] = field(default_factory=list)
    num_cached_tokens: int | None = None
    layer_hook: Callable[[int, int], None] | None = None
    on_admit: Callable[[CacheHandle], None] | None = None
    handle: CacheHandle | None = None
    forked: bool = False
    dirty: bool = False  # changed since the last output

    @property
    def finished(self) -> bool:
        return len(self.seqs) == self.params.n and all(
            s.status is SeqStatus.FINISHED for s in self.seqs
        )


@dataclass(eq=False)
class Sequence:
    """One choice of a request.

    Attributes:
        seq_id: engine-unique id (the cache manager's key).
        request: owning request.
        choice: index in ``[0, n)``.
        token_ids: prompt + generated tokens.
        num_prompt_tokens: ``L``.
        detok: incremental detokenizer (stop strings, stop ids, max_tokens).
        status: :class:`SeqStatus`.
        num_computed: tokens in the cache (mirrors the cache manager).
        target: tokens known at the last admission; a prefill runs until ``num_computed``
            reaches it.
        logprobs: the sampled tokens' log-probabilities.
        top_logprobs: per token, ``params.logprobs`` alternatives (when asked).
        logits: per token, the ``[V]`` float32 logits it was sampled from (``record_logits``).
        pinned: never preempted (prefill-mode: a sender may be reading its pages).
    """

    seq_id: int
    request: Request
    choice: int
    token_ids: list[int]
    num_prompt_tokens: int
    detok: IncrementalDetokenizer
    status: SeqStatus = SeqStatus.WAITING
    num_computed: int = 0
    target: int = 0
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[tuple[tuple[int, float], ...]] = field(default_factory=list)
    logits: list[Any] = field(default_factory=list)
    pinned: bool = False

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_prefill(self) -> bool:
        """Still computing tokens known at admission (a chunk, not a single decode token)."""
        return self.num_computed < self.target

    @property
    def num_remaining(self) -> int:
        """Tokens to compute before the next sample."""
        return len(self.token_ids) - self.num_computed

    @property
    def prompt(self) -> Seq[int]:
        return self.token_ids[: self.num_prompt_tokens]


__all__ = ["Request", "RequestMode", "SeqStatus", "Sequence"]
