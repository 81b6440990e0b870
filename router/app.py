"""The router: OpenAI-compatible FastAPI front of the prefill/decode cluster (routes only).

The request lifecycle these routes drive is numbered in :mod:`k3serve.protocol`; the rooms:
:mod:`router.config` (configuration), :mod:`router.answer` (one request, admission to its
last byte), :mod:`router.preprocess` (tokenize, hash, jobs of ``n > 1``),
:mod:`router.pipeline` (reserve → prefill → stream), :mod:`router.render` (OpenAI objects),
:mod:`router.errors` (OpenAI-style errors), :mod:`router.pool` (the workers and the internal
calls).

Run: ``python -m router --host 127.0.0.1 --port 8000 --model k3-tiny [--api-key KEY]``
(:mod:`router.__main__`).
"""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from k3serve.messages import (
    RegisterRequest,
    RegisterResponse,
    RouterHealth,
    RouterWorkerStatus,
    same_secret,
)
from k3serve.protocol import CLUSTER_TOKEN_HEADER
from router.answer import Completions
from router.config import RouterConfig
from router.errors import APIError, install_handlers
from router.pipeline import Router, cancel
from router.replicas import REPLICA_HEADER, Registry
from router.responses import (
    ChatCompletionResponse,
    CompletionResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
)
from router.schemas import ChatCompletionRequest, CompletionRequest
from router.store_health import StoreProbe
from router.workers import WorkerError

__all__ = ["Router", "RouterConfig", "create_app"]


def create_app(config: RouterConfig,
               transport: httpx.AsyncBaseTransport | None = None) -> FastAPI:
    """Build the router's FastAPI app.

    Args:
        config: Router configuration.
        transport: httpx transport for registration reads and cache-event polls; default:
            the network (the request path always goes over it).

    Returns:
        The app; ``app.state.router`` is its ``Router``.
    """
    router = Router(config, transport)
    store = StoreProbe(config.store_url) if config.store_url else None
    registry = Registry(config.registry_dir) if config.registry_dir else None
    replica = {REPLICA_HEADER: str(config.replica)} if config.replica is not None else None

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if registry is not None:  # a replica (re)started: serve only once it knows the workers
            await registry.catch_up(router.pool.registry)
        side = [asyncio.create_task(registry.watch(router.pool.registry)),
                asyncio.create_task(_refresh_metrics(router))] if registry else []
        if store is not None:
            side.append(asyncio.create_task(store.run()))
        side.append(asyncio.create_task(router.memory.run()))
        yield
        await cancel(side)
        await router.close()

    app = FastAPI(title="k3serve router", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)  # served by _install_openapi, behind the API key
    app.state.router = router
    install_handlers(app)
    completions = Completions(router, config, replica)
    _public_routes(app, router, config, completions, store)
    _internal_routes(app, router, config, registry)
    _install_openapi(app, router, config, completions.check_api_key)
    return app


def _public_routes(app: FastAPI, router: Router, config: RouterConfig,
                   handler: Completions, store: StoreProbe | None) -> None:
    """``/v1/*``, ``/health``, ``/livez``, ``/readyz`` and ``/metrics``; ``/health`` carries
    the store master's reachability (``store``) when ``store`` is given.

    With an API key set, ``/metrics`` and ``/health?detail=1`` (worker URLs and ports) ask
    for it too (401; ``/health?detail=1`` also takes the cluster token, which the workers show
    when they check their registration); plain ``/health``, ``/livez`` and ``/readyz`` stay
    open for probes."""
    check_api_key = handler.check_api_key

    # The bodies are parsed by hand (parse_request: caps, surrogates, the model's name); the
    # schema still names them, with every error status the routes answer.
    @app.post("/v1/completions", openapi_extra=_json_body(CompletionRequest),
              responses=_api_responses(CompletionResponse))
    async def completions(request: Request) -> Response:
        return await handler.serve(request, chat=False)

    @app.post("/v1/chat/completions", openapi_extra=_json_body(ChatCompletionRequest),
              responses=_api_responses(ChatCompletionResponse))
    async def chat_completions(request: Request) -> Response:
        return await handler.serve(request, chat=True)

    def card() -> ModelCard:
        layout = router.registry.layout
        return ModelCard(id=config.model, max_model_len=router.max_model_len,
                         block_size=layout[1] if layout else None)

    @app.get("/v1/models", response_model=ModelList, dependencies=[Depends(check_api_key)])
    async def models() -> ModelList:
        return ModelList(data=[card()])

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard,
             responses={404: {"model": ErrorResponse}}, dependencies=[Depends(check_api_key)])
    async def model(model_id: str) -> ModelCard:
        if model_id != config.model:
            raise APIError(404, f"The model `{model_id}` does not exist; this server serves "
                           f"`{config.model}`.", param="model", code="model_not_found")
        return card()

    @app.get("/health", response_model=RouterHealth, response_model_exclude_none=True,
             responses={503: {"model": RouterHealth}})
    async def health(request: Request, detail: int = 0) -> JSONResponse:
        if detail and not (config.cluster_token and same_secret(
                request.headers.get(CLUSTER_TOKEN_HEADER), config.cluster_token)):
            check_api_key(request)  # a worker checking its registration shows the cluster token
        reg, index = router.pool.registry, router.pool.index
        live_p, live_d = reg.live("prefill"), reg.live("decode")
        ok = ready()
        body = RouterHealth(
            status="ok" if ok else "unavailable", model=config.model,
            num_workers=len(reg.workers), num_workers_healthy=len(live_p) + len(live_d),
            num_prefill_healthy=len(live_p), num_decode_healthy=len(live_d),
            workers=[RouterWorkerStatus(
                url=w.url, name=w.name, role=w.role, healthy=w.available,
                queued_tokens=w.queued_tokens, running=w.running,
                blocks=index.num_blocks(w.url), snapshots=index.num_snapshots(w.url),
                resyncs=w.resyncs) for w in reg.workers.values()] if detail else None,
            store=store.health(bool(detail)) if store is not None else None)
        return JSONResponse(body.model_dump(exclude_none=True), status_code=200 if ok else 503)

    def ready() -> bool:
        """At least one usable decode worker and one usable prefill worker (or none needed:
        monolithic decode workers)."""
        reg = router.pool.registry
        return bool(reg.live("decode") and (reg.live("prefill") or router.monolithic))

    @app.get("/livez")
    async def livez() -> dict[str, str]:
        """Liveness: 200 while the process serves HTTP, whatever its workers."""
        return {"status": "ok"}

    @app.get("/readyz", responses={503: {"description": "no usable prefill / decode worker"}})
    async def readyz() -> JSONResponse:
        """Readiness: 200 when a request can be served now (:func:`ready`), else 503."""
        ok = ready()
        return JSONResponse({"status": "ok" if ok else "unavailable"},
                            status_code=200 if ok else 503)

    @app.get("/metrics", dependencies=[Depends(check_api_key)])
    async def metrics() -> Response:
        body, ctype = router.metrics.render()
        return Response(body, media_type=ctype)


