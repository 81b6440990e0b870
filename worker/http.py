"""The FastAPI app of a worker: the routes both roles answer, the cluster-token check, the
error answers, registration at startup; the role adds its own routes (``BaseWorker.routes``).

Every ``/internal`` body is a model of :mod:`k3serve.messages`: FastAPI validates requests
with them (a bad body is a 400 ``invalid_request`` naming the field) and the OpenAPI schema
(``app.openapi()``; not served: docs and ``/openapi.json`` are off) names them. Errors are
:class:`~k3serve.messages.ErrorBody` answers, raised as :class:`worker.base.Failure`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response

from k3serve.messages import (
    AbortRequest,
    AbortResponse,
    CacheEvents,
    CacheState,
    ErrorBody,
    RequestsDebug,
    WorkerHealth,
    WorkerInfo,
    same_secret,
)
from k3serve.protocol import CLUSTER_TOKEN_HEADER
from worker.base import BaseWorker, Failure
from worker.registration import register_loop

log = logging.getLogger("k3serve.worker")

#: The only routes answered without the cluster token (liveness and Prometheus scraping; the
#: OpenAPI schema and docs are not served). Every other route — the role's too, and any route
#: added later — needs it (tests/worker/test_security.py enumerates ``app.routes``).
PUBLIC_PATHS = frozenset({"/health", "/metrics"})
#: The routes that admit new work; a draining worker (SIGTERM) answers them 503 ``draining``.
ADMISSION_PATHS = frozenset({"/internal/reserve", "/internal/prefill", "/internal/generate"})
#: The routes whose unanswered calls make the worker's queue, bounded by
#: ``WorkerConfig.max_queued`` (one more: 503 ``busy`` with ``Retry-After``).
QUEUED_PATHS = ADMISSION_PATHS | {"/internal/resume"}
#: ``Retry-After`` of a call refused because the queue is full, seconds.
RETRY_AFTER_S = 1


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses=`` entry: :class:`ErrorBody` for ``statuses`` and every other error
    (``default``; also replaces FastAPI's 422 entry: validation errors are 400 here)."""
    out: dict[int | str, dict[str, Any]] = {s: {"model": ErrorBody} for s in statuses}
    out["default"] = {"model": ErrorBody, "description": "any other error"}
    return out


def json_errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """Like :func:`errors`, for a route whose success is not JSON (the SSE stream): the
    :class:`ErrorBody` schema stays under ``application/json``."""
    ref = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorBody"}}}
    out: dict[int | str, dict[str, Any]] = {s: {"description": "error", "content": ref}
                                            for s in statuses}
    out["default"] = {"description": "any other error", "content": ref}
    return out


def error_response(status: int, code: str, message: str,
                   retry_after: int | None = None) -> JSONResponse:
    """An :class:`ErrorBody` answer (with a ``Retry-After`` header, seconds, if given)."""
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    return JSONResponse(ErrorBody(error=code, message=message).model_dump(), status_code=status,
                        headers=headers)


async def stop_registration(app: FastAPI) -> None:
    """Cancel the app's registration task (a draining worker must not register again)."""
    reg = getattr(app.state, "registration", None)
    app.state.registration = None
    if reg is not None:
        reg.cancel()
        with contextlib.suppress(BaseException):
            await reg


