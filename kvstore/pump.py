"""The transfer thread: advances every live sender off the worker's engine loop.

A sender's writes complete, its staged layers become ready and its control messages return
whenever they do, not when the engine loop next polls. One :class:`TransferPump` per
:class:`~kvstore.engine.KVEngine` (``engine.pump``) runs a daemon thread that calls each
registered item's ``advance()``:

* ``advance() -> Progress``: ``BUSY`` (something is in flight: poll again after
  ``busy_interval_s``), ``IDLE`` (waiting for input: poll after ``idle_interval_s`` or at the
  next :meth:`TransferPump.kick`) or ``DONE`` (forget the item).

The thread never runs callbacks of the worker (releases stay with the worker's own ``poll``);
it only advances state machines, submits Transfer Engine writes and starts control messages.
"""

from __future__ import annotations

import enum
import logging
import threading
from typing import Protocol

log = logging.getLogger(__name__)


class Progress(enum.Enum):
    """What an item asks of the pump after one ``advance()``."""

    BUSY = "busy"
    IDLE = "idle"
    DONE = "done"


class Pumped(Protocol):
    def advance(self) -> Progress: ...


class TransferPump:
    """A daemon thread polling :class:`Pumped` items (module docstring).

    Args:
        busy_interval_s: poll period while some item is BUSY (seconds).
        idle_interval_s: poll period while every item is IDLE (seconds; deadlines are checked
            at this pace).
    """

    def __init__(self, busy_interval_s: float = 0.0002, idle_interval_s: float = 0.02) -> None:
        self.busy_interval_s, self.idle_interval_s = busy_interval_s, idle_interval_s
        self._items: list[Pumped] = []
        self._cond = threading.Condition()
        self._kicked = False
        self._stopped = False
        self._thread: threading.Thread | None = None

    def add(self, item: Pumped) -> None:
        """Advance ``item`` from now on until it reports DONE (starts the thread once)."""
        with self._cond:
            if self._stopped:
                return
            self._items.append(item)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kv-pump", daemon=True)
                self._thread.start()
            self._kicked = True
            self._cond.notify()

    def kick(self) -> None:
        """Advance every item now (new input arrived: a layer, a reply, a completion)."""
        with self._cond:
            self._kicked = True
            self._cond.notify()

    def __len__(self) -> int:
        with self._cond:
            return len(self._items)

    def stop(self) -> None:
        """End the thread (items are dropped; idempotent)."""
        with self._cond:
            self._stopped = True
            self._items.clear()
            self._cond.notify()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._items and not self._stopped:
                    self._cond.wait()
                if self._stopped:
                    return
                self._kicked = False
                items = list(self._items)
            busy, done = False, []
            for it in items:
                try:
                    p = it.advance()
                except Exception:
                    log.exception("transfer pump: advance() of %r raised", it)
                    p = Progress.DONE
                busy |= p is Progress.BUSY
                if p is Progress.DONE:
                    done.append(it)
            with self._cond:
                for it in done:
                    self._items.remove(it)
                if not self._kicked and self._items:
                    self._cond.wait(self.busy_interval_s if busy else self.idle_interval_s)


__all__ = ["Progress", "Pumped", "TransferPump"]
