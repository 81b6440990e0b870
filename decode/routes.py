"""The decode worker's HTTP routes (:class:`decode.worker.DecodeWorker` adds them to its app).

Each handler validates its body, runs the worker's engine-thread entry point through
``worker.loop.call`` and answers; the lifecycle they drive is drawn in :mod:`decode.worker`.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import Request

from decode.stream import ChannelResponse, StreamEventsResponse, events
from k3serve import tracing
from k3serve.cache.allocator import CacheFullError
from k3serve.messages import (
    AttachRequest,
    AttachResponse,
    ChannelRequest,
    GenerateRequest,
    PrefillResponse,
    ReserveRequest,
    ReserveResponse,
    ResumeRequest,
    ResumeResponse,
    StreamEvent,
    StreamRequest,
)
from worker.base import Failure, sampling_params
from worker.http import errors, json_errors

#: Longest a monolithic request may take from arrival to token #1 (s), queueing included.
GENERATE_TIMEOUT_S = 600.0


def add_routes(app: Any, worker: Any) -> None:
    """Add ``/internal/{reserve,generate,resume,stream,channel,attach}`` to the FastAPI
    ``app`` of ``worker`` (a :class:`decode.worker.DecodeWorker`)."""

    async def engine_call(fn: Any, *args: Any) -> Any:
        """``fn(*args)`` on the engine thread; a full cache → 503 ``busy``, bad input →
        400 ``invalid_request``."""
        try:
            return await worker.loop.call(fn, *args)
        except CacheFullError as e:
            raise Failure(503, "busy", str(e)) from None
        except ValueError as e:
            raise Failure(400, "invalid_request", str(e)) from None

    async def traced(request: Request, body: Any, fn: Any, *args: Any) -> Any:
        """:func:`engine_call` of an admission, its ``decode.admission`` span opened (under
        the caller's ``traceparent``) first and ended with an error if it is refused."""
        rid = body.request_id
        worker.traces.begin(rid, request.headers, len(body.prompt_token_ids))
        try:
            return await engine_call(fn, *args)
        except BaseException as e:
            worker.traces.end(rid, error=str(e) or type(e).__name__)
            raise

    @app.post("/internal/reserve", response_model=ReserveResponse,
              responses=errors(400, 403, 503))
    async def reserve(body: ReserveRequest, request: Request) -> ReserveResponse:
        params = sampling_params(body.sampling)
        if tracing.enabled():
            return await traced(request, body, worker.reserve_request, body, params,
                                asyncio.Queue())
        return await engine_call(worker.reserve_request, body, params, asyncio.Queue())

    @app.post("/internal/generate", response_model=PrefillResponse,
              responses=errors(400, 403, 409, 503, 504))
    async def generate(body: GenerateRequest, request: Request) -> PrefillResponse:
        """Monolithic serving: prefill and decode here; answers token #1."""
        params = sampling_params(body.sampling)
        fut = asyncio.get_running_loop().create_future()
        await (traced(request, body, worker.generate_request, body, params, asyncio.Queue(),
                      fut) if tracing.enabled()
               else engine_call(worker.generate_request, body, params, asyncio.Queue(), fut))
        try:
            return await asyncio.wait_for(asyncio.shield(fut), GENERATE_TIMEOUT_S)
        except TimeoutError:
            await worker.loop.call(worker.abort, body.request_id, "generate timed out")
            raise Failure(504, "timeout",
                          f"no token #1 within {GENERATE_TIMEOUT_S:.0f} s") from None
        except asyncio.CancelledError:  # the caller went away
            worker.loop.submit(worker.abort, body.request_id, "caller disconnected")
            raise

    @app.post("/internal/resume", response_model=ResumeResponse,
              responses=errors(400, 403, 503))
    async def resume(body: ResumeRequest, request: Request) -> ResumeResponse:
        """Request migration: continue a request after the tokens already streamed."""
        params = sampling_params(body.sampling)
        if tracing.enabled():
            return await traced(request, body, worker.resume_request, body, params,
                                asyncio.Queue())
        return await engine_call(worker.resume_request, body, params, asyncio.Queue())

    def closer(rid: str) -> Any:
        """A request stream's ``on_close``: one that ends before its finish aborts it."""
        def on_close(finished: bool) -> None:
            if not finished:
                worker.loop.submit(worker.abort, rid, "stream closed early")
            worker.loop.submit(worker.close_stream, rid)

        return on_close

    @app.post("/internal/stream", response_class=StreamEventsResponse,
              responses={200: {"model": StreamEvent,
                               "description": "one StreamEvent per data: line, then "
                                              "data: [DONE]"},
                         **json_errors(400, 403, 404, 409)})
    async def stream(body: StreamRequest) -> StreamEventsResponse:
        q = await worker.loop.call(worker.open_stream, body)
        return StreamEventsResponse(events(q, worker.stream_idle_s,
                                           closer(body.request_id)),
                                    headers={"Cache-Control": "no-cache"})

    @app.post("/internal/channel", response_class=ChannelResponse,
              responses={200: {"model": StreamEvent,
                               "description": "the attached requests' StreamEvents, "
                                              "each 'event: <request id>' and its "
                                              "data: line; [DONE] per request"},
                         **json_errors(400, 403)})
    async def channel(body: ChannelRequest) -> ChannelResponse:
        """A decode channel: the streams of the requests attached to it, on one body."""
        return worker.channels.response(worker.channels.open(body.channel))

    @app.post("/internal/attach", response_model=AttachResponse,
              responses=errors(400, 403, 404, 409))
    async def attach(body: AttachRequest) -> AttachResponse:
        """``/internal/stream``'s events, sent on the open channel ``body.channel``."""
        ch = worker.channels.get(body.channel)
        if ch is None:
            raise Failure(409, "unknown_channel", f"no channel {body.channel!r} is open")
        rid = body.request_id
        q = await worker.loop.call(worker.open_stream, body)
        on_close = closer(rid)
        if ch.closed:  # it closed while the stream opened: the router hears of it
            on_close(False)
            raise Failure(409, "unknown_channel", f"channel {body.channel!r} closed")
        ch.forward(rid, events(q, worker.stream_idle_s, on_close),
                   abandoned=lambda: on_close(False))
        return AttachResponse(request_id=rid, channel=ch.cid)


__all__ = ["GENERATE_TIMEOUT_S", "add_routes"]