def create_app(worker: BaseWorker) -> FastAPI:
    """The worker's FastAPI app: common routes + ``worker.routes(app)``.

    Startup starts the worker (engine thread) and, with ``config.router_url``, the
    registration task; shutdown stops both.
    """
    cfg = worker.config

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        worker.aloop = asyncio.get_running_loop()
        worker.start()
        app.state.registration = None
        if cfg.router_url:
            app.state.registration = asyncio.create_task(
                register_loop(cfg.router_url, worker.url, cfg.cluster_token), name="register")
        try:
            yield
        finally:
            await stop_registration(app)
            worker.close()

    app = FastAPI(title=f"k3serve {worker.role} worker", lifespan=lifespan, docs_url=None,
                  redoc_url=None, openapi_url=None)
    app.state.queued = 0  # admission calls unanswered now (QUEUED_PATHS)

    @app.middleware("http")
    async def token_check(request: Request, call_next):
        tok = cfg.cluster_token
        if (tok and request.url.path not in PUBLIC_PATHS
                and not same_secret(request.headers.get(CLUSTER_TOKEN_HEADER), tok)):
            return error_response(403, "forbidden", "missing or wrong cluster token")
        if worker.draining and request.url.path in ADMISSION_PATHS:
            return error_response(503, "draining", "this worker is draining (SIGTERM): "
                                  "place the request elsewhere")
        if request.url.path not in QUEUED_PATHS:
            return await call_next(request)
        # the bounded queue: admission calls held unanswered (a prefill until token #1)
        if cfg.max_queued and app.state.queued >= cfg.max_queued:
            worker.metrics.shed()
            return error_response(
                503, "busy", f"{worker.worker_id}: {app.state.queued} requests queued "
                f"(max_queued {cfg.max_queued}); place the request elsewhere or retry",
                retry_after=RETRY_AFTER_S)
        app.state.queued += 1
        try:
            return await call_next(request)
        finally:
            app.state.queued -= 1

    @app.exception_handler(Failure)
    async def _failure(_: Request, e: Failure) -> JSONResponse:
        return error_response(e.status, e.code, e.message)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0] if e.errors() else {}
        where = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        return error_response(400, "invalid_request",
                              f"{where}: {first.get('msg', 'invalid body')}")

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, e: Exception) -> JSONResponse:
        log.exception("unexpected error")
        return error_response(500, "internal_error", f"{type(e).__name__}: {e}")

    @app.get("/health", response_model=WorkerHealth,
             responses={503: {"model": WorkerHealth,
                              "description": "engine thread died, or draining"}})
    async def health() -> JSONResponse:
        ok = worker.loop.alive and not worker.draining
        status = "draining" if worker.draining else "ok" if ok else "engine_stopped"
        body = WorkerHealth(status=status, role=worker.role, worker_id=worker.worker_id)
        return JSONResponse(body.model_dump(), status_code=200 if ok else 503)

    @app.get("/metrics", response_class=Response)
    async def metrics() -> Response:
        with contextlib.suppress(Exception):
            worker.metrics.set_gauges(await worker.loop.call(worker.gauges, timeout=10))
        body, ctype = worker.metrics.render()
        return Response(body, media_type=ctype)

    @app.get("/internal/info", response_model=WorkerInfo, responses=errors(403))
    async def info() -> WorkerInfo:
        return await worker.loop.call(worker.info)

    @app.get("/internal/cache_events", response_model=CacheEvents, responses=errors(403))
    async def cache_events(after: int = 0, limit: int | None = None) -> CacheEvents:
        return await worker.loop.call(worker.cache_events, after, limit)

    @app.get("/internal/cache_state", response_model=CacheState, responses=errors(403))
    async def cache_state() -> CacheState:
        return CacheState.model_validate(await worker.loop.call(worker.engine.cache_state))

    @app.get("/internal/requests", response_model=RequestsDebug, responses=errors(403),
             response_model_exclude_none=True)
    async def requests(request_id: str | None = None) -> RequestsDebug:
        return await worker.loop.call(worker.describe, request_id)

    @app.post("/internal/abort", response_model=AbortResponse, responses=errors(400, 403))
    async def abort(body: AbortRequest) -> AbortResponse:
        found = await worker.loop.call(worker.abort, body.request_id, "aborted by the router")
        return AbortResponse(found=bool(found))

    worker.routes(app)
    return app


__all__ = ["ADMISSION_PATHS", "PUBLIC_PATHS", "QUEUED_PATHS", "create_app", "error_response", "errors", "json_errors", "stop_registration"]
