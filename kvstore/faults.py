"""Injected transfer faults (``K3SERVE_KV_FAULT_FAIL_FRACTION`` / ``_HANG_FRACTION`` /
``_PAIR_FRACTION``): a prefill worker's senders fail, hang or cannot pair at a set fraction, so the fallbacks and deadlines of both
sides can be exercised on a live stack (tests, soaks). Off by default.

The choice is deterministic: with fraction f, sender n (1-based, per process) gets the fault
when ``floor(n·f + phase)`` steps up (a Bresenham schedule: exactly ⌊N·f⌋ or ⌈N·f⌉ of the
first N senders), failures with phase ½, hangs with phase 0.2 and pairing failures with
phase 0.8, so that with f = 0.1 the 5th, the 8th and the 2nd senders already get one (then
every 10th).

* ``fail``: once paired, the sender fails (reported to the decode side, which recomputes the
  prefill: ``k3serve:kv_transfer_fallbacks_total``);
* ``hang``: once paired, the sender never writes nor reports: the decode side's ticket
  expires at its deadline (``receiver_timeout_s``, then fallback) and the sender at its own
  (``sender_timeout_s``): ``k3serve:kv_transfer_expiries_total`` on both;
* ``pair``: the sender fails before pairing: the prefill worker answers 502
  ``transfer_pairing_failed`` instead of token #1, and the router places the request again.

Counted in ``k3serve:kv_faults_injected_total{kind}``.
"""

from __future__ import annotations

import math
import threading
from typing import Literal

Fault = Literal["fail", "hang", "pair"]


class FaultPlan:
    """Which senders get an injected fault.

    Args:
        fail_fraction: fraction of senders that fail, in [0, 1].
        hang_fraction: fraction of senders that hang, in [0, 1].
        pair_fraction: fraction of senders that cannot pair, in [0, 1]. A sender picked by
            several gets the first of fail, hang, pair.

    Raises:
        ValueError: a fraction outside [0, 1], or a sum above 1.
    """

    def __init__(self, fail_fraction: float = 0.0, hang_fraction: float = 0.0,
                 pair_fraction: float = 0.0) -> None:
        for name, f in (("fail_fraction", fail_fraction), ("hang_fraction", hang_fraction),
                        ("pair_fraction", pair_fraction)):
            if not 0.0 <= f <= 1.0:
                raise ValueError(f"FaultPlan.{name}: must lie in [0, 1], got {f}")
        if fail_fraction + hang_fraction + pair_fraction > 1.0:
            raise ValueError("FaultPlan: the fractions must sum to <= 1")
        self.fail_fraction, self.hang_fraction = fail_fraction, hang_fraction
        self.pair_fraction = pair_fraction
        self._n = 0
        self._lock = threading.Lock()

    @property
    def active(self) -> bool:
        return self.fail_fraction > 0 or self.hang_fraction > 0 or self.pair_fraction > 0

    def next(self) -> Fault | None:
        """The fault of the next sender (``None``: none). Thread-safe."""
        with self._lock:
            self._n += 1
            n = self._n

        def due(f: float, phase: float) -> bool:
            return math.floor(n * f + phase) > math.floor((n - 1) * f + phase)

        if due(self.fail_fraction, 0.5):
            return "fail"
        if due(self.hang_fraction, 0.2):
            return "hang"
        if due(self.pair_fraction, 0.8):
            return "pair"
        return None


__all__ = ["Fault", "FaultPlan"]
