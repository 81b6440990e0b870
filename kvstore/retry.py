"""One sender's retry budget, on tenacity's policies (stop after N retries, exponential wait).

A :class:`~kvstore.sender.KVSender` has ``max_retries`` retries *in total*, shared by its
pairing (HTTP), its writes and its completion message. The blocking jobs (pairing, the
completion message; they run on the :class:`~kvstore.client.BootstrapClient` pool) retry with
:meth:`RetryBudget.retrying`, a ``tenacity.Retrying``; the writes are asynchronous TE handles
polled by the sender's state machine, which asks :meth:`RetryBudget.take` and
:meth:`RetryBudget.backoff` instead of blocking. The n-th retry waits
``min(max_backoff_s, backoff_s · 2^(n-1))`` seconds.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TypeVar

import tenacity

from kvstore.errors import BootstrapError, KVStoreError, TransferError

log = logging.getLogger(__name__)
T = TypeVar("T")


def transient(e: BaseException) -> bool:
    """Whether another attempt can help: an unreachable server or a 5xx
    (:attr:`BootstrapError.retryable`), a failed Transfer Engine call; not a refusal."""
    if isinstance(e, BootstrapError):
        return e.retryable
    return isinstance(e, TransferError)


class RetryBudget:
    """``max_retries`` retries shared by every retrying step of one transfer; thread-safe.

    Args:
        max_retries: retries in total (0: every failure is final).
        backoff_s: wait before the first retry (seconds); doubles per retry.
        max_backoff_s: the longest wait (seconds).

    Raises:
        ValueError: a negative count or wait.
    """

    def __init__(self, max_retries: int, backoff_s: float, max_backoff_s: float = 1.0) -> None:
        if max_retries < 0 or backoff_s < 0 or max_backoff_s < 0:
            raise ValueError(
                f"RetryBudget: max_retries {max_retries}, backoff_s {backoff_s}, "
                f"max_backoff_s {max_backoff_s} must be >= 0"
            )
        self.max_retries = max_retries
        self._wait = tenacity.wait_exponential(multiplier=backoff_s, max=max_backoff_s)
        self._probe = tenacity.RetryCallState(None, None, (), ())  # type: ignore[arg-type]
        self._used = 0
        self._lock = threading.Lock()

    @property
    def used(self) -> int:
        """Retries taken so far."""
        return self._used

    def take(self) -> bool:
        """Use one retry; False (nothing used) when the budget is spent."""
        with self._lock:
            if self._used >= self.max_retries:
                return False
            self._used += 1
            return True

    def backoff(self) -> float:
        """Wait before the latest retry taken (seconds)."""
        return self._backoff_for(self.used)

    def _backoff_for(self, n: int) -> float:
        """Wait before retry ``n`` (1-based; 0 for none) in seconds: tenacity's exponential."""
        if n <= 0:
            return 0.0
        with self._lock:
            self._probe.attempt_number = n
            return float(self._wait(self._probe))

    def retrying(
        self,
        retryable: Callable[[BaseException], bool],
        stop_early: Callable[[], bool],
        sleep: Callable[[float], object],
        what: str = "",
    ) -> tenacity.Retrying:
        """A ``tenacity.Retrying`` that retries an exception when ``retryable(exc)``, stops
        when ``stop_early()`` or the budget is spent (re-raising the last exception), and
        waits :meth:`backoff` through ``sleep`` (e.g. an ``Event.wait``: an abort cuts it
        short)."""

        def stop(_: tenacity.RetryCallState) -> bool:
            return stop_early() or not self.take()

        def before_sleep(rs: tenacity.RetryCallState) -> None:
            exc = rs.outcome.exception() if rs.outcome is not None else None
            log.info("%s: retry %d in %.2f s: %s", what, self.used, rs.upcoming_sleep, exc)

        return tenacity.Retrying(
            retry=tenacity.retry_if_exception(retryable),
            stop=stop,
            # tenacity asks the wait before the stop (which takes the retry): the next one's
            wait=lambda _: self._backoff_for(self.used + 1),
            sleep=sleep,
            before_sleep=before_sleep,
            reraise=True,
        )

    def run(
        self,
        fn: Callable[[], T],
        stop_early: Callable[[], bool],
        sleep: Callable[[float], object],
        what: str = "",
    ) -> T:
        """``fn()`` retried on :func:`transient` errors (see :meth:`retrying`).

        Raises:
            KVStoreError: ``stop_early()`` before an attempt (the caller is failing).
            the last error of ``fn``: not transient, budget spent, or stopped early.
        """

        def attempt() -> T:
            if stop_early():
                raise KVStoreError(f"{what}: abandoned")
            return fn()

        return self.retrying(transient, stop_early, sleep, what)(attempt)


__all__ = ["RetryBudget", "transient"]
