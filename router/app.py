"""The router: OpenAI-compatible FastAPI front of the prefill/decode cluster (routes only).

The request lifecycle these routes drive is numbered in :mod:`k3serve.protocol`; the rooms:
:mod:`router.config` (configuration, ``main``), :mod:`router.preprocess` (tokenize, hash,
jobs of ``n > 1``), :mod:`router.pipeline` (reserve → prefill → stream), :mod:`router.render`
(OpenAI objects), :mod:`router.errors` (OpenAI-style errors), :mod:`router.workers` (the
workers and the internal calls).

Run: ``python -m router.app --host 127.0.0.1 --port 8000 --model k3-tiny [--api-key KEY]``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
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
from router.admission import Ticket, overloaded
from router.config import RouterConfig, main
from router.errors import APIError, install_handlers, unavailable
from router.pipeline import Router, cancel
from router.placement import NoWorkerAvailable
from router.preprocess import parse_request
from router.render import ChoiceAcc, Render, sse_frame
from router.replicas import REPLICA_HEADER, Registry
from router.responses import (
    ChatCompletionResponse,
    CompletionResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    new_id,
)
from router.schemas import ChatCompletionRequest, CompletionRequest
from router.stream import END, Delta
from router.workers import PoolBusy, WorkerError

__all__ = ["Router", "RouterConfig", "create_app", "main"]

log = logging.getLogger("k3serve.router")


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
    registry = Registry(config.registry_dir) if config.registry_dir else None
    replica = {REPLICA_HEADER: str(config.replica)} if config.replica is not None else None

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        side = [asyncio.create_task(registry.watch(router.pool)),
                asyncio.create_task(_refresh_metrics(router))] if registry else []
        yield
        await cancel(side)
        await router.close()

    app = FastAPI(title="k3serve router", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.router = router
    install_handlers(app)

    # ---------------------------------------------------------------- checks
    def check_api_key(request: Request) -> None:
        if not config.api_key:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not same_secret(token.strip(), config.api_key):
            raise APIError(401, "Incorrect API key provided.", code="invalid_api_key")

    def check_cluster_token(request: Request) -> None:
        if config.cluster_token and not same_secret(
                request.headers.get(CLUSTER_TOKEN_HEADER), config.cluster_token):
            raise APIError(403, "missing or wrong cluster token", code="forbidden")

    # ---------------------------------------------------------------- one request
    async def serve(request: Request, chat: bool) -> Response:
        arrival = time.monotonic()
        check_api_key(request)
        req = parse_request(await read_body(request, config.max_body_bytes),
                            ChatCompletionRequest if chat else CompletionRequest, config.model,
                            max_prompts=config.max_prompts)
        limit = router.max_model_len
        jobs = (router.pre.chat_jobs(req, limit) if chat
                else router.pre.completion_jobs(req, limit))
        ticket = router.admission.admit(len(jobs) * req.n)  # 429 + Retry-After past capacity
        try:
            return await run(request, req, jobs, arrival, ticket)
        except BaseException:
            ticket.release()
            raise

    async def run(request: Request, req: Any, jobs: list, arrival: float,
                  ticket: Ticket) -> Response:
        chat = isinstance(req, ChatCompletionRequest)
        rid = new_id("chatcmpl" if chat else "cmpl")
        render = Render(router.tokenizer, config.model, req, rid)
        out, tasks, num_choices = router.execute(req, jobs, rid, arrival)
        accs: dict[int, ChoiceAcc] = {}
        # A client that goes away puts GONE into ``out`` (one watcher for the whole request,
        # the streaming response included), so that the request is aborted on the workers
        # instead of running to max_tokens.
        gone = asyncio.ensure_future(_put_when_gone(request.receive, out))

        async def next_item():
            item = await out.get()
            if item is GONE:
                raise APIError(499, "the client closed the request",
                               code="client_closed_request")
            return item

        def fail(e: BaseException) -> APIError:
            if isinstance(e, APIError):
                return e
            if isinstance(e, NoWorkerAvailable):
                return unavailable(str(e))
            if isinstance(e, PoolBusy) or (isinstance(e, WorkerError) and e.busy):
                log.info("request %s shed: %s", rid, e)
                return overloaded("the server is overloaded; retry", config.retry_after_s,
                                  status=503)
            log.warning("request %s failed: %s", rid, e)  # worker addresses stay in the log
            return APIError(503, "a worker failed while serving the request; retry",
                            "server_error", code="worker_error")

        def observe_e2e() -> None:
            if jobs[0].decode is not None:
                router.metrics.e2e.labels(jobs[0].decode.name).observe(
                    time.monotonic() - arrival)

        # Wait for the first output (or error) before answering, so failures before any token
        # get a proper status code; a non-streaming request is then read to its end.
        ended = 0
        try:
            first = item = await next_item()
            if isinstance(first, BaseException):
                raise fail(first)
            while not req.stream:
                if isinstance(item, BaseException):
                    raise fail(item)
                if item is END:
                    ended += 1
                    if ended == num_choices:
                        break
                else:
                    accs.setdefault(item.index, ChoiceAcc()).absorb(item)
                item = await next_item()
        except BaseException:
            gone.cancel()
            await cancel(tasks)
            raise
        if not req.stream:
            gone.cancel()
            await cancel(tasks)
            ticket.release()
            observe_e2e()
            return JSONResponse(render.full(jobs, accs), headers=replica)

        async def write(receive: Any, send: Any, start: dict[str, Any]) -> None:
            """The status and headers (``start``), then the SSE body, written straight to
            the ASGI ``send`` (no async generator, no task group): the deltas queued
            together go out as one chunk (:func:`coalesce`); the last chunk, the usage chunk
            and ``[DONE]`` as one write."""
            item, seen, done = first, set(), 0
            pending = b""  # a choice's final chunk, held to go out with the end of the body
            try:
                await send(start)
                while True:
                    if item is GONE:
                        return
                    if isinstance(item, BaseException):
                        pending += sse_frame(_data(fail(item).body()))
                        break
                    nxt = None
                    if item is END:
                        done += 1
                        if done == num_choices:
                            break
                    else:
                        d: Delta = item
                        nxt = coalesce(d, out)
                        acc = accs.get(d.index)
                        if acc is None:
                            acc = accs[d.index] = ChoiceAcc()
                        acc.count(d)
                        frame = render.frame(d, d.index not in seen)
                        seen.add(d.index)
                        if d.finish_reason and done == num_choices - 1:
                            pending += frame  # the last choice's last chunk: END follows
                        else:
                            if pending:
                                frame, pending = pending + frame, b""
                            await send({"type": "http.response.body", "body": frame,
                                        "more_body": True})
                    if nxt is None:
                        if pending and not out.empty():
                            nxt = out.get_nowait()
                        else:
                            nxt = await out.get()
                    item = nxt
                if done == num_choices:
                    observe_e2e()
                    if req.include_usage:
                        pending += sse_frame(_data(render.usage_chunk(jobs, accs)))
                # Give the request's capacity back before the body ends: a client that sends
                # its next request on seeing the end must find it free (no spurious 429).
                gone.cancel()
                await cancel(tasks)
                ticket.release()
                await send({"type": "http.response.body", "body": pending + DONE_FRAME,
                            "more_body": False})
            except OSError:  # the client went away mid-write
                return
            finally:
                gone.cancel()
                await cancel(tasks)
                ticket.release()

        return SSEResponse(write, headers={**SSE_HEADERS, **(replica or {})})

    # ---------------------------------------------------------------- public API
    # The bodies are parsed by hand (parse_request: caps, surrogates, the model's name); the
    # schema still names them, with every error status the routes answer.
    @app.post("/v1/completions", openapi_extra=_json_body(CompletionRequest),
              responses=_api_responses(CompletionResponse))
    async def completions(request: Request) -> Response:
        return await serve(request, chat=False)

    @app.post("/v1/chat/completions", openapi_extra=_json_body(ChatCompletionRequest),
              responses=_api_responses(ChatCompletionResponse))
    async def chat_completions(request: Request) -> Response:
        return await serve(request, chat=True)

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

    def card() -> ModelCard:
        return ModelCard(id=config.model, max_model_len=router.max_model_len)

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
    async def health(detail: int = 0) -> JSONResponse:
        pool = router.pool
        live_p, live_d = pool.live("prefill"), pool.live("decode")
        ok = bool(live_d and (live_p or router.monolithic))  # monolithic: no prefill pool
        body = RouterHealth(
            status="ok" if ok else "unavailable", model=config.model,
            num_workers=len(pool.workers), num_workers_healthy=len(live_p) + len(live_d),
            num_prefill_healthy=len(live_p), num_decode_healthy=len(live_d),
            workers=[RouterWorkerStatus(
                url=w.url, name=w.name, role=w.role, healthy=w.available,
                queued_tokens=w.queued_tokens, running=w.running,
                blocks=pool.index.num_blocks(w.url), snapshots=pool.index.num_snapshots(w.url),
                resyncs=w.resyncs) for w in pool.workers.values()] if detail else None)
        return JSONResponse(body.model_dump(exclude_none=True), status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        body, ctype = router.metrics.render()
        return Response(body, media_type=ctype)

    # ---------------------------------------------------------------- internal API
    @app.post("/internal/register", response_model=RegisterResponse,
              dependencies=[Depends(check_cluster_token)],
              responses={400: {"model": ErrorResponse}, 403: {"model": ErrorResponse},
                         503: {"model": ErrorResponse}})
    async def register(body: RegisterRequest) -> RegisterResponse:
        try:
            w = await router.pool.register(body.url)
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
        w = router.pool.remove(body.url)
        if w is None:
            raise APIError(404, f"no worker {body.url} registered", code="unknown_worker")
        return RegisterResponse(worker_id=w.name, role=w.role, url=w.url)

    return app


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


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, read up to ``limit`` bytes.

    Raises:
        APIError: 400 ``unsupported_media_type`` for a ``Content-Type`` that is not JSON
            (``application/json`` or ``*/*+json``; none given is read as JSON, as FastAPI
            does); 413 ``request_too_large`` when ``Content-Length`` or the bytes received pass
            ``limit`` (nothing more is read).
    """
    media = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media and media != "application/json" and not media.endswith("+json"):
        raise APIError(400, f"Content-Type {media!r}: the body must be JSON (send "
                       "`Content-Type: application/json`)", code="unsupported_media_type")
    too_large = APIError(413, f"request body is larger than {limit} bytes",
                         code="request_too_large")
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise too_large
    parts, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        parts.append(chunk)
    return b"".join(parts)


