"""One sender's control channel to its decode peer: status messages and background jobs.

:class:`PeerChannel` runs a :class:`~kvstore.sender.KVSender`'s pairing and status messages on
the decode peer's own executor of the shared :class:`~kvstore.client.BootstrapClient` (a peer
that does not answer holds only its own threads) and wakes the sender's transfer thread when a
job ends. Messages go as TE notifications (``notify="te"``, up to
:data:`~kvstore.engine.MAX_NOTIFY_BYTES`) or over HTTP; failure reports are best effort.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from k3serve.messages import StatusMessage
from kvstore.client import BootstrapClient
from kvstore.engine import MAX_NOTIFY_BYTES, KVEngine
from kvstore.errors import BootstrapError, TransferError
from kvstore.states import NOTIFY_NAME

log = logging.getLogger(__name__)


class PeerChannel:
    """Status messages and jobs of one sender to the decode peer at ``addr``.

    Args:
        client: the process's bootstrap client (per-peer executors).
        addr: the decode peer's bootstrap server, ``host:port``.
        engine: this process's Transfer Engine (TE notifications).
        notify_mode: ``"te"`` or ``"http"``.
        on_job_end: called (on the job's thread) whenever a job ends.

    Attributes:
        session, notify_addr: the peer's TE session and scratch address, once paired.
    """

    def __init__(self, client: BootstrapClient, addr: str, engine: KVEngine, notify_mode: str,
                 on_job_end: Callable[[], None]) -> None:
        self.client, self.addr, self.engine, self.notify_mode = client, addr, engine, notify_mode
        self.session, self.notify_addr = "", 0
        self._on_job_end = on_job_end

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        """``fn(*args)`` on the peer's executor."""
        fut = self.client.submit(fn, *args, peer=self.addr)
        fut.add_done_callback(lambda _: self._on_job_end())
        return fut

    def open_session(self, session: str, notify_addr: int) -> None:
        """On the first pairing with ``session`` in this process, open the Transfer Engine's
        connection to it now, on this control thread (an 8-byte write into the peer's
        notification scratch buffer): the first layer's writes then do not pay TE's segment
        handshake. Later pairings with the same peer reuse the connection."""
        if not self.client.first_contact(session):
            return
        try:
            self.engine.write(session, [(self.engine.scratch_addr, notify_addr, 8)])
        except TransferError as e:  # the writes will try (and report) again
            log.info("opening the transfer engine session %s failed: %s", session, e)

    def deliver(self, msg: StatusMessage) -> None:
        """Send ``msg`` (blocking): as a TE notification, or over HTTP when asked or when it
        is too large for one.

        Raises:
            TransferError: the notification failed. BootstrapError: the HTTP post failed.
        """
        text = msg.model_dump_json()
        if self.notify_mode == "te" and len(text.encode()) <= MAX_NOTIFY_BYTES:
            self.engine.notify(self.session, self.notify_addr, text, name=NOTIFY_NAME)
        else:
            self.client.post_status(self.addr, msg)

    def report(self, msg: StatusMessage) -> None:
        """Deliver a failure report, best effort: over HTTP, then as a TE notification when
        HTTP fails; dropped when the peer already has a backlog (it does not answer)."""

        def report() -> None:
            try:
                self.client.post_status(self.addr, msg)
            except BootstrapError:
                if self.session:  # HTTP gone: try the TE channel
                    self.engine.notify(self.session, self.notify_addr, msg.model_dump_json(),
                                       name=NOTIFY_NAME)

        self.client.submit_best_effort(report, peer=self.addr)

    def abandon(self, futs: list[Future | None], tag: str, after_s: float) -> None:
        """Stop waiting for ``futs``: queued ones are cancelled, running ones are left to
        their thread."""
        for fut in futs:
            if fut is not None and not fut.done():
                fut.cancel()
                log.info("%s: abandoning a control message to %s after %.1f s", tag, self.addr,
                         after_s)


__all__ = ["PeerChannel"]
