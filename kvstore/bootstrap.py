"""Bootstrap: the decode side's ticket table and HTTP server, and the prefill side's client.

Decode side (one :class:`KVBootstrapServer` per decode worker process)::

    server = KVBootstrapServer(engine, layout, host="127.0.0.1", port=0).start()
    rec = server.register_ticket(CacheRef(slot, pages, num_tokens), on_release=free_cb)
    # hand rec.ticket and server.address to the router; poll via KVReceiver / server.pump()

HTTP (JSON) — kvstore to kvstore, never the router:

    POST /kv/pair    {ticket, sender, fingerprint, quiesce_by_s}
        200 {session_id, notify_addr, layout, dst, fingerprint}
        404 unknown ticket · 409 fingerprint mismatch (diffs + the server's fingerprint) or
        another sender already paired · 410 ticket no longer open (aborted, timed out, failed)
    POST /kv/status  StatusMessage (kvstore.states) → 200 {accepted, state} · 409 refused
    GET  /kv/health  {ok, session_id, fingerprint_hash, open_tickets}

Completion and progress also arrive as TE notifications (name ``k3kv``, message = the same
StatusMessage JSON); :meth:`KVBootstrapServer.pump` drains them. A ``done`` message carries
the sender's per-layer byte manifest; the ticket succeeds only if it equals the bytes this
side expects for every layer (computed from its own layout and the reserved slot/pages).

Releasing a failed reservation (``on_release``) is deferred while a paired sender might still
write into it: until the sender reports that it is quiesced, or until the sender's announced
``quiesce_by_s`` (+ ``release_grace_s``) has passed — a late one-sided write would otherwise
land in pages that already belong to another request.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Self

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from kvstore.descriptors import (
    CacheRef,
    PoolLayout,
    expected_layer_bytes,
    fingerprint_diff,
    validate_ref,
)
from kvstore.errors import BootstrapError, FingerprintMismatch
from kvstore.states import NOTIFY_NAME, KVPoll, StatusMessage, TransferResult

log = logging.getLogger(__name__)


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


class KVBootstrapServer:
    """The decode side's ticket table + HTTP endpoint (uvicorn in a daemon thread).

    Args:
        engine: this process's :class:`~kvstore.engine.KVEngine` (its pools registered).
        layout: this process's :class:`PoolLayout` (the destination addresses).
        host, port: where to listen (port 0: any free port; see :attr:`address`).
        release_grace_s: extra wait after a paired sender's announced quiesce time before a
            failed reservation is released (seconds).
        ticket_ttl_s: finished tickets are forgotten this long after they finish (seconds).
    """

    def __init__(
        self,
        engine: Any,
        layout: PoolLayout,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        release_grace_s: float = 2.0,
        ticket_ttl_s: float = 300.0,
    ) -> None:
        self.engine = engine
        self.layout = layout
        self.host, self.port = host, port
        self.release_grace_s = release_grace_s
        self.ticket_ttl_s = ticket_ttl_s
        self._fingerprint = layout.fingerprint()
        self._layout_dict = layout.to_dict()
        self._tickets: dict[str, TicketRecord] = {}
        self._lock = threading.RLock()
        self._server: Any = None
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ lifecycle
    def start(self, timeout_s: float = 10.0) -> KVBootstrapServer:
        """Start serving; returns self once the socket is bound.

        Raises:
            RuntimeError: uvicorn did not start within ``timeout_s`` seconds.
        """
        import uvicorn

        cfg = uvicorn.Config(
            self._app(),
            host=self.host,
            port=self.port,
            log_level="warning",
            access_log=False,
            lifespan="off",
        )
        self._server = uvicorn.Server(cfg)
        self._thread = threading.Thread(target=self._server.run, name="kv-bootstrap", daemon=True)
        self._thread.start()
        t_end = time.monotonic() + timeout_s
        while not self._server.started:
            if time.monotonic() > t_end or not self._thread.is_alive():
                raise RuntimeError(f"bootstrap server did not start on {self.host}:{self.port}")
            time.sleep(0.01)
        self.port = self._server.servers[0].sockets[0].getsockname()[1]
        return self

    def stop(self) -> None:
        """Stop serving (idempotent)."""
        if self._server is not None:
            self._server.should_exit = True
            if self._thread is not None:
                self._thread.join(timeout=5)
            self._server = self._thread = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def address(self) -> str:
        """``host:port`` of the HTTP endpoint (what the router hands the prefill worker)."""
        return f"{self.host}:{self.port}"

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
        """Drain TE notifications, apply timeouts, release failed reservations, forget old
        tickets. Call it from the decode loop (each :meth:`KVReceiver.poll` does)."""
        for name, msg in self.engine.notifications():
            if name != NOTIFY_NAME:
                log.warning("ignoring TE notification %r", name)
                continue
            try:
                self.on_status(StatusMessage.from_dict(json.loads(msg)))
            except (ValueError, json.JSONDecodeError) as e:
                log.warning("bad kv notification: %s", e)
        now = time.monotonic()
        release: list[TicketRecord] = []
        with self._lock:
            for rec in list(self._tickets.values()):
                if not rec.state.terminal and now > rec.deadline:
                    self._finish(
                        rec,
                        KVPoll.FAILED,
                        f"timed out after {now - rec.created:.1f} s in state "
                        f"{rec.state.name} (sender {'paired' if rec.sender else 'never paired'})",
                    )
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

    def _finish(self, rec: TicketRecord, state: KVPoll, error: str | None = None) -> None:
        if rec.state.terminal:
            return
        rec.state, rec.error, rec.finished_at = state, error, time.monotonic()

    # ------------------------------------------------------------------ handlers
    def pair(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """Handle a pairing request; returns ``(http status, json body)``."""
        ticket, sender = str(body.get("ticket", "")), str(body.get("sender", ""))
        with self._lock:
            rec = self._tickets.get(ticket)
            if rec is None:
                return 404, {"error": "unknown_ticket", "detail": f"no ticket {ticket!r} here"}
            if rec.state.terminal:
                return 410, {
                    "error": "ticket_closed",
                    "state": rec.state.name,
                    "detail": rec.error or "",
                }
            if rec.sender is not None and rec.sender != sender:
                return 409, {
                    "error": "already_paired",
                    "detail": f"ticket {ticket} has another sender",
                }
            diffs = fingerprint_diff(self._fingerprint, dict(body.get("fingerprint") or {}))
            if diffs:
                self._finish(
                    rec,
                    KVPoll.FAILED,
                    "refused to pair: layout fingerprint mismatch: " + "; ".join(diffs),
                )
                return 409, {
                    "error": "fingerprint_mismatch",
                    "diffs": diffs,
                    "fingerprint": self._fingerprint,
                }
            now = time.monotonic()
            if rec.sender is None:
                rec.sender, rec.paired_at = sender, now
                rec.state = KVPoll.WAITING_FOR_INPUT
                if rec.transfer_timeout_s is not None:
                    rec.deadline = now + rec.transfer_timeout_s
            rec.sender_quiesce_at = now + float(body.get("quiesce_by_s", 60.0))
            return 200, {
                "session_id": self.engine.session_id,
                "notify_addr": self.engine.scratch_addr,
                "layout": self._layout_dict,
                "fingerprint": self._fingerprint,
                "dst": rec.ref.to_dict(),
            }

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
            # done: the manifest must match what we expect, layer by layer.
            rec.layers.update(msg.layers)
            bad = [
                f"layer {l}: got {msg.layers.get(l, 0)} B, expected {n} B"
                for l, n in rec.expected.items()
                if msg.layers.get(l, 0) != n
            ] + [f"layer {l}: unexpected" for l in msg.layers if l not in rec.expected]
            if bad:
                self._finish(rec, KVPoll.FAILED, "incomplete transfer: " + "; ".join(bad[:6]))
                rec.quiesced = True  # 'done' means the sender stopped writing
                return False, rec.error or ""
            now = time.monotonic()
            rec.quiesced = True
            rec.result = TransferResult(
                ticket=rec.ticket,
                metadata=msg.metadata,
                layer_bytes=dict(sorted(msg.layers.items())),
                total_bytes=sum(msg.layers.values()),
                num_runs=msg.runs,
                attempts=msg.attempts,
                sender_seconds=msg.elapsed_s,
                seconds=now - rec.created,
            )
            self._finish(rec, KVPoll.SUCCESS)
            return True, rec.state.name

    def health(self) -> dict[str, Any]:
        return {
            "ok": True,
            "session_id": self.engine.session_id,
            "fingerprint_hash": self.layout.fingerprint_hash(),
            "open_tickets": self.open_tickets(),
        }

    def _app(self) -> Any:
        app = FastAPI(title="k3serve kvstore bootstrap", docs_url=None, redoc_url=None)

        @app.post("/kv/pair")
        async def pair(request: Request) -> JSONResponse:
            status, body = self.pair(await request.json())
            return JSONResponse(body, status_code=status)

        @app.post("/kv/status")
        async def status(request: Request) -> JSONResponse:
            try:
                msg = StatusMessage.from_dict(await request.json())
            except ValueError as e:
                return JSONResponse({"accepted": False, "error": str(e)}, status_code=400)
            ok, why = self.on_status(msg)
            return JSONResponse({"accepted": ok, "state": why}, status_code=200 if ok else 409)

        @app.get("/kv/health")
        async def health() -> dict[str, Any]:
            return self.health()

        return app


class BootstrapClient:
    """The prefill side's control channel: pairing and status messages over HTTP, plus a small
    thread pool for background jobs (HTTP posts, TE notifications). One per prefill process,
    shared by its senders.

    Args:
        http_timeout_s: per HTTP request (seconds).
        workers: background threads.
    """

    def __init__(self, http_timeout_s: float = 2.0, workers: int = 2) -> None:
        self._http = httpx.Client(timeout=http_timeout_s, trust_env=False)
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kv-ctl")

    def pair(
        self, addr: str, body: dict[str, Any], local_fingerprint: dict[str, Any]
    ) -> dict[str, Any]:
        """Ask ``addr``'s bootstrap server for the destination of ``body['ticket']``.

        Raises:
            FingerprintMismatch: the layouts differ (lines name each field, local = ours).
            BootstrapError: unreachable (retryable), unknown / closed / taken ticket (not).
        """
        r = self._request("POST", addr, "/kv/pair", body)
        data = _json(r)
        if r.status_code == 409 and data.get("error") == "fingerprint_mismatch":
            theirs = data.get("fingerprint") or {}
            raise FingerprintMismatch(
                fingerprint_diff(local_fingerprint, theirs) or list(data.get("diffs") or []),
                f"prefill vs decode {addr}",
            )
        if r.status_code != 200:
            raise BootstrapError(
                f"pair with {addr} refused ({r.status_code}): {data.get('error')}: {data.get('detail', '')}",
                r.status_code,
                retryable=r.status_code >= 500,
            )
        return data

    def post_status(self, addr: str, msg: StatusMessage) -> dict[str, Any]:
        """Deliver a status message over HTTP.

        Raises:
            BootstrapError: unreachable (retryable) or refused (not retryable; e.g. the ticket
                was aborted or the manifest did not match).
        """
        r = self._request("POST", addr, "/kv/status", msg.to_dict())
        data = _json(r)
        if r.status_code != 200:
            raise BootstrapError(
                f"status {msg.kind} for {msg.ticket} refused by {addr} ({r.status_code}): "
                f"{data.get('state') or data.get('error')}",
                r.status_code,
                retryable=r.status_code >= 500,
            )
        return data

    def _request(self, method: str, addr: str, path: str, body: dict[str, Any]) -> httpx.Response:
        try:
            return self._http.request(method, f"http://{addr}{path}", json=body)
        except httpx.HTTPError as e:
            raise BootstrapError(
                f"bootstrap server {addr} unreachable: {e!r}", 0, retryable=True
            ) from e

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        """Run ``fn(*args)`` on the background pool."""
        return self._pool.submit(fn, *args)

    def close(self) -> None:
        """Wait for queued jobs, then close the HTTP client."""
        self._pool.shutdown(wait=True)
        self._http.close()


def _json(r: httpx.Response) -> dict[str, Any]:
    try:
        d = r.json()
        return d if isinstance(d, dict) else {"detail": d}
    except ValueError:
        return {"detail": r.text[:200]}


__all__ = ["BootstrapClient", "KVBootstrapServer", "TicketRecord"]
