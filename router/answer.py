"""One completion request from admission to its last byte: :class:`Completions` (what the
routes call) and :class:`Answer` (one request's deltas → a JSON body or an SSE stream).

The request lifecycle is numbered in :mod:`k3serve.protocol`; the choices run in
:mod:`router.pipeline`, their deltas arrive in one queue (``END`` after each choice, an
exception in place of a failed choice's ``END``, :data:`~router.sse_response.GONE` when the
client disconnected).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from k3serve import tracing
from k3serve.messages import same_secret
from router import trace
from router.admission import Ticket, current_key, overloaded, request_cost
from router.config import RouterConfig
from router.errors import APIError, unavailable
from router.pipeline import Router, cancel
from router.placement import NoWorkerAvailable
from router.preprocess import PromptJob, parse_request
from router.render import ChoiceAcc, Render, sse_frame
from router.responses import new_id
from router.schemas import ChatCompletionRequest, CompletionRequest
from router.sse_response import (
    DONE_FRAME,
    GONE,
    SSE_HEADERS,
    SSEResponse,
    coalesce,
    data,
    put_when_gone,
)
from router.stream import END, Delta
from router.workers import PoolBusy, WorkerError

log = logging.getLogger("k3serve.router")


class Completions:
    """The completion routes' handler: reads, admits and answers one request.

    Args:
        router: The router (pipeline, workers, metrics).
        config: Its configuration (API key, limits, ``Retry-After``).
        headers: Extra headers of every answer (the replica's index), or ``None``.
    """

    def __init__(self, router: Router, config: RouterConfig,
                 headers: dict[str, str] | None) -> None:
        self.router, self.config, self.headers = router, config, headers

    def check_api_key(self, request: Request) -> str:
        """The name of the request's API key (``"key0"``, ``"key1"``, … in the configured
        order; ``""`` when the router has no key): admission's fair shares go by it.

        Raises:
            APIError: 401 when API keys are configured and the request has no bearer token
                (the message says so) or one that is none of them.
        """
        if not self.config.api_key:
            return ""
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        token = token.strip()
        found = ""
        for i, key in enumerate((self.config.api_key, *self.config.api_keys)):
            if same_secret(token, key) and not found:  # every key compared: constant time
                found = f"key{i}"
        if scheme.lower() != "bearer" or not token:
            raise APIError(401, "No API key provided: send it as 'Authorization: Bearer KEY'.",
                           code="invalid_api_key")
        if not found:
            raise APIError(401, "Incorrect API key provided.", code="invalid_api_key")
        return found

    async def serve(self, request: Request, chat: bool) -> Response:
        """Answer one ``/v1/completions`` (``chat`` False) or ``/v1/chat/completions``; with
        tracing on, under a ``router.request`` span (continuing the client's ``traceparent``)
        that :class:`Answer` ends with the response.

        Raises:
            APIError: 401, 400 (bad input, more choices than the server runs at once), 413,
                429 (past capacity or the key's share), 503 (no worker, a failed one).
        """
        if not tracing.enabled():
            return await self.answer(request, chat)
        span = tracing.start_span("router.request", tracing.extract(request.headers))
        token = trace.REQUEST.set(span)
        try:
            return await self.answer(request, chat)
        except BaseException as e:
            tracing.end_span(span, error=str(e) or type(e).__name__)
            raise
        finally:
            trace.REQUEST.reset(token)

    async def answer(self, request: Request, chat: bool) -> Response:
        """:meth:`serve` (under the request's span, when tracing is on)."""
        arrival = time.monotonic()
        router, config = self.router, self.config
        key = self.check_api_key(request)
        current_key.set(key)  # the choices' tasks are made in this context: their seats' key
        body = await read_body(request, config.max_body_bytes)
        router.memory.note(len(body))
        req = parse_request(body, ChatCompletionRequest if chat else CompletionRequest,
                            config.model, max_prompts=config.max_prompts)
        del body
        limit = router.max_model_len
        jobs = (router.pre.chat_jobs(req, limit) if chat
                else router.pre.completion_jobs(req, limit))
        span = trace.child("router.admission")
        try:
            ticket = router.admission.admit(request_cost(jobs, req.n), key)  # 400/429/503
        finally:
            tracing.end_span(span)
        try:
            return await Answer(self, request, req, jobs, arrival, ticket).respond()
        except BaseException:
            ticket.release()
            raise


class Answer:
    """One admitted request's choices, running, and their answer.

    A client that goes away puts ``GONE`` into the delta queue (one watcher for the whole
    request, the streaming response included), so that the request is aborted on the
    workers instead of running to ``max_tokens``.
    """

    def __init__(self, owner: Completions, request: Request,
                 req: CompletionRequest | ChatCompletionRequest, jobs: list[PromptJob],
                 arrival: float, ticket: Ticket) -> None:
        router = owner.router
        self.config, self.headers, self.metrics = owner.config, owner.headers, router.metrics
        self.req, self.jobs, self.arrival, self.ticket = req, jobs, arrival, ticket
        chat = isinstance(req, ChatCompletionRequest)
        self.rid = new_id("chatcmpl" if chat else "cmpl")
        self.render = Render(router.tokenizer, owner.config.model, req, self.rid)
        self.out, self.tasks, self.num_choices = router.execute(req, jobs, self.rid, arrival)
        self.accs: dict[int, ChoiceAcc] = {}
        self.span = trace.REQUEST.get()  # the request's span (None: tracing off)
        if self.span is not None:
            tracing.set_attributes(self.span, {
                "k3serve.request_id": self.rid,
                "k3serve.prompt_tokens": sum(len(j.token_ids) for j in jobs)})
        self.gone = asyncio.ensure_future(put_when_gone(request.receive, self.out))

    async def next_item(self) -> Any:
        """The next item of the delta queue.

        Raises:
            APIError: 499 when the client closed the request.
        """
        item = await self.out.get()
        if item is GONE:
            raise APIError(499, "the client closed the request", code="client_closed_request")
        return item

    def fail(self, e: BaseException) -> APIError:
        """A choice's failure as the client's error (503 for a worker's, with
        ``Retry-After`` when the router is overloaded)."""
        if isinstance(e, APIError):
            return e
        if isinstance(e, NoWorkerAvailable):
            return unavailable(str(e))
        if isinstance(e, PoolBusy) or (isinstance(e, WorkerError) and e.busy):
            log.info("request %s shed: %s", self.rid, e)
            return overloaded("the server is overloaded; retry", self.config.retry_after_s,
                              status=503)
        log.warning("request %s failed: %s", self.rid, e)  # worker addresses stay in the log
        return APIError(503, "a worker failed while serving the request; retry",
                        "server_error", code="worker_error")

    def observe_e2e(self) -> None:
        """The request's end-to-end latency, on its first prompt's decode worker."""
        if self.jobs[0].decode is not None:
            self.metrics.e2e.labels(self.jobs[0].decode.name).observe(
                time.monotonic() - self.arrival)

    def end_trace(self, stream: Any = None) -> None:
        """End the request's span (and ``stream``'s) with the completion and cached token
        counts; once (later calls do nothing)."""
        span, self.span = self.span, None
        if span is None:
            return
        done = {"k3serve.completion_tokens": sum(len(a.token_ids) for a in self.accs.values()),
                "k3serve.cached_tokens": sum(j.cached_tokens or 0 for j in self.jobs)}
        tracing.end_span(stream, done)
        tracing.end_span(span, done)

    async def release(self) -> None:
        """Stop watching the client, end the choices' tasks, give the capacity back."""
        self.gone.cancel()
        await cancel(self.tasks)
        self.ticket.release()

    async def respond(self) -> Response:
        """Wait for the first output (or error) before answering, so failures before any
        token get a proper status code; a non-streaming request is then read to its end.

        Raises:
            APIError: a failure before the first output (or, not streaming, any failure).
        """
        ended = 0
        try:
            first = item = await self.next_item()
            if isinstance(first, BaseException):
                raise self.fail(first)
            while not self.req.stream:
                if isinstance(item, BaseException):
                    raise self.fail(item)
                if item is END:
                    ended += 1
                    if ended == self.num_choices:
                        break
                else:
                    self.accs.setdefault(item.index, ChoiceAcc()).absorb(item)
                item = await self.next_item()
        except BaseException:
            self.gone.cancel()
            await cancel(self.tasks)
            raise
        if not self.req.stream:
            await self.release()
            self.observe_e2e()
            self.end_trace()
            return JSONResponse(self.render.full(self.jobs, self.accs), headers=self.headers)
        self.first = first
        return SSEResponse(self.write, headers={**SSE_HEADERS, **(self.headers or {})})

    async def write(self, receive: Any, send: Any, start: dict[str, Any]) -> None:
        """The status and headers (``start``), then the SSE body, written straight to the
        ASGI ``send`` (no async generator, no task group): the deltas queued together go out
        as one chunk (:func:`coalesce`); the last chunk, the usage chunk and ``[DONE]`` as
        one write."""
        out, render, accs, num_choices = self.out, self.render, self.accs, self.num_choices
        item, seen, done = self.first, set(), 0
        running = self.req.continuous_usage  # every chunk carries the running usage
        pending = b""  # a choice's final chunk, held to go out with the end of the body
        stream = None if self.span is None else tracing.start_span("router.stream", self.span)
        try:
            await send(start)
            while True:
                if item is GONE:
                    return
                if isinstance(item, BaseException):
                    pending += sse_frame(data(self.fail(item).body()))
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
                    frame = (render.frame_with_usage(d, d.index not in seen, self.jobs, accs)
                             if running else render.frame(d, d.index not in seen))
                    seen.add(d.index)
                    if d.finish_reason and done == num_choices - 1:
                        pending += frame  # the last choice's last chunk: END follows
                    else:
                        if pending:
                            frame, pending = pending + frame, b""
                        await send({"type": "http.response.body", "body": frame,
                                    "more_body": True})
                if nxt is None:
                    nxt = out.get_nowait() if pending and not out.empty() else await out.get()
                item = nxt
            if done == num_choices:
                self.observe_e2e()
                if self.req.include_usage:
                    pending += sse_frame(data(render.usage_chunk(self.jobs, accs)))
            # Give the request's capacity back before the body ends: a client that sends its
            # next request on seeing the end must find it free (no spurious 429).
            await self.release()
            await send({"type": "http.response.body", "body": pending + DONE_FRAME,
                        "more_body": False})
        except OSError:  # the client went away mid-write
            return
        finally:
            await self.release()
            if self.span is not None:
                self.end_trace(stream)


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
