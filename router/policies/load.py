"""The router's recent account of what it sent one prefill worker: ``util`` and ``request_rate``.

One implementation for the live router (``router.workers.Worker.load`` adds to it when a
prefill is sent; ``router.pipeline.Router.place`` reads it into the :class:`~router.policies.
WorkerView` it hands placement) and for the simulator (``simulate.engine``, the same calls at
simulated times), so ``prefix_home``'s bounded-load and externality terms see the same figures
in both.

Both figures are exponentially decayed sums with time constant ``horizon_s``::

    tokens(t) = Σ_sent uncached_tokens_i · exp(−(t − t_i) / H)
    util(t, rate) = tokens(t) / (rate · H)        # busy fraction: compute seconds sent per second
    request_rate(t) = Σ_sent exp(−(t − t_i) / H) / H    # requests per second

A worker that receives ``r`` tokens per second at a prefill rate ``R`` converges to
``util = r / R`` (and ``request_rate`` to its requests per second) after a few ``H``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

#: Default time constant of the account, seconds (``HomeParams.util_horizon_s``).
UTIL_HORIZON_S = 10.0


class RecentLoad:
    """Decayed account of uncached prefill tokens and requests sent to one worker.

    Args:
        horizon_s: time constant ``H`` of the decay, seconds (> 0).
        clock: monotonic seconds when a call gives no ``now`` (default ``time.monotonic``).

    Raises:
        ValueError: ``horizon_s`` ≤ 0.
    """

    __slots__ = ("_at", "_requests", "_tokens", "clock", "horizon_s")

    def __init__(self, horizon_s: float = UTIL_HORIZON_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not horizon_s > 0:
            raise ValueError(f"horizon_s: must be > 0, got {horizon_s!r}")
        self.horizon_s = float(horizon_s)
        self.clock = clock
        self._tokens = 0.0
        self._requests = 0.0
        self._at: float | None = None

    def _decay(self, now: float | None) -> None:
        t = self.clock() if now is None else now
        if self._at is None:
            self._at = t
        elif t > self._at:
            d = math.exp(-(t - self._at) / self.horizon_s)
            self._tokens *= d
            self._requests *= d
            self._at = t

    def add(self, tokens: float, requests: float = 1.0, now: float | None = None) -> None:
        """Count one placement: ``tokens`` predicted uncached prefill tokens, ``requests``
        requests, sent at ``now`` (seconds on the account's clock; ``None``: the clock)."""
        self._decay(now)
        self._tokens += tokens
        self._requests += requests

    def tokens(self, now: float | None = None) -> float:
        """Decayed uncached tokens sent (tokens)."""
        self._decay(now)
        return self._tokens

    def util(self, rate: float, now: float | None = None) -> float:
        """Recent busy fraction at prefill ``rate`` tokens/s: ``tokens / (rate · H)``, ≥ 0."""
        return self.tokens(now) / (rate * self.horizon_s)

    def request_rate(self, now: float | None = None) -> float:
        """Recent requests per second sent (decayed count / ``H``), ≥ 0."""
        self._decay(now)
        return self._requests / self.horizon_s


class PoolLoad:
    """``util`` and ``request_rate`` of one prefill worker as a router replica sees them:
    each the larger of its own account (``own``: what this router sent) and the pool's
    (``seen``: the worker's work by its reports, which every replica pulls — its prefill
    counters, ``WorkerLoad.prefills`` / ``prefill_tokens``, or from a worker without them the
    MLA blocks its cache events say it computed, and no requests — plus ``pending`` tokens
    and ``pending_requests`` this router sent after the last pull). Without the counters
    ``request_rate`` is the own account's (the events do not count requests; an estimate of
    the others' from their tokens swings with the size of the few requests one replica sent).

    One router alone reads its own account (it counts a prefill when sent, the events a poll
    later and without the last partial block); N replicas that share nothing read the pool's,
    so each bounds the load on the traffic of all N rather than on its own 1/N.
    Blocks a worker loads from the shared store are stored events too: with a store the
    pool's figure over-counts compute (placement then sees that worker busier).

    Args:
        own: the router's :class:`RecentLoad` (``Worker.recent``).
        seen: a :class:`RecentLoad` of computed tokens from the worker's events (no requests).
        pending: tokens sent since the last pull (``Worker.sent_since_report``), ≥ 0.
        pending_requests: requests sent since the last pull
            (``Worker.requests_since_report``), ≥ 0.
    """

    __slots__ = ("own", "pending", "pending_requests", "seen")

    def __init__(self, own: RecentLoad, seen: RecentLoad, pending: float = 0.0,
                 pending_requests: float = 0.0) -> None:
        self.own, self.seen, self.pending = own, seen, pending
        self.pending_requests = pending_requests

    def util(self, rate: float, now: float | None = None) -> float:
        """Busy fraction at ``rate`` tokens/s: ``max(own, pool)``, ≥ 0."""
        return max(self.own.util(rate, now),
                   (self.seen.tokens(now) + self.pending) / (rate * self.seen.horizon_s))

    def request_rate(self, now: float | None = None) -> float:
        """Requests per second: ``max(own, pool)`` (the pool's is 0 without the worker's
        counters), ≥ 0."""
        return max(self.own.request_rate(now),
                   self.seen.request_rate(now) + self.pending_requests / self.seen.horizon_s)


__all__ = ["UTIL_HORIZON_S", "PoolLoad", "RecentLoad"]
