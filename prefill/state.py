"""A prefill request's lifecycle: :class:`PrefillPhase`, the transitions, :class:`PrefillState`.

The order is drawn in :mod:`prefill.worker`'s docstring (lifecycle steps 4–7 of
:mod:`k3serve.protocol`).
"""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass

from k3serve.protocol import FirstToken
from k3serve.sampling import SamplingParams
from kvstore import KVSender


class PrefillPhase(enum.Enum):
    """Where one prefill request is (the module docstring draws the order)."""

    WAITING = "waiting"
    COMPUTING = "computing"
    SAMPLED = "sampled"
    ANSWERED = "answered"
    ABORTING = "aborting"
    ENDED = "ended"


_P = PrefillPhase
#: The allowed transitions; :meth:`PrefillState.to` refuses any other.
TRANSITIONS: dict[PrefillPhase, frozenset[PrefillPhase]] = {
    _P.WAITING: frozenset({_P.COMPUTING, _P.SAMPLED, _P.ABORTING}),
    _P.COMPUTING: frozenset({_P.SAMPLED, _P.ABORTING}),
    _P.SAMPLED: frozenset({_P.ANSWERED, _P.ABORTING}),
    _P.ANSWERED: frozenset({_P.ENDED, _P.ABORTING}),
    _P.ABORTING: frozenset({_P.ENDED}),
    _P.ENDED: frozenset(),
}


@dataclass(eq=False)
class PrefillState:
    """One prefill request's state on the prefill worker (engine thread only)."""

    rid: str
    ids: list[int]
    params: SamplingParams
    ticket: str
    addr: str
    fut: asyncio.Future  # PrefillResponse, or a Failure
    fail_first_n: int = 0
    phase: PrefillPhase = PrefillPhase.WAITING
    sender: KVSender | None = None  # created at admission
    sender_at: float = 0.0  # time.monotonic() just before the sender was created
    num_cached: int = 0
    first: FirstToken | None = None
    first_at: float = 0.0  # time.monotonic() when token #1 was sampled
    first_text: str = ""  # the text token #1 released (the engine's detokenizer)
    first_finish: str | None = None  # set when token #1 finished the request
    events_after: int | None = None  # the router's event cursor (PrefillRequest.events_after)

    @property
    def answered(self) -> bool:
        """The router has its answer (token #1 or an error)."""
        return self.phase in (_P.ANSWERED, _P.ABORTING, _P.ENDED)

    def write_tail_s(self) -> float | None:
        """Seconds from the last layer ready (token #1 sampled: the prompt's last chunk has
        written every layer) to the sender's last write confirmed; ``None`` before both, or
        when the writes ended before the last layer (nothing left to wait for: 0)."""
        s = self.sender
        t_written = s.stats.get("t_written") if s is not None else None
        if t_written is None or not self.first_at:
            return None
        return max(0.0, self.sender_at + t_written - self.first_at)

    @property
    def pages_free(self) -> bool:
        """No write reads this request's slot and pages any more."""
        return self.sender is None or self.sender.released

    def to(self, phase: PrefillPhase) -> None:
        """Move to ``phase`` (the one place phases change).

        Raises:
            RuntimeError: a transition :data:`TRANSITIONS` does not allow.
        """
        if phase not in TRANSITIONS[self.phase]:
            raise RuntimeError(f"prefill {self.rid}: {self.phase.name} → {phase.name}")
        self.phase = phase


__all__ = ["TRANSITIONS", "PrefillPhase", "PrefillState"]
