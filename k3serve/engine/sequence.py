"""Requests and sequences: the engine's per-request state (no tensors).

A :class:`Request` has ``n`` choices; each running choice is a :class:`Sequence` with its own
tokens, KDA state slot and block table (held by the cache manager under ``seq_id``).

Positions of one sequence (``num_computed`` tokens have their latents + state in the cache)::

    0                     num_computed                 len(token_ids)
    |<------ computed ------->|<--- still to compute --->|
    |<------ prompt (num_prompt_tokens) ------>|<-- output_token_ids -->|

    prefill: num_computed < target (the tokens known at admission): next chunk
    decode:  len(token_ids) - num_computed == 1: feed the last sampled token

Sequence states (:class:`SeqStatus`, the only state machine of the engine)::

    WAITING ──admit──▶ RUNNING ──sample: stop / length──▶ FINISHED
       ▲                 │  └──sample: connector keeps it──▶ HELD ──release──▶ FINISHED
       └────preempt──────┘
    any state ──abort──▶ FINISHED

``HELD`` is entered only through a connector (:mod:`k3serve.engine.connector`): a
prefill-only request whose slot and pages a sender still reads.
"""

from __future__ import annotations

import enum
import operator
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from k3serve.sampling import SamplingParams
from k3serve.tokenizer.detok import IncrementalDetokenizer

if TYPE_CHECKING:
    from k3serve.protocol import CacheHandle


class SeqStatus(enum.Enum):
    WAITING = "waiting"  # queued (new or preempted); holds no memory
    RUNNING = "running"  # admitted: slot + pages
    HELD = "held"  # computed and sampled; slot + pages kept for a connector until released
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """One request: prompt, parameters, choices.

    Attributes:
        request_id: caller's id (unique among live requests).
        prompt_token_ids: ``[L]`` prompt.
        params: sampling parameters with the seed resolved.
        seed: the resolved seed (``params.seed``).
        cache_salt: tenant salt or ``None``.
        snapshot_at: positions where the router wants snapshots.
        seqs: the choices' sequences (index = choice); choice 0 is created at add, the others
            when choice 0's prefill ends (n > 1 forks).
        num_cached_tokens: prompt tokens reused at choice 0's first admission (``None`` until
            admitted).
        handle: set by a connector when it holds the request (``HELD``): where its cache
            lives and token #1.
        dirty: changed since the last output (the engine's output flag, not a state).
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    cache_salt: str | None = None
    snapshot_at: tuple[int, ...] = ()
    seqs: list[Sequence] = field(default_factory=list)
    num_cached_tokens: int | None = None
    handle: CacheHandle | None = None
    dirty: bool = False

    @property
    def needs_fork(self) -> bool:
        """``n > 1`` and the other choices are not created yet (choice 0's prefill ends)."""
        return len(self.seqs) < self.params.n

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


def as_token_ids(ids: Seq[int], vocab: int, field: str) -> list[int]:
    """Ids as plain ints in ``[0, vocab)`` (numpy / torch integers accepted).

    Raises:
        ValueError: a non-integer, bool or out-of-range id (names ``field``).
    """
    try:
        out = [operator.index(t) for t in ids if not isinstance(t, bool) or _bad(field)]
    except TypeError:
        raise ValueError(f"{field}: every id must be an int in [0, {vocab})") from None
    if any(not 0 <= t < vocab for t in out):
        raise ValueError(f"{field}: every id must be an int in [0, {vocab})")
    return out


def _bad(field: str) -> bool:
    raise ValueError(f"{field}: bool is not a token id")


__all__ = ["Request", "SeqStatus", "Sequence", "as_token_ids"]
