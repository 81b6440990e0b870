"""The decode side's bootstrap HTTP server: pairing, status messages, health.

One :class:`KVBootstrapServer` per decode worker process (one per engine: it drains the
engine's TE notifications)::

    server = KVBootstrapServer(engine, layout, host="127.0.0.1", port=0).start()
    rec = server.register_ticket(CacheRef(slot, pages, num_tokens), on_release=free_cb)
    # hand rec.ticket and server.address to the router; poll via KVReceiver / server.pump()

HTTP — kvstore to kvstore, never the router; every body is a :mod:`k3serve.messages` model,
validated by FastAPI (a bad body: 400 naming the field):

    POST /kv/pair    PairRequest   → 200 PairResponse · 4xx PairError (404 unknown ticket ·
        409 fingerprint mismatch (diffs + the server's fingerprint) or another sender already
        paired · 410 ticket no longer open: aborted, timed out, failed · 400 bad body)
    POST /kv/status  StatusMessage → 200 StatusAck · 409 StatusAck (refused) · 400 bad body
    GET  /kv/health                → 200 KVHealth

With a cluster token (``cluster_token=``; the workers pass ``K3SERVE_CLUSTER_TOKEN``) every route
but :data:`PUBLIC_PATHS` answers 403 ``PairError(error="forbidden")`` unless the request carries
it in ``X-K3serve-Cluster-Token`` (constant-time comparison): a peer that can reach this port
cannot pair with, complete or abort another request's ticket without it.

Completion and progress also arrive as TE notifications (name ``k3kv``, message = the same
StatusMessage JSON); :meth:`KVBootstrapServer.pump` drains them. What a ticket does with
them is :mod:`kvstore.tickets`. The prefill side's client is :mod:`kvstore.client`.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Self

import pydantic
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from k3serve.messages import (
    KVHealth,
    PairError,
    PairRequest,
    PairResponse,
    StatusAck,
    StatusMessage,
    same_secret,
)
from k3serve.protocol import CLUSTER_TOKEN_HEADER
from kvstore.descriptors import PoolLayout, fingerprint_diff
from kvstore.states import NOTIFY_NAME, KVPoll
from kvstore.tickets import TicketRecord, TicketTable

log = logging.getLogger(__name__)

#: Routes answered without the cluster token (liveness only: no ticket is read or changed).
PUBLIC_PATHS = frozenset({"/kv/health"})


def validation_detail(errors: Any) -> str:
    """``field.path: message; ...`` of pydantic / FastAPI validation errors (body prefix off)."""
    parts = []
    for e in errors:
        loc = [str(x) for x in e.get("loc", ()) if x != "body"]
        parts.append(f"{'.'.join(loc) or '<body>'}: {e.get('msg', '')}")
    return "; ".join(parts)


def parallel_diffs(local: dict[str, Any], remote: dict[str, Any]) -> list[str]:
    """The tensor-parallel pairing rule (``k3serve.parallel.layout.check_pair``) on two layout
    fingerprints (``extra.tp``, absent = 1): ``[]`` when the pair may exchange caches, else the
    :class:`~k3serve.parallel.layout.ParallelMismatch` message (names ``tp``) as one line."""
    from k3serve.parallel.layout import ParallelMismatch, check_pair

    def tp(fp: dict[str, Any]) -> Any:
        extra = fp.get("extra")
        return extra.get("tp", 1) if isinstance(extra, dict) else 1

    try:
        check_pair(tp(local), tp(remote))
    except ParallelMismatch as e:
        return [str(e)]
    return []


class KVBootstrapServer(TicketTable):
    """The decode side's ticket table (:class:`TicketTable`) + HTTP endpoint (uvicorn in a
    daemon thread).

    Args:
        engine: this process's :class:`~kvstore.engine.KVEngine` (its pools registered). With
            host staging (``engine.staging``), a ticket's cache is copied mirror → device
            pools when its ``done`` arrives, before it turns SUCCESS.
        layout: this process's :class:`PoolLayout` (the destination addresses).
        host, port: where to listen (port 0: any free port; see :attr:`address`).
        release_grace_s, ticket_ttl_s: see :class:`TicketTable`.
        cluster_token: required on every route but :data:`PUBLIC_PATHS` (``None``: open).
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
        cluster_token: str | None = None,
    ) -> None:
        staging = getattr(engine, "staging", None)
        super().__init__(
            layout,
            release_grace_s=release_grace_s,
            ticket_ttl_s=ticket_ttl_s,
            on_landed=staging.stage_in_ref if staging is not None else None,
        )
        self.engine = engine
        self.cluster_token = cluster_token
        self.host, self.port = host, port
        self._fingerprint = layout.fingerprint()
        self._layout_msg = layout.to_msg()
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
            self.app(),
            host=self.host,
            port=self.port,
            log_level="warning",
            access_log=False,
            lifespan="off",
            http="h11",  # as before httptools was installed for the router (router/config.py)
            loop="asyncio",  # and asyncio's loop, as before uvloop was (router/config.py)
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

    # ------------------------------------------------------------------ progress
    def pump(self) -> None:
        """Drain TE notifications, apply timeouts, release failed reservations, forget old
        tickets. Call it from the decode loop (each :meth:`KVReceiver.poll` does)."""
        for name, msg in self.engine.notifications():
            if name != NOTIFY_NAME:
                log.warning("ignoring TE notification %r", name)
                continue
            try:
                self.on_status(StatusMessage.model_validate_json(msg))
            except pydantic.ValidationError as e:
                log.warning("bad kv notification: %s", validation_detail(e.errors()))
        super().pump()

    # ------------------------------------------------------------------ handlers
    def pair(self, req: PairRequest) -> tuple[int, PairResponse | PairError]:
        """Handle a pairing request; returns ``(http status, answer)``."""
        with self._lock:
            rec: TicketRecord | None = self._tickets.get(req.ticket)
            if rec is None:
                return 404, PairError(
                    error="unknown_ticket", detail=f"no ticket {req.ticket!r} here"
                )
            if rec.state.terminal:
                return 410, PairError(
                    error="ticket_closed", state=rec.state.name, detail=rec.error or ""
                )
            if rec.sender is not None and rec.sender != req.sender:
                return 409, PairError(
                    error="already_paired", detail=f"ticket {req.ticket} has another sender"
                )
            diffs = parallel_diffs(self._fingerprint, req.fingerprint)
            diffs += fingerprint_diff(self._fingerprint, req.fingerprint)
            if diffs:
                self._finish(
                    rec,
                    KVPoll.FAILED,
                    "refused to pair: layout fingerprint mismatch: " + "; ".join(diffs),
                )
                return 409, PairError(
                    error="fingerprint_mismatch", diffs=diffs, fingerprint=self._fingerprint
                )
            now = time.monotonic()
            if rec.sender is None:
                rec.sender, rec.paired_at = req.sender, now
                rec.state = KVPoll.WAITING_FOR_INPUT
                if rec.transfer_timeout_s is not None:
                    rec.deadline = now + rec.transfer_timeout_s
            rec.sender_quiesce_at = now + req.quiesce_by_s
            rec.sender_session = req.sender_session
            return 200, PairResponse(
                session_id=self.engine.session_id,
                notify_addr=str(self.engine.scratch_addr),
                layout=self._layout_msg,
                fingerprint=self._fingerprint,
                dst=rec.ref.to_msg(),
            )

    def health(self) -> KVHealth:
        return KVHealth(
            ok=True,
            session_id=self.engine.session_id,
            fingerprint_hash=self.layout.fingerprint_hash(),
            open_tickets=self.open_tickets(),
        )

    def app(self) -> FastAPI:
        """The FastAPI app (docs off; ``app.openapi()`` names every body's model)."""
        app = FastAPI(title="k3serve kvstore bootstrap", docs_url=None, redoc_url=None,
                      openapi_url=None)
        token = self.cluster_token

        @app.middleware("http")
        async def token_check(request: Request, call_next: Any) -> Any:
            if (token and request.url.path not in PUBLIC_PATHS
                    and not same_secret(request.headers.get(CLUSTER_TOKEN_HEADER), token)):
                body = PairError(error="forbidden", detail="missing or wrong cluster token")
                return JSONResponse(body.model_dump(mode="json"), status_code=403)
            return await call_next(request)

        @app.exception_handler(RequestValidationError)
        async def bad_body(request: Request, exc: RequestValidationError) -> JSONResponse:
            detail = validation_detail(exc.errors())
            if request.url.path == "/kv/status":
                body: Any = StatusAck(accepted=False, error=detail)
            else:
                body = PairError(error="invalid_request", detail=detail)
            return JSONResponse(body.model_dump(mode="json"), status_code=400)

        @app.post(
            "/kv/pair",
            response_model=PairResponse,
            responses={"4XX": {"model": PairError, "description": "pairing refused"}},
        )
        def pair(req: PairRequest) -> Any:
            status, answer = self.pair(req)
            if status == 200:
                return answer
            return JSONResponse(answer.model_dump(mode="json"), status_code=status)

        @app.post(
            "/kv/status",
            response_model=StatusAck,
            responses={"4XX": {"model": StatusAck, "description": "status refused"}},
        )
        def status(msg: StatusMessage) -> Any:
            ok, why = self.on_status(msg)
            ack = StatusAck(accepted=ok, state=why)
            return ack if ok else JSONResponse(ack.model_dump(mode="json"), status_code=409)

        @app.get("/kv/health", response_model=KVHealth)
        def health() -> KVHealth:
            return self.health()

        return app


__all__ = ["PUBLIC_PATHS", "KVBootstrapServer", "TicketRecord", "parallel_diffs", "validation_detail"]