def _internal_routes(app: FastAPI, router: Router, config: RouterConfig,
                     registry: Registry | None) -> None:
    """``/internal/register`` and ``/internal/deregister`` (cluster token)."""
    def check_cluster_token(request: Request) -> None:
        if config.cluster_token and not same_secret(
                request.headers.get(CLUSTER_TOKEN_HEADER), config.cluster_token):
            raise APIError(403, "missing or wrong cluster token", code="forbidden")

    @app.post("/internal/register", response_model=RegisterResponse,
              dependencies=[Depends(check_cluster_token)],
              responses={400: {"model": ErrorResponse}, 403: {"model": ErrorResponse},
                         503: {"model": ErrorResponse}})
    async def register(body: RegisterRequest) -> RegisterResponse:
        try:
            w = await router.pool.registry.register(body.url)
        except WorkerError as e:
            raise APIError(503, f"cannot read the worker's info: {e}", "server_error",
                           code="worker_unreachable") from None
        except ValueError as e:
            raise APIError(400, str(e), code="invalid_worker") from None
        if registry is not None:  # the other replicas register it too (router/replicas.py)
            registry.add(w.url)
        return RegisterResponse(worker_id=w.name, role=w.role, url=w.url)

    @app.post("/internal/deregister", response_model=RegisterResponse,
              dependencies=[Depends(check_cluster_token)],
              responses={403: {"model": ErrorResponse}, 404: {"model": ErrorResponse}})
    async def deregister(body: RegisterRequest) -> RegisterResponse:
        """A draining worker (SIGTERM) leaves placement at once; its running requests go on."""
        w = router.pool.registry.remove(body.url)
        if w is None:
            raise APIError(404, f"no worker {body.url} registered", code="unknown_worker")
        return RegisterResponse(worker_id=w.name, role=w.role, url=w.url)


def _install_openapi(app: FastAPI, router: Router, config: RouterConfig,
                     check_api_key: Any) -> None:
    """``GET /openapi.json`` (behind the API key when one is set): the schema names the
    request models (the model's name as the one ``model`` value, the token ids bounded by
    the vocabulary)."""
    base_openapi = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = base_openapi()
            comps = schema.setdefault("components", {}).setdefault("schemas", {})
            for m in (CompletionRequest, ChatCompletionRequest):
                js = m.model_json_schema(ref_template="#/components/schemas/{model}")
                comps.update(js.pop("$defs", {}))
                js["properties"]["model"]["enum"] = [config.model]  # the one it serves
                comps[m.__name__] = js
            _bound_token_ids(comps["CompletionRequest"]["properties"]["prompt"],
                             router.tokenizer.vocab_size)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]

    @app.get("/openapi.json", include_in_schema=False, dependencies=[Depends(check_api_key)])
    async def openapi_json() -> JSONResponse:
        return JSONResponse(app.openapi())


async def _refresh_metrics(router: Router, every_s: float = 1.0) -> None:
    """Replicas: publish this replica's hit-rate window every second (router/metrics.py)."""
    while True:
        router.metrics.refresh_window()
        await asyncio.sleep(every_s)


def _bound_token_ids(schema: Any, vocab: int) -> None:
    """Give every token-id item of a ``prompt`` schema its ``maximum`` (``vocab - 1``)."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if node.get("type") == "integer" and node.get("minimum") == 0:
                node["maximum"] = vocab - 1
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)


def _json_body(model: type) -> dict[str, Any]:
    """``openapi_extra`` naming ``model`` as a route's JSON request body."""
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True,
                            "content": {"application/json": {"schema": ref}}}}


def _api_responses(ok: type) -> dict[int | str, dict[str, Any]]:
    """``responses=`` of a completion route: the JSON answer or an SSE stream, and the
    OpenAI-style errors (429 and 503 with ``Retry-After``)."""
    err = {"model": ErrorResponse}
    retry = {**err, "headers": {"Retry-After": {"schema": {"type": "integer"},
                                                "description": "seconds"}}}
    return {200: {"model": ok, "content": {"text/event-stream": {"schema": {"type": "string"}}},
                  "description": "the completion, or its chunks with stream=true"},
            400: err, 401: err, 404: err, 413: err, 429: retry, 503: retry}
