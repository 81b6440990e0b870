"""The decode side's ticket table: one record per reservation and its receiver state machine
(pure: no HTTP, no engine). :class:`kvstore.bootstrap.KVBootstrapServer` serves it.

Receiver state per ticket (:class:`KVPoll`, read through :class:`kvstore.receiver.KVReceiver`)::

    BOOTSTRAPPING ──pair──▶ WAITING_FOR_INPUT ──"layer"──▶ TRANSFERRING ──"done" + manifest ok──▶ SUCCESS
          └── timeout / abort / sender failed / fingerprint refused / manifest short ──▶ FAILED

A ``done`` message carries the sender's per-layer byte manifest; the ticket succeeds only if it
equals the bytes this side expects for every layer (from its own layout and the reserved
slot/pages). Releasing a failed reservation (``on_release``) is deferred while a paired sender
might still write into it: until the sender reports that it is quiesced, or until the sender's
announced ``quiesce_by_s`` (+ ``release_grace_s``) has passed — a late one-sided write would
otherwise land in pages that already belong to another request — or until the sender is known
dead: a pending release probes the sender's Transfer Engine port (``host:rpc_port``, from the
pairing) every ``probe_interval_s`` on a background thread, and a refused connection means
its process is gone (nothing of it can land any more). A probe that times out proves nothing.
"""

from __future__ import annotations

import queue
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from k3serve.messages import StatusMessage
from kvstore.descriptors import CacheRef, PoolLayout, expected_layer_bytes, validate_ref
from kvstore.states import KVPoll, TransferResult


@dataclass
class TicketRecord:
    """Server-side state of one reservation (read it through :class:`KVReceiver`).

    Times are ``time.monotonic()`` seconds.
    """

    ticket: str
    ref: CacheRef
    expected: dict[int, int]
    created: float
    deadline: float
    on_release: Callable[[], None] | None = None
    state: KVPoll = KVPoll.BOOTSTRAPPING
    sender: str | None = None
    paired_at: float | None = None
    sender_quiesce_at: float | None = None
    quiesced: bool = False
    layers: dict[int, int] = field(default_factory=dict)
    result: TransferResult | None = None
    error: str | None = None
    released: bool = False
    finished_at: float | None = None
    transfer_timeout_s: float | None = None  # set: the deadline restarts at pairing
    expired: bool = False  # FAILED because the deadline passed
    sender_session: str | None = None  # the sender's TE ``host:rpc_port`` (liveness probes)
    probed_at: float = 0.0


