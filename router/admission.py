"""Admission control of the router: how much work it takes in, and in which order it runs.

A request costs its choices (prompts × ``n``) and its tokens: Σ over its prompts of
``n × (prompt tokens + max_tokens)`` (``max_tokens`` unset: what the model length leaves), the
most KV the request can ever need on the decode workers (what a decode worker reserves for it,
:meth:`router.pipeline.Router._reserve`). :class:`Cost` holds the pair; a limit is a pair too,
and a cost fits a limit when both of its parts do.

The limit (:meth:`Admission.limit`) has two parts, from the decode workers' capacity
(:class:`DecodeCapacity`: Σ ``capacity.num_slots`` and Σ ``num_pages × block_size``):

* choices: ``slots + max_queued``;
* tokens: ``max_tokens`` when configured (``--max-admitted-tokens``), else the decode caches'
  tokens scaled by the same queue depth, ``kv_tokens × (slots + max_queued) / slots``.

Two capacities are read at every decision: the **configured** one (every registered decode
worker, healthy or not: what the workers announced) and the **live** one (those placement may
use now). A request is

* refused with 400 ``too_many_choices`` / ``too_many_tokens`` naming the limit when it passes
  the configured limit: it could never run beside anyone, so it is not let in to hold every
  slot for minutes while the others get 429;
* refused with 503 and ``Retry-After`` when it fits the configured limit but not the live one
  (a decode worker is stopped, hung or restarting: the capacity is short for now);
* admitted while the admitted cost plus its own fits the live limit; else admitted while its
  API key's admitted cost plus its own fits the key's share, ``limit // active keys`` (the keys
  with work admitted or a request within ``share_window_s``, its own included), and the total
  stays within twice the limit; else refused at once with 429 and ``Retry-After``
  (:func:`overloaded`), before any worker sees it.

One key alone may use the whole limit; a key that floods is held to its share as soon as
another key comes, and the other key is admitted within its share while the flood fills the
limit. The admitted cost never passes ``2 × limit`` (the live limit at each admission), however
many keys there are: the first half is shared by arrival, the second only by keys within their
shares. With the limit full of one key's work, ``k`` other keys each get their share until the
second half is used up (``k ≤ 2`` always fit; with more keys the later ones wait for work to
finish, with 429s in between).

An admitted choice takes a seat (:meth:`Admission.seat`) for as long as it occupies a decode
slot; while every slot is taken, the waiting choices are seated one key after the other
(round robin over the keys with choices waiting, arrival order within a key): a key with
many queued choices does not delay another key's choice by more than one seat per key. The
key of a choice is the :data:`current_key` of the task that asks for the seat (set by the
route for the request, copied into its choices' tasks). With no API key every request is of
the key ``""``: plain arrival order.

With no decode worker at all the choices go on to placement, which answers 503.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any, NamedTuple

from router.errors import APIError

#: The API key (its name, never the secret) of the request the running task serves; ``""``
#: when the router has no API key.
current_key: contextvars.ContextVar[str] = contextvars.ContextVar("k3serve_api_key", default="")


def overloaded(message: str, retry_after_s: int, status: int = 429) -> APIError:
    """429 (or 503) ``rate_limit_exceeded`` / ``overloaded`` with a ``Retry-After`` header."""
    return APIError(status, message, "server_error" if status >= 500 else "rate_limit_error",
                    code="overloaded" if status >= 500 else "rate_limit_exceeded",
                    retry_after=retry_after_s)


class Cost(NamedTuple):
    """Work of a request, a key or the whole router: choices, and tokens (prompt tokens +
    ``max_tokens`` per choice)."""

    choices: int
    tokens: int

    def plus(self, other: Cost) -> Cost:
        return Cost(self.choices + other.choices, self.tokens + other.tokens)

    def minus(self, other: Cost) -> Cost:
        return Cost(self.choices - other.choices, self.tokens - other.tokens)

    def fits(self, limit: Cost) -> bool:
        """Both parts within ``limit``'s."""
        return self.choices <= limit.choices and self.tokens <= limit.tokens

    def scaled(self, num: int, den: int) -> Cost:
        """Both parts × ``num / den`` (floor), at least 1 each."""
        return Cost(max(1, self.choices * num // den), max(1, self.tokens * num // den))


class DecodeCapacity(NamedTuple):
    """Σ over a set of decode workers: ``slots`` (``capacity.num_slots``) and ``kv_tokens``
    (``capacity.num_pages × block_size``, the tokens their caches hold)."""

    slots: int
    kv_tokens: int


#: No capacity at all (no decode worker).
NO_CAPACITY = DecodeCapacity(0, 0)


class Ticket:
    """The admission of one request: ``release()`` (idempotent) gives its cost back."""

    def __init__(self, owner: Admission, cost: Cost, key: str = "") -> None:
        self._owner, self.cost, self.key = owner, cost, key

    @property
    def choices(self) -> int:
        return self.cost.choices

    def release(self) -> None:
        if self.cost.choices or self.cost.tokens:
            self._owner.give_back(self.key, self.cost)
            self.cost = Cost(0, 0)


class Admission:
    """Bounded, per-key fair admission by cost, and round-robin seats over the decode slots.

    Args:
        live: Returns the decode capacity placement may use now (the usable decode workers);
            read at every decision, so workers joining or leaving count at once.
        max_queued: Choices admitted beyond the live decode slots.
        retry_after_s: ``Retry-After`` of a refused request, seconds.
        share_window_s: Seconds a key counts as active after its last request (the number
            of active keys divides the limit into shares).
        max_tokens: The token part of the limit (prompt + ``max_tokens`` per choice, summed
            over the admitted choices); ``None``: from the decode workers' caches (module
            docstring).
        configured: Returns the capacity every registered decode worker announced, usable now
            or not (the 400 is judged against it); ``None``: ``live``.

    Raises:
        ValueError: ``max_queued`` < 0 or ``max_tokens`` < 1 (named).
    """

    def __init__(self, live: Callable[[], DecodeCapacity], max_queued: int, retry_after_s: int,
                 share_window_s: float = 10.0, max_tokens: int | None = None,
                 configured: Callable[[], DecodeCapacity] | None = None) -> None:
        if max_queued < 0:
            raise ValueError("max_queued: must be >= 0")
        if max_tokens is not None and max_tokens < 1:
            raise ValueError("max_tokens: must be >= 1")
        self.live = live
        self.configured = configured or live
        self.max_queued = max_queued
        self.max_tokens = max_tokens
        self.retry_after_s = retry_after_s
        self.share_window_s = share_window_s
        self.total = Cost(0, 0)  # cost of admitted requests not finished
        self.seated = 0  # choices holding a seat (running on a decode slot)
        self.rejected = 0
        self.by_key: dict[str, Cost] = {}  # admitted cost per key
        self.seen: dict[str, float] = {}  # key -> its last request (monotonic s)
        # choices waiting for a seat, per key in arrival order; the keys in seating order
        self._waiting: dict[str, deque[asyncio.Future]] = {}

    @property
    def admitted(self) -> int:
        """Choices of admitted requests not finished."""
        return self.total.choices

    @property
    def admitted_tokens(self) -> int:
        """Tokens (prompt + ``max_tokens`` per choice) of admitted requests not finished."""
        return self.total.tokens

    def slots(self) -> int:
        """Decode slots usable now (the seats)."""
        return self.live().slots

    def limit(self, cap: DecodeCapacity) -> Cost:
        """The admission limit of decode capacity ``cap``: ``slots + max_queued`` choices, and
        ``max_tokens`` (else ``kv_tokens × (slots + max_queued) / slots``) tokens. With no
        slot at all the tokens are not limited (placement answers 503)."""
        choices = cap.slots + self.max_queued
        if self.max_tokens is not None:
            return Cost(choices, self.max_tokens)
        if not cap.slots:
            return Cost(choices, 1 << 62)
        return Cost(choices, max(1, cap.kv_tokens * choices // cap.slots))

    def share(self, key: str, limit: Cost) -> Cost:
        """``limit`` divided among the active keys (``key`` included), at least 1 each part."""
        now = time.monotonic()
        active = {k for k, t in self.seen.items() if now - t < self.share_window_s}
        active |= {k for k, c in self.by_key.items() if c.choices or c.tokens}
        active.add(key)
        return limit.scaled(1, len(active))

    def admit(self, cost: Cost, key: str = "") -> Ticket:
        """Admit a request of ``cost`` for the API key named ``key``, or refuse it.

        Raises:
            APIError: 400 ``too_many_choices`` / ``too_many_tokens`` when ``cost`` passes the
                configured limit; 503 with ``Retry-After`` when it passes only the live one;
                429 with ``Retry-After`` when the admitted cost would pass the live limit and
                the key's its share (or the total twice the limit).
        """
        live = self.live()
        self._check_size(cost, self.configured(), live)
        limit = self.limit(live)
        mine = self.by_key.get(key, Cost(0, 0))
        self.seen[key] = time.monotonic()
        after = self.total.plus(cost)
        if self.total.choices and not after.fits(limit) and not (
                mine.plus(cost).fits(self.share(key, limit)) and after.fits(limit.scaled(2, 1))):
            self.rejected += 1
            raise overloaded(f"the server is at capacity ({self.total.choices} sequences, "
                             f"{self.total.tokens} tokens admitted; limit {limit.choices} "
                             f"sequences, {limit.tokens} tokens); retry after "
                             f"{self.retry_after_s} s", self.retry_after_s)
        self.total = after
        self.by_key[key] = mine.plus(cost)
        return Ticket(self, cost, key)

    def _check_size(self, cost: Cost, configured: DecodeCapacity, live: DecodeCapacity) -> None:
        """400 past the configured limit, 503 past only the live one (see :meth:`admit`); no
        check without a registered decode worker, no 503 without a usable one (placement
        answers 503 then)."""
        if not configured.slots:
            return
        cfg = self.limit(configured)
        if cost.choices > cfg.choices:
            self.rejected += 1
            raise APIError(400, f"the request has {cost.choices} choices (prompts × n); the "
                           f"server runs at most {cfg.choices} at once ({configured.slots} "
                           f"decode slots + {self.max_queued} queued): send it in parts",
                           param="n", code="too_many_choices")
        if cost.tokens > cfg.tokens:
            self.rejected += 1
            raise APIError(400, f"the request needs {cost.tokens} tokens (prompt tokens + "
                           f"max_tokens, per choice); the server admits at most {cfg.tokens} "
                           f"at once: send it in parts or lower max_tokens",
                           param="max_tokens", code="too_many_tokens")
        now = self.limit(live)
        if live.slots and not cost.fits(now):
            self.rejected += 1
            raise overloaded(f"the request ({cost.choices} choices, {cost.tokens} tokens) "
                             f"needs more than the usable decode capacity now ({live.slots} of "
                             f"{configured.slots} decode slots: limit {now.choices} choices, "
                             f"{now.tokens} tokens); retry after {self.retry_after_s} s",
                             self.retry_after_s, status=503)

    def give_back(self, key: str, cost: Cost) -> None:
        """A ticket's ``cost`` of ``key`` finished."""
        self.total = self.total.minus(cost)
        left = self.by_key.get(key, Cost(0, 0)).minus(cost)
        if left.choices > 0 or left.tokens > 0:
            self.by_key[key] = left
        else:
            self.by_key.pop(key, None)
        now = time.monotonic()
        for k in [k for k, t in self.seen.items() if now - t >= self.share_window_s]:
            del self.seen[k]

    @contextlib.asynccontextmanager
    async def seat(self) -> AsyncIterator[None]:
        """Hold a decode seat while the block runs; wait for one, seated round robin over
        the keys (:data:`current_key`), in arrival order within a key.

        With no decode slot at all (no usable decode worker) the block runs at once: its
        placement answers 503. Lock-free (queues of futures; a seat is handed from the
        choice that leaves it to the next one waiting), so no cancellation can wedge it.
        """
        if self._waiting or self.seated >= self.slots() > 0:
            fut = asyncio.get_running_loop().create_future()
            key = current_key.get()
            self._waiting.setdefault(key, deque()).append(fut)
            try:
                while not fut.done():  # slots may grow without anybody leaving a seat
                    await asyncio.wait([fut], timeout=0.25)
                    self._hand_over()
            except BaseException:
                if fut.done() and not fut.cancelled():
                    self._leave()  # a seat was handed to us: pass it on
                else:
                    fut.cancel()
                    self._forget(key, fut)
                raise
        else:
            self.seated += 1
        try:
            yield
        finally:
            self._leave()

    def _forget(self, key: str, fut: asyncio.Future) -> None:
        q = self._waiting.get(key)
        if q is not None:
            with contextlib.suppress(ValueError):
                q.remove(fut)
            if not q:
                del self._waiting[key]

    def _leave(self) -> None:
        self.seated -= 1
        self._hand_over()

    def _hand_over(self) -> None:
        """Seat waiting choices while there are free slots (all of them when there is no
        decode slot at all): the first of the first key's queue, whose key then goes to the
        end of the rotation."""
        while self._waiting:
            slots = self.slots()
            if 0 < slots <= self.seated:
                return
            key = next(iter(self._waiting))
            q = self._waiting.pop(key)
            fut = q.popleft()
            if q:
                self._waiting[key] = q  # to the end of the rotation
            if not fut.done():
                self.seated += 1
                fut.set_result(None)


def decode_capacity(workers: Iterable[Any]) -> DecodeCapacity:
    """The :class:`DecodeCapacity` of decode workers (each with its ``info``:
    ``capacity.num_slots``, ``capacity.num_pages``, ``block_size``)."""
    slots = tokens = 0
    for w in workers:
        slots += w.info.capacity.num_slots
        tokens += w.info.capacity.num_pages * w.info.block_size
    return DecodeCapacity(slots, tokens)


def request_cost(jobs: Iterable[Any], n: int) -> Cost:
    """The :class:`Cost` of a request of ``n`` choices per prompt job (each with its
    ``token_ids`` and ``max_new``: ``router.preprocess.PromptJob``)."""
    choices = tokens = 0
    for j in jobs:
        choices += n
        tokens += n * (len(j.token_ids) + j.max_new)
    return Cost(choices, tokens)
