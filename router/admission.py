"""Admission control of the router: how many choices it takes in, and in which order they run.

A request costs its choices (prompts × ``n``). ``limit = slots + max_queued``, where ``slots``
is Σ ``capacity.num_slots`` of the decode workers placement may use now:

* a request of more than ``limit`` choices is refused up front with 400 ``too_many_choices``
  naming the limit (:meth:`Admission.admit`): it could never run beside anyone, so it is not
  let in to hold every slot for minutes while the others get 429;
* otherwise it is admitted while the admitted choices plus its own fit in ``limit``, or while
  its API key's own admitted choices plus its own fit in the key's share,
  ``limit // active keys`` (the keys with choices admitted or a request within
  ``share_window_s``, its own included); else it is refused at once with 429 and
  ``Retry-After`` (:func:`overloaded`), before any worker sees it. One key alone may use the
  whole limit; a key that floods is held to its share as soon as another key comes, and the
  other key is admitted within its share even while the flood fills the limit. So at most
  ``2 × limit`` choices are ever admitted, and a key is never locked out by another.

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
from collections.abc import AsyncIterator, Callable

from router.errors import APIError

#: The API key (its name, never the secret) of the request the running task serves; ``""``
#: when the router has no API key.
current_key: contextvars.ContextVar[str] = contextvars.ContextVar("k3serve_api_key", default="")


def overloaded(message: str, retry_after_s: int, status: int = 429) -> APIError:
    """429 (or 503) ``rate_limit_exceeded`` / ``overloaded`` with a ``Retry-After`` header."""
    return APIError(status, message, "server_error" if status >= 500 else "rate_limit_error",
                    code="overloaded" if status >= 500 else "rate_limit_exceeded",
                    retry_after=retry_after_s)


class Ticket:
    """The admission of one request: ``release()`` (idempotent) gives its choices back."""

    def __init__(self, owner: Admission, choices: int, key: str = "") -> None:
        self._owner, self.choices, self.key = owner, choices, key

    def release(self) -> None:
        if self.choices:
            self._owner.give_back(self.key, self.choices)
            self.choices = 0


class Admission:
    """Bounded, per-key fair admission and round-robin seats over the decode slots.

    Args:
        slots: Returns the decode slots available now (Σ ``num_slots`` of usable decode
            workers); read at every decision, so workers joining or leaving count at once.
        max_queued: Choices admitted beyond ``slots()``.
        retry_after_s: ``Retry-After`` of a refused request, seconds.
        share_window_s: Seconds a key counts as active after its last request (the number
            of active keys divides the limit into shares).
    """

    def __init__(self, slots: Callable[[], int], max_queued: int, retry_after_s: int,
                 share_window_s: float = 10.0) -> None:
        self.slots = slots
        self.max_queued = max_queued
        self.retry_after_s = retry_after_s
        self.share_window_s = share_window_s
        self.admitted = 0  # choices of admitted requests not finished
        self.seated = 0  # choices holding a seat (running on a decode slot)
        self.rejected = 0
        self.by_key: dict[str, int] = {}  # admitted choices per key
        self.seen: dict[str, float] = {}  # key -> its last request (monotonic s)
        # choices waiting for a seat, per key in arrival order; the keys in seating order
        self._waiting: dict[str, deque[asyncio.Future]] = {}

    def share(self, key: str, limit: int) -> int:
        """``limit`` divided among the active keys (``key`` included), at least 1."""
        now = time.monotonic()
        active = {k for k, t in self.seen.items() if now - t < self.share_window_s}
        active |= {k for k, c in self.by_key.items() if c}
        active.add(key)
        return max(1, limit // len(active))

    def admit(self, choices: int, key: str = "") -> Ticket:
        """Admit a request of ``choices`` choices for the API key named ``key``, or refuse it.

        Raises:
            APIError: 400 ``too_many_choices`` when ``choices`` passes
                ``slots() + max_queued`` (with decode workers); 429 with ``Retry-After``
                when the admitted choices would pass that limit and the key's would pass
                its share.
        """
        slots = self.slots()
        limit = slots + self.max_queued
        if slots and choices > limit:
            self.rejected += 1
            raise APIError(400, f"the request has {choices} choices (prompts × n); the server "
                           f"runs at most {limit} at once ({slots} decode slots + {self.max_queued}"
                           f" queued): send it in parts", param="n", code="too_many_choices")
        mine = self.by_key.get(key, 0)
        self.seen[key] = time.monotonic()
        if (self.admitted and self.admitted + choices > limit
                and mine + choices > self.share(key, limit)):
            self.rejected += 1
            raise overloaded(f"the server is at capacity ({self.admitted} sequences admitted, "
                             f"limit {limit}); retry after {self.retry_after_s} s",
                             self.retry_after_s)
        self.admitted += choices
        self.by_key[key] = mine + choices
        return Ticket(self, choices, key)

    def give_back(self, key: str, choices: int) -> None:
        """A ticket's ``choices`` of ``key`` finished."""
        self.admitted -= choices
        left = self.by_key.get(key, 0) - choices
        if left > 0:
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