def _data(obj: Any) -> str:
    """One SSE ``data:`` payload (compact JSON)."""
    return json.dumps(obj, separators=(",", ":"))


DONE_FRAME = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-store", "Connection": "keep-alive", "X-Accel-Buffering": "no"}


GONE = object()  # put in a stream's delta queue when its client disconnects


async def _put_when_gone(receive: Any, out: asyncio.Queue) -> None:
    """Put :data:`GONE` into ``out`` once the client has disconnected (the ASGI messages
    after the body)."""
    while (await receive()).get("type") != "http.disconnect":
        pass
    out.put_nowait(GONE)


class SSEResponse(Response):
    """A ``text/event-stream`` answer that a coroutine writes to the ASGI ``send`` itself
    (``write(receive, send, start)``, ``start`` the ``http.response.start`` message to send
    first): one ``send`` per chunk, with none of ``StreamingResponse``'s layers (an async
    generator per chunk, a task group listening for the disconnect)."""

    media_type = "text/event-stream"

    def __init__(self, write: Any, headers: dict[str, str] | None = None) -> None:
        self.status_code = 200
        self.background = None
        self._write = write
        self.init_headers(headers)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await self._write(receive, send, {"type": "http.response.start",
                                          "status": self.status_code,
                                          "headers": self.raw_headers})


def coalesce(d: Delta, out: asyncio.Queue) -> Any:
    """Append to ``d`` the deltas of the same choice already waiting in ``out`` (they go out
    as one chunk: same text, tokens and finish); returns the first other item taken from
    ``out`` (to handle next), else ``None``."""
    while d.finish_reason is None and not out.empty():
        nxt = out.get_nowait()
        if not isinstance(nxt, Delta) or nxt.index != d.index:
            return nxt
        d.absorb(nxt)
    return None


if __name__ == "__main__":
    raise SystemExit(main())
