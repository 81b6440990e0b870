"""A decode request's lifecycle: :class:`DecodePhase`, the transitions, :class:`DecodeState`.

The order is drawn in :mod:`decode.worker`'s docstring (lifecycle steps 3 and 7–9 of
:mod:`k3serve.protocol`).
"""

from __future__ import annotations

import asyncio
import enum
import time
from dataclasses import dataclass

from k3serve.sampling import SamplingParams
from kvstore import KVReceiver


class DecodePhase(enum.Enum):
    """Where one decode request is (the module docstring draws the order)."""

    TRANSFER = "transfer"
    AWAIT_FIRST = "await_first"
    RUNNING = "running"
    DONE = "done"


_D = DecodePhase
#: The allowed transitions; :meth:`DecodeState.to` refuses any other.
TRANSITIONS: dict[DecodePhase, frozenset[DecodePhase]] = {
    _D.TRANSFER: frozenset({_D.RUNNING, _D.AWAIT_FIRST, _D.DONE}),
    _D.AWAIT_FIRST: frozenset({_D.RUNNING, _D.DONE}),
    _D.RUNNING: frozenset({_D.DONE}),
    _D.DONE: frozenset(),
}


@dataclass(eq=False)
class DecodeState:
    """One request's state on the decode worker (engine thread only)."""

    rid: str
    prompt: list[int]
    params: SamplingParams
    cache_salt: str | None
    events: asyncio.Queue  # of StreamEvent
    receiver: KVReceiver | None = None  # while its ticket is open or its release pending
    phase: DecodePhase = DecodePhase.TRANSFER
    engine_rid: str | None = None  # the engine request producing tokens
    reservation_open: bool = True  # the reserved engine request still holds slot + pages
    fallback: bool = False
    fb_counted: bool = False
    first: tuple[int, float] | None = None  # token #1 + logprob, from the stream request
    transferred_first: int | None = None  # token #1 as the transfer's metadata carried it
    failed_at: float = 0.0
    sent: int = 1  # output tokens delivered (token #1 came from the prefill worker)
    text_len: int = 0
    finished_at: float | None = None
    stream_opened: bool = False
    stream_closed: bool = False

    def to(self, phase: DecodePhase) -> None:
        """Move to ``phase`` (the one place phases change; stamps the times they start).

        Raises:
            RuntimeError: a transition :data:`TRANSITIONS` does not allow.
        """
        if phase not in TRANSITIONS[self.phase]:
            raise RuntimeError(f"decode {self.rid}: {self.phase.name} → {phase.name}")
        self.phase = phase
        if phase is _D.DONE:
            self.finished_at = time.monotonic()
        elif phase is _D.AWAIT_FIRST:
            self.fallback, self.failed_at = True, time.monotonic()


__all__ = ["TRANSITIONS", "DecodePhase", "DecodeState"]