class TicketTable:
    """Reservations a sender may fill, keyed by ticket; thread-safe.

    Args:
        layout: this process's :class:`PoolLayout` (the destination addresses).
        release_grace_s: extra wait after a paired sender's announced quiesce time before a
            failed reservation is released (seconds).
        ticket_ttl_s: finished tickets are forgotten this long after they finish (seconds).
        probe_interval_s: a failed ticket whose release is pending probes its sender's port
            this often (seconds; see the module docstring).
        on_landed: called with a ticket's reservation once its bytes are complete, before it
            turns SUCCESS (host staging copies them mirror → device pools there,
            :meth:`kvstore.staging.HostStaging.stage_in_ref`); an exception fails the ticket.
    """

    def __init__(
        self, layout: PoolLayout, *, release_grace_s: float = 2.0, ticket_ttl_s: float = 300.0,
        probe_interval_s: float = 1.0,
        on_landed: Callable[[CacheRef], None] | None = None,
    ) -> None:
        self.layout = layout
        self.on_landed = on_landed
        self.release_grace_s = release_grace_s
        self.ticket_ttl_s = ticket_ttl_s
        self.probe_interval_s = probe_interval_s
        self._tickets: dict[str, TicketRecord] = {}
        self._lock = threading.RLock()
        self._probes: queue.SimpleQueue[TicketRecord] | None = None

    # ------------------------------------------------------------------ tickets
    def register_ticket(
        self,
        ref: CacheRef,
        ticket: str | None = None,
        *,
        timeout_s: float = 60.0,
        pair_timeout_s: float | None = None,
        on_release: Callable[[], None] | None = None,
    ) -> TicketRecord:
        """Register a reservation that a sender may fill.

        Args:
            ref: the reserved slot, pages and prompt length.
            ticket: an id (default: a fresh UUID hex).
            timeout_s: the ticket fails if not completed within this (seconds): counted from
                registration, or from pairing when ``pair_timeout_s`` is given.
            pair_timeout_s: how long the ticket waits for its sender to pair (seconds; the
                prefill worker pairs when it admits the request, which may first queue
                there); after pairing, ``timeout_s`` applies. ``None``: one deadline,
                ``timeout_s`` from registration.
            on_release: called once, from :meth:`pump`, when a *failed* reservation can be
                reused (never after success: the request then owns slot and pages).

        Raises:
            ValueError: ``ref`` does not fit the layout; duplicate ticket.
        """
        validate_ref(self.layout, ref, "dst")
        ticket = ticket or uuid.uuid4().hex
        now = time.monotonic()
        rec = TicketRecord(
            ticket,
            ref,
            expected_layer_bytes(self.layout, ref),
            now,
            now + (timeout_s if pair_timeout_s is None else pair_timeout_s),
            on_release,
            transfer_timeout_s=None if pair_timeout_s is None else timeout_s,
        )
        with self._lock:
            if ticket in self._tickets:
                raise ValueError(f"ticket {ticket!r} already registered")
            self._tickets[ticket] = rec
        return rec

    def get(self, ticket: str) -> TicketRecord:
        """Raises KeyError for an unknown (or forgotten) ticket."""
        with self._lock:
            return self._tickets[ticket]

    def abort_ticket(self, ticket: str, reason: str = "aborted by decode") -> None:
        """Fail an open ticket (no-op when already finished); the reservation is released by
        :meth:`pump` once no sender can still write into it."""
        with self._lock:
            rec = self._tickets.get(ticket)
            if rec is not None:
                self._finish(rec, KVPoll.FAILED, reason)
        self.pump()

    def forget(self, ticket: str) -> None:
        """Drop a finished ticket now (it is otherwise dropped ``ticket_ttl_s`` after finishing).
        Raises ValueError when it is open or its release is still pending."""
        with self._lock:
            rec = self._tickets.get(ticket)
            if rec is None:
                return
            if not rec.state.terminal or (rec.state == KVPoll.FAILED and not rec.released):
                raise ValueError(f"ticket {ticket} is still open or not yet released")
            del self._tickets[ticket]

    def open_tickets(self) -> int:
        with self._lock:
            return sum(1 for r in self._tickets.values() if not r.state.terminal)

    def unreleased(self) -> int:
        """Failed reservations whose release is still pending."""
        with self._lock:
            return sum(
                1 for r in self._tickets.values() if r.state == KVPoll.FAILED and not r.released
            )

    # ------------------------------------------------------------------ progress
    def pump(self) -> None:
        """Apply timeouts, release failed reservations, forget old tickets."""
        now = time.monotonic()
        release: list[TicketRecord] = []
        with self._lock:
            for rec in list(self._tickets.values()):
                if not rec.state.terminal and now > rec.deadline:
                    rec.expired = True
                    self._finish(
                        rec,
                        KVPoll.FAILED,
                        f"timed out after {now - rec.created:.1f} s in state "
                        f"{rec.state.name} (sender {'paired' if rec.sender else 'never paired'})",
                    )
                if (rec.state == KVPoll.FAILED and not rec.released and rec.sender is not None
                        and not rec.quiesced and rec.sender_session
                        and now - rec.probed_at > self.probe_interval_s):
                    rec.probed_at = now
                    self._probe(rec)
                if rec.state == KVPoll.FAILED and not rec.released:
                    safe = (
                        rec.sender is None
                        or rec.quiesced
                        or (
                            rec.sender_quiesce_at is not None
                            and now > rec.sender_quiesce_at + self.release_grace_s
                        )
                    )
                    if safe:
                        rec.released = True
                        release.append(rec)
                if (
                    rec.finished_at is not None
                    and now - rec.finished_at > self.ticket_ttl_s
                    and (rec.state == KVPoll.SUCCESS or rec.released)
                ):
                    del self._tickets[rec.ticket]
        for rec in release:  # outside the lock: callbacks may call back into us
            if rec.on_release is not None:
                rec.on_release()

    def _probe(self, rec: TicketRecord) -> None:
        """Queue a liveness probe of ``rec``'s sender (a daemon thread runs them)."""
        if self._probes is None:
            self._probes = queue.SimpleQueue()
            threading.Thread(target=self._probe_loop, args=(self._probes,), daemon=True,
                             name="kv-sender-probe").start()
        self._probes.put(rec)

    def _probe_loop(self, probes: queue.SimpleQueue[TicketRecord]) -> None:
        while True:
            rec = probes.get()
            host, _, port = (rec.sender_session or "").rpartition(":")
            if not host or not port.isdigit():
                continue
            try:
                with socket.create_connection((host.strip("[]"), int(port)), timeout=1.0):
                    pass
            except ConnectionRefusedError:
                with self._lock:
                    if not rec.quiesced:
                        rec.quiesced = True  # its process is gone: the next pump releases
                        rec.error = f"{rec.error}; the sender is gone"
            except OSError:
                pass  # unreachable or slow: proves nothing

    def _finish(self, rec: TicketRecord, state: KVPoll, error: str | None = None) -> None:
        if rec.state.terminal:
            return
        rec.state, rec.error, rec.finished_at = state, error, time.monotonic()

    def on_status(self, msg: StatusMessage) -> tuple[bool, str]:
        """Apply a sender's status message (from TE or HTTP); returns ``(accepted, why)``."""
        with self._lock:
            rec = self._tickets.get(msg.ticket)
            if rec is None:
                return False, "unknown ticket"
            if rec.sender != msg.sender:
                return False, "not the paired sender"
            if msg.kind in ("failed", "aborted"):
                rec.quiesced = rec.quiesced or msg.quiesced
                rec.layers.update(msg.layers)
                self._finish(rec, KVPoll.FAILED, f"sender {msg.kind}: {msg.error}")
                return True, rec.state.name
            if rec.state.terminal:
                if msg.kind == "done":  # the sender stopped writing: a pending release may go
                    rec.quiesced = True
                return False, f"ticket already {rec.state.name}" + (
                    f": {rec.error}" if rec.error else ""
                )
            if msg.kind == "layer":
                rec.layers.update(msg.layers)
                rec.state = KVPoll.TRANSFERRING
                return True, rec.state.name
            return self._on_done(rec, msg)

    def _on_done(self, rec: TicketRecord, msg: StatusMessage) -> tuple[bool, str]:
        # 'done' means the sender stopped writing, whatever we make of it
        rec.quiesced = True
        rec.layers.update(msg.layers)
        bad = [
            f"layer {l}: got {msg.layers.get(l, 0)} B, expected {n} B"
            for l, n in rec.expected.items()
            if msg.layers.get(l, 0) != n
        ] + [f"layer {l}: unexpected" for l in msg.layers if l not in rec.expected]
        if bad:
            self._finish(rec, KVPoll.FAILED, "incomplete transfer: " + "; ".join(bad[:6]))
            return False, rec.error or ""
        if msg.metadata is None:
            self._finish(rec, KVPoll.FAILED, "done without metadata")
            return False, rec.error or ""
        rec.result = TransferResult(
            ticket=rec.ticket,
            metadata=msg.metadata,
            layer_bytes=dict(sorted(msg.layers.items())),
            total_bytes=sum(msg.layers.values()),
            num_runs=msg.runs,
            attempts=msg.attempts,
            sender_seconds=msg.elapsed_s,
            seconds=time.monotonic() - rec.created,
        )
        if self.on_landed is not None:
            try:
                self.on_landed(rec.ref)
            except Exception as e:  # noqa: BLE001 - the request recomputes; never a crash
                rec.result = None
                self._finish(rec, KVPoll.FAILED, f"copying the landed cache in failed: {e!r}")
                return False, rec.error or ""
        self._finish(rec, KVPoll.SUCCESS)
        return True, rec.state.name


__all__ = ["TicketRecord", "TicketTable"]
