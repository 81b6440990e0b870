"""KVReceiver: the decode side of one request's cache transfer, a ``poll()`` state machine.

    BOOTSTRAPPING ──a sender paired──▶ WAITING_FOR_INPUT ──first layer landed──▶ TRANSFERRING
          │                                   │                                      │
          │                                   └──────────── done + manifest ok ──────┴──▶ SUCCESS
          └── timeout / abort / sender failed / fingerprint refused / manifest short ──────▶ FAILED

Use from the decode worker (one :class:`KVBootstrapServer` per process)::

    slot, pages = allocator.reserve(num_tokens)
    rx = KVReceiver(server, CacheRef(slot, pages, num_tokens),
                    on_release=lambda: allocator.free(slot, pages))
    # give rx.ticket and server.address to the router → prefill worker
    ...
    st = rx.poll()            # each scheduler step
    if st == KVPoll.SUCCESS:  admit(rx.result.metadata)   # slot/pages now belong to the request
    if st == KVPoll.FAILED:   recompute_prefill(); rx.error says why; on_release frees later

The receiver never frees anything itself on success. On failure ``on_release`` runs once no
paired sender can still write into the reservation (see :mod:`kvstore.tickets`); keep calling
``server.pump()`` (or any receiver's ``poll()``) so it runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvstore.bootstrap import KVBootstrapServer
from kvstore.descriptors import CacheRef
from kvstore.states import KVPoll, TransferResult


class KVReceiver:
    """Receive one request's cache into a reserved slot and pages.

    Args:
        server: this process's bootstrap server.
        ref: the reserved slot, pages and prompt length (tokens): a :class:`CacheRef` or
            anything with ``slot``, ``pages``, ``num_tokens`` (``k3serve.protocol.CacheHandle``).
        ticket: the transfer ticket (default: a fresh id; read :attr:`ticket`).
        timeout_s: FAILED if not SUCCESS within this many seconds (of pairing, when
            ``pair_timeout_s`` is given; else of registration).
        pair_timeout_s: FAILED if no sender paired within this many seconds (``None``: the
            one ``timeout_s`` deadline); see :meth:`KVBootstrapServer.register_ticket`.
        on_release: called once when a *failed* reservation may be reused.

    Raises:
        ValueError: ``ref`` does not fit the server's layout; duplicate ticket.
    """

    def __init__(
        self,
        server: KVBootstrapServer,
        ref: CacheRef | Any,
        *,
        ticket: str | None = None,
        timeout_s: float = 60.0,
        pair_timeout_s: float | None = None,
        on_release: Callable[[], None] | None = None,
    ) -> None:
        self.server = server
        self.ref = CacheRef.of(ref)
        self._rec = server.register_ticket(
            self.ref,
            ticket,
            timeout_s=timeout_s,
            pair_timeout_s=pair_timeout_s,
            on_release=on_release,
        )
        self.ticket = self._rec.ticket

    def poll(self) -> KVPoll:
        """Drain notifications, apply timeouts and releases; return the state (non-blocking)."""
        self.server.pump()
        return self._rec.state

    @property
    def state(self) -> KVPoll:
        return self._rec.state

    @property
    def result(self) -> TransferResult | None:
        """Metadata and manifest once SUCCESS, else None."""
        return self._rec.result

    @property
    def error(self) -> str | None:
        """Why it FAILED (names the cause: timeout, sender failure, fingerprint, manifest)."""
        return self._rec.error

    @property
    def layers_received(self) -> dict[int, int]:
        """Bytes per global layer the sender reported landed so far (progress or manifest)."""
        return dict(sorted(self._rec.layers.items()))

    @property
    def expired(self) -> bool:
        """FAILED because its deadline passed (pairing or transfer timeout)."""
        return self._rec.expired

    @property
    def released(self) -> bool:
        """Whether ``on_release`` ran (failed reservations only)."""
        return self._rec.released

    def abort(self, reason: str = "aborted by decode") -> None:
        """Fail the ticket now (a later pairing is refused); the reservation is released once
        no sender can still write into it."""
        self.server.abort_ticket(self.ticket, reason)

    def close(self) -> None:
        """Forget the ticket on the server (after SUCCESS, or FAILED and released).

        Raises:
            ValueError: still open, or its release is pending.
        """
        self.server.forget(self.ticket)


__all__ = ["KVReceiver"]
