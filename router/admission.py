"""Admission control of the router: how many choices it takes in, and in which order they run.

A request is admitted (:meth:`Admission.admit`) only while the choices already admitted plus
its own fit in ``slots + max_queued``, where ``slots`` is Σ ``capacity.num_slots`` of the
decode workers placement may use now; otherwise it is refused at once with 429 and
``Retry-After`` (:func:`overloaded`), before any worker sees it. An admitted choice takes a
seat (:meth:`Admission.seat`) for as long as it occupies a decode slot; while every slot is
taken it waits in arrival order. So the queue in front of the workers is bounded, and an
admitted request waits at most ``max_queued / slots`` service times: admitted requests keep
their latency, the excess is shed.

When nothing is admitted, a request is let in whatever its size (a batch larger than the
cluster still runs, a slot at a time), and with no decode worker at all the choices go on to
placement, which answers 503.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterator, Callable

from router.errors import APIError


def overloaded(message: str, retry_after_s: int, status: int = 429) -> APIError:
    """429 (or 503) ``rate_limit_exceeded`` / ``overloaded`` with a ``Retry-After`` header."""
    return APIError(status, message, "server_error" if status >= 500 else "rate_limit_error",
                    code="overloaded" if status >= 500 else "rate_limit_exceeded",
                    retry_after=retry_after_s)


class Ticket:
    """The admission of one request: ``release()`` (idempotent) gives its choices back."""

    def __init__(self, owner: Admission, choices: int) -> None:
        self._owner, self.choices = owner, choices

    def release(self) -> None:
        if self.choices:
            self._owner.admitted -= self.choices
            self.choices = 0


class Admission:
    """Bounded admission and FIFO seats over the decode slots.

    Args:
        slots: Returns the decode slots available now (Σ ``num_slots`` of usable decode
            workers); read at every decision, so workers joining or leaving count at once.
        max_queued: Choices admitted beyond ``slots()``.
        retry_after_s: ``Retry-After`` of a refused request, seconds.
    """

    def __init__(self, slots: Callable[[], int], max_queued: int, retry_after_s: int) -> None:
        self.slots = slots
        self.max_queued = max_queued
        self.retry_after_s = retry_after_s
        self.admitted = 0  # choices of admitted requests not finished
        self.seated = 0  # choices holding a seat (running on a decode slot)
        self.rejected = 0
        self._waiting: deque[asyncio.Future] = deque()  # choices waiting for a seat, in order

    def admit(self, choices: int) -> Ticket:
        """Admit a request of ``choices`` choices, or refuse it.

        Raises:
            APIError: 429 with ``Retry-After`` when the admitted choices would pass
                ``slots() + max_queued``.
        """
        limit = self.slots() + self.max_queued
        if self.admitted and self.admitted + choices > limit:
            self.rejected += 1
            raise overloaded(f"the server is at capacity ({self.admitted} sequences admitted, "
                             f"limit {limit}); retry after {self.retry_after_s} s",
                             self.retry_after_s)
        self.admitted += choices
        return Ticket(self, choices)

    @contextlib.asynccontextmanager
    async def seat(self) -> AsyncIterator[None]:
        """Hold a decode seat while the block runs; wait in arrival order for one.

        With no decode slot at all (no usable decode worker) the block runs at once: its
        placement answers 503. Lock-free (a queue of futures; a seat is handed from the
        choice that leaves it to the first one waiting), so no cancellation can wedge it.
        """
        if self._waiting or self.seated >= self.slots() > 0:
            fut = asyncio.get_running_loop().create_future()
            self._waiting.append(fut)
            try:
                while not fut.done():  # slots may grow without anybody leaving a seat
                    await asyncio.wait([fut], timeout=0.25)
                    self._hand_over()
            except BaseException:
                if fut.done() and not fut.cancelled():
                    self._leave()  # a seat was handed to us: pass it on
                else:
                    fut.cancel()
                    with contextlib.suppress(ValueError):
                        self._waiting.remove(fut)
                raise
        else:
            self.seated += 1
        try:
            yield
        finally:
            self._leave()

    def _leave(self) -> None:
        self.seated -= 1
        self._hand_over()

    def _hand_over(self) -> None:
        """Seat the first waiting choices while there are free slots (all of them when there
        is no decode slot at all)."""
        while self._waiting:
            slots = self.slots()
            if 0 < slots <= self.seated:
                return
            fut = self._waiting.popleft()
            if not fut.done():
                self.seated += 1
                fut.set_result(None)
