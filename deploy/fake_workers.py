"""In-process fake prefill/decode workers speaking the router's internal protocol.

Every body they take and answer is a model of :mod:`k3serve.messages` (FastAPI validates
the requests; the answers are built from the models), exactly as the real workers'.

They run the real cache bookkeeping (``k3serve.cache.manager.CacheManager``: prefix hits,
snapshots, cache events) and the real decode worker's channel serving
(:mod:`decode.stream`), but a toy "model" (:func:`toy_next`) instead of the network, so
router tests and benchmarks exercise every hop — register, info, cache events, reserve,
prefill (+ a fake transfer to the decode worker), stream, abort — over real HTTP in
milliseconds. A router with fake workers registered: :mod:`deploy.fake_stack`.

Servers run with uvicorn in background threads (:class:`ServerThread`).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from sse_starlette import EventSourceResponse

from decode.stream import Channels, take_ready
from k3serve.cache.manager import CacheManager
from k3serve.cache.specs import CacheConfig
from k3serve.messages import (
    ANSWER_EVENTS_LIMIT,
    AbortRequest,
    AbortResponse,
    AttachRequest,
    AttachResponse,
    CacheEvents,
    CacheState,
    Capacity,
    ChannelRequest,
    ErrorBody,
    PrefillRequest,
    PrefillResponse,
    ReserveRequest,
    ReserveResponse,
    StreamEvent,
    StreamRequest,
    TokenLogprob,
    WorkerInfo,
    WorkerLoad,
)
from k3serve.protocol import CLUSTER_TOKEN_HEADER
from k3serve.sampling import SamplingParams
from k3serve.tokenizer import get_tokenizer
from k3serve.tokenizer.detok import IncrementalDetokenizer

MODEL = "k3-tiny"
API_KEY = "sk-test-key"
TOKEN = "cluster-secret"
FINGERPRINT = "fake-layout"
TOKENIZER = get_tokenizer(MODEL)
END_BODY = object()  # a fake decode stream's queue: end the body (no finish event)


def toy_next(context: list[int], seed: int | None, temperature: float) -> int:
    """The toy model: a lowercase letter from the last tokens (greedy) or seeded noise."""
    base = (sum(context[-4:]) * 7 + len(context)) % 26
    if temperature > 0:
        base = (base + random.Random((seed or 0) * 1_000_003 + len(context)).randrange(26)) % 26
    return 97 + base


def toy_logprobs(tok: int, k: int | None) -> TokenLogprob:
    top = [(tok, -0.25), (97 + (tok - 96) % 26, -1.5), (32, -3.0)]
    return TokenLogprob(logprob=-0.25, top_logprobs=top[: (k or 0)])


def toy_generate(prompt: list[int], sp: SamplingParams) -> tuple[list[int], str, str]:
    """Oracle of a whole choice: (token ids, text, finish reason) as the router should return."""
    detok = IncrementalDetokenizer(TOKENIZER, sp, eos_token_id=TOKENIZER.eos_token_id)
    ctx = list(prompt)
    while not detok.finished:
        t = toy_next(ctx, sp.seed, sp.temperature)
        ctx.append(t)
        detok.step(t)
    return ctx[len(prompt):], detok.text, detok.finish_reason


@dataclass
class FakeState:
    role: str
    block_size: int = 16
    cluster_token: str | None = None
    cm: CacheManager = field(init=False)
    url: str = ""
    fail_prefill: int = 0  # answer this many prefills with 503
    busy_reserves: int = 0  # answer this many reservations with 503 "busy" (no decode room)
    busy_prefills: int = 0  # answer this many prefills with 503 "busy" + Retry-After (queue full)
    pairing_failures: int = 0  # answer this many prefills 502 transfer_pairing_failed (peer dead)
    invalid_prefills: int = 0  # answer this many prefills with 400 "invalid_request"
    reservations: dict[str, dict[str, Any]] = field(default_factory=dict)
    aborted: list[str] = field(default_factory=list)
    # validated /internal/prefill bodies as dicts, "_cached": the tokens the fake reused
    prefills: list[dict[str, Any]] = field(default_factory=list)
    unauthorized: int = 0
    hang_after: int | None = None  # a decode stream stalls after this many tokens until aborted
    streams: list[dict[str, Any]] = field(default_factory=list)  # /internal/stream bodies
    # end each decode stream after this many tokens with this finish_reason (None: no finish
    # event at all, only ``[DONE]``): a decode worker that aborts, or stops at its own limit
    cut_stream: tuple[int, str | None] | None = None
    stalled: bool = False  # a hung worker: every request waits (unanswered) while it is set
    max_model_len: int = 4096  # reported in /internal/info
    token_delay_s: float = 0.0  # seconds between two streamed tokens (a slower model)
    # the toy model's token #k (1-based, k >= 2: a decode token) is EOS (ignore_eos tests)
    eos_at: int | None = None
    num_pages: int = 256  # cache pages (block_size tokens each); restart() applies a change
    prefill_s_per_token: float = 0.0  # a prefill sleeps this long per uncached prompt token
    step_s: float = 0.0  # the fake decode loop's pause between two tokens of a stream
    coalesce: bool = True  # tokens ready together go out as one event (decode/stream.py)
    send_delay_s: float = 0.0  # a slow writer: pause before each decode stream event
    events_sent: int = 0  # decode stream events written
    queued_prefill_tokens: int = 0  # prompt tokens of prefills not answered yet (reported)
    prefill_count: int = 0  # prefills admitted since the last restart (reported, a counter) ...
    prefill_tokens: int = 0  # ... and their uncached prompt tokens
    # a prefill answer carries the cache events after the request's ``events_after`` (as
    # prefill/worker.py); off: an older worker that sends none (the router pulls them)
    answer_events: bool = True
    events_pulls: int = 0  # GET /internal/cache_events answered
    # decode: serve decode channels (POST /internal/channel, /internal/attach) and say so in
    # /internal/info; off: an older worker (the router opens one stream per request)
    channels: bool = True
    channels_opened: int = 0  # POST /internal/channel answered
    forget_channels: int = 0  # answer this many attaches 409 unknown_channel
    channel_registry: Channels | None = None  # the app's open decode channels
    loop: asyncio.AbstractEventLoop | None = None  # the server's, once it started

    def __post_init__(self) -> None:
        self.restart()

    def restart(self) -> None:
        """A worker restart: empty cache, new event epoch."""
        cfg = CacheConfig(num_pages=self.num_pages, num_slots=8, num_snapshots=16,
                          block_size=self.block_size)
        self.cm = CacheManager(cfg, FINGERPRINT)
        self.prefill_count = self.prefill_tokens = 0


def make_worker_app(state: FakeState) -> FastAPI:
    """The fake worker of ``state.role`` as an ASGI app (its routes: :func:`_info_routes`,
    :func:`_prefill_routes`, :func:`_decode_routes`)."""
    clients: list[httpx.AsyncClient] = []  # the "transfer" client, made in the server's loop

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        state.loop = asyncio.get_running_loop()
        yield
        for c in clients:
            await c.aclose()

    app = FastAPI(lifespan=lifespan)
    state.channel_registry = Channels()  # decode channels, as a real worker

    @app.middleware("http")
    async def token_check(request: Request, call_next):
        if state.cluster_token and request.url.path.startswith("/internal") \
                and request.headers.get(CLUSTER_TOKEN_HEADER) != state.cluster_token:
            state.unauthorized += 1
            return JSONResponse(ErrorBody(error="forbidden").model_dump(), status_code=403)
        while state.stalled:
            await asyncio.sleep(0.01)
        return await call_next(request)

    _info_routes(app, state)
    _prefill_routes(app, state, clients)
    _decode_routes(app, state)
    return app


def _info_routes(app: FastAPI, state: FakeState) -> None:
    """``/internal/info``, ``/internal/cache_events``, ``/internal/cache_state``, abort."""
    @app.get("/internal/info")
    async def info() -> WorkerInfo:
        return WorkerInfo(role=state.role, model=MODEL, fingerprint=FINGERPRINT,
                          block_size=state.block_size, max_model_len=state.max_model_len,
                          worker_id=f"{state.role}@{state.url.rsplit(':', 1)[-1]}",
                          capacity=Capacity(num_pages=state.num_pages, num_slots=8,
                                            num_snapshots=16),
                          channels=state.role == "decode" and state.channels)

    @app.get("/internal/cache_events")
    async def events(after: int = 0) -> CacheEvents:
        state.events_pulls += 1
        return cache_events(state, after)

    @app.get("/internal/cache_state")
    async def cache_state() -> CacheState:
        return CacheState.model_validate(state.cm.cache_state())

    @app.post("/internal/abort")
    async def abort(body: AbortRequest) -> AbortResponse:
        state.aborted.append(body.request_id)
        r = state.reservations.get(body.request_id)
        if r:
            r["aborted"] = True
            r["ready"].set()
            r["abort_ev"].set()
        return AbortResponse(found=r is not None)


def _prefill_routes(app: FastAPI, state: FakeState, clients: list[httpx.AsyncClient]) -> None:
    """``/internal/prefill`` (and its fake transfer to the decode worker)."""
    rid_counter = iter(range(1 << 30))

    @app.post("/internal/prefill", response_model=None)
    async def prefill(b: PrefillRequest) -> PrefillResponse | JSONResponse:
        if state.fail_prefill > 0:
            state.fail_prefill -= 1
            return JSONResponse(ErrorBody(error="overloaded").model_dump(), status_code=503)
        if state.busy_prefills > 0:
            state.busy_prefills -= 1
            return JSONResponse(ErrorBody(error="busy", message="queue full").model_dump(),
                                status_code=503, headers={"Retry-After": "1"})
        if state.pairing_failures > 0:
            state.pairing_failures -= 1
            return JSONResponse(ErrorBody(error="transfer_pairing_failed",
                                          message="decode bootstrap refused").model_dump(),
                                status_code=502)
        if state.invalid_prefills > 0:
            state.invalid_prefills -= 1
            return JSONResponse(ErrorBody(error="invalid_request",
                                          message="prompt_token_ids: bad token").model_dump(),
                                status_code=400)
        rec = b.model_dump()
        state.prefills.append(rec)
        # reported as a real worker does (worker/base.py load_report): a prompt's tokens
        # not computed yet — all of them until it is admitted, then its uncached part until
        # computed; nothing while its answer transfers
        queued = [len(b.prompt_token_ids)]
        state.queued_prefill_tokens += queued[0]
        try:
            return await _prefill(b, rec, queued)
        finally:
            state.queued_prefill_tokens -= queued[0]

    async def _prefill(b: PrefillRequest, rec: dict[str, Any],
                       queued: list[int]) -> PrefillResponse:
        sp = b.sampling
        ids = list(b.prompt_token_ids)
        seq = next(rid_counter)
        cm = state.cm
        rec["_cached"] = cm.run_prefill(seq, ids, cache_salt=b.cache_salt,
                                        snapshot_at=b.snapshot_at)
        state.prefill_count += 1
        state.prefill_tokens += len(ids) - rec["_cached"]

        def left(n: int) -> None:
            state.queued_prefill_tokens -= queued[0] - n
            queued[0] = n

        left(len(ids) - rec["_cached"])
        if state.prefill_s_per_token:  # compute time: the queue the worker reports is real
            await asyncio.sleep(state.prefill_s_per_token * (len(ids) - rec["_cached"]))
        left(0)
        tok = toy_next(ids, sp.seed, sp.temperature)
        lp = toy_logprobs(tok, sp.logprobs)
        if not clients:  # one pooled client: a new connection per prefill times out on a
            clients.append(httpx.AsyncClient(  # crowded box; expiry below uvicorn's 5 s
                timeout=60.0, limits=httpx.Limits(keepalive_expiry=2.0)))
        r = await clients[0].post(b.bootstrap_addr + "/fake/transfer",  # the "transfer"
                                  json={"ticket": b.ticket, "token_id": tok})
        r.raise_for_status()
        events = (cache_events(state, b.events_after, ANSWER_EVENTS_LIMIT)
                  if state.answer_events and b.events_after is not None else None)
        o = IncrementalDetokenizer(TOKENIZER, sp, eos_token_id=TOKENIZER.eos_token_id).step(tok)
        return PrefillResponse(request_id=b.request_id, token_id=tok, logprob=lp.logprob,
                               top_logprobs=lp.top_logprobs, num_cached_tokens=rec["_cached"],
                               cached_source="local", text=o.new_text,
                               finish_reason=o.finish_reason, position=len(ids),
                               seed=sp.seed or 0, cache_events=events)


def _decode_routes(app: FastAPI, state: FakeState) -> None:
    """``/internal/reserve``, the fake transfer's end, ``/internal/stream``, channels."""
    channels = state.channel_registry
    @app.post("/internal/reserve", response_model=None)
    async def reserve(b: ReserveRequest) -> ReserveResponse | JSONResponse:
        if state.busy_reserves > 0:
            state.busy_reserves -= 1
            return JSONResponse(ErrorBody(error="busy", message="no free slot").model_dump(),
                                status_code=503)
        ticket = uuid.uuid4().hex
        state.reservations[b.request_id] = {
            "prompt": list(b.prompt_token_ids), "sampling": b.sampling,
            "ticket": ticket, "ready": asyncio.Event(), "first": None, "aborted": False,
            "abort_ev": asyncio.Event()}
        return ReserveResponse(request_id=b.request_id, ticket=ticket, bootstrap_addr=state.url)

    @app.post("/fake/transfer")
    async def transfer(request: Request) -> dict[str, Any]:
        b = await request.json()
        for r in state.reservations.values():
            if r["ticket"] == b["ticket"]:
                r["first"] = b["token_id"]
                r["ready"].set()
                return {"ok": True}
        return JSONResponse({"error": "unknown ticket"}, status_code=404)

    @app.post("/internal/stream")
    async def stream(b: StreamRequest) -> EventSourceResponse:
        return EventSourceResponse(await open_stream(state, b), sep="\n")

    @app.post("/internal/channel", response_model=None)
    async def channel(b: ChannelRequest) -> StreamingResponse | JSONResponse:
        if not state.channels:
            return JSONResponse(ErrorBody(error="not_found").model_dump(), status_code=404)
        state.channels_opened += 1
        return channels.response(channels.open(b.channel))

    @app.post("/internal/attach", response_model=None)
    async def attach(b: AttachRequest) -> AttachResponse | JSONResponse:
        ch = channels.get(b.channel) if state.channels else None
        if state.forget_channels > 0:  # a worker that lost the channel (e.g. restarted)
            state.forget_channels -= 1
            ch = None
        if ch is None:
            return JSONResponse(ErrorBody(error="unknown_channel").model_dump(),
                                status_code=409)
        stream = await open_stream(state, b)
        if ch.closed:  # it closed while the stream opened (as decode/worker.py)
            abandon(state, b.request_id)
            return JSONResponse(ErrorBody(error="unknown_channel").model_dump(),
                                status_code=409)
        ch.forward(b.request_id, stream, abandoned=lambda: abandon(state, b.request_id))
        return AttachResponse(request_id=b.request_id, channel=ch.cid)


def cache_events(state: FakeState, after: int, limit: int | None = None) -> CacheEvents:
    """The worker's cache events after ``after`` (at most ``limit``) and its load report."""
    u = state.cm.usage()
    running = sum(1 for r in state.reservations.values()
                  if not r["aborted"] and not r.get("done"))
    load = WorkerLoad(queued_prefill_tokens=state.queued_prefill_tokens, running=running,
                      free_pages=u.num_pages - u.pages_used,
                      free_slots=u.num_slots - u.slots_used,
                      prefills=state.prefill_count if state.role == "prefill" else None,
                      prefill_tokens=state.prefill_tokens if state.role == "prefill"
                      else None)
    return CacheEvents.model_validate({**state.cm.events_since(after, limit),
                                       "load": load})


def abandon(state: FakeState, rid: str) -> None:
    """A stream that never started: the request ends, as a real worker aborts it."""
    r = state.reservations.get(rid)
    if r is not None:
        r["aborted"] = True
        r["abort_ev"].set()


async def open_stream(state: FakeState, b: StreamRequest) -> AsyncIterator[str]:
    """The request's decode stream: its SSE data lines, ``[DONE]`` last."""
    state.streams.append(b.model_dump(exclude={"channel"}))
    r = state.reservations[b.request_id]
    await asyncio.wait_for(r["ready"].wait(), 10)
    sp: SamplingParams = r["sampling"]
    q: asyncio.Queue = asyncio.Queue()

    async def engine() -> None:
        """The fake's decode loop: one token per step into ``q`` (the real worker's
        engine thread fills the queue the same way); ``step_s`` between steps."""
        try:
            detok = IncrementalDetokenizer(TOKENIZER, sp, eos_token_id=TOKENIZER.eos_token_id)
            ctx = list(r["prompt"]) + [r["first"]]
            detok.step(r["first"])
            sent = 0
            while not detok.finished and not r["aborted"]:
                t = toy_next(ctx, sp.seed, sp.temperature)
                if state.eos_at is not None and sent + 2 == state.eos_at:
                    t = TOKENIZER.eos_token_id
                ctx.append(t)
                o = detok.step(t)
                sent += 1
                cut = state.cut_stream is not None and sent == state.cut_stream[0]
                text, fin = o.new_text, o.finish_reason
                if cut:
                    fin = state.cut_stream[1]
                    if fin in ("stop", "length"):  # a detokenizer's finish releases its text
                        text += detok.finish(fin).new_text
                q.put_nowait(StreamEvent(
                    token_ids=[t], text=text, logprobs=[toy_logprobs(t, sp.logprobs)],
                    texts=[text] if sp.logprobs is not None else None, finish_reason=fin))
                if cut:
                    if state.cut_stream[1] is None:
                        q.put_nowait(END_BODY)  # the body ends with [DONE], no finish event
                    return
                if state.hang_after is not None and sent >= state.hang_after:
                    await r["abort_ev"].wait()
                await asyncio.sleep(state.step_s + state.token_delay_s)
        finally:
            r["done"] = True

    task = asyncio.create_task(engine())

    async def gen():
        left = None
        try:
            while True:
                ev, left = (left, None) if left is not None else (await q.get(), None)
                if state.send_delay_s:
                    await asyncio.sleep(state.send_delay_s)
                if ev is END_BODY:
                    break
                if state.coalesce:
                    ev, left = take_ready(q, ev)
                state.events_sent += 1
                yield ev.model_dump_json()
                if ev.finish_reason:
                    break
            yield "[DONE]"
        finally:
            task.cancel()

    return gen()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerThread:
    """Serve an ASGI app with uvicorn in a daemon thread on a free local port."""

    def __init__(self, app: Any, http: str = "h11", loop: str = "asyncio",
                 on_stop: Any = None) -> None:
        self.on_stop = on_stop  # called (from the stopping thread) before the server stops
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cfg = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="error",
                             lifespan="on", timeout_keep_alive=30,  # > clients' pool expiry
                             http=http, loop=loop)  # workers: h11, asyncio, as worker/serve.py
        self.server = uvicorn.Server(cfg)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("server did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        if self.on_stop is not None:
            self.on_stop()
        self.server.should_exit = True
        self.thread.join(10)


def start_worker(role: str, cluster_token: str | None) -> tuple[FakeState, ServerThread]:
    state = FakeState(role, cluster_token=cluster_token)

    def end_streams() -> None:  # as a real worker at the end of its drain
        if state.loop is not None and state.channel_registry is not None:
            with contextlib.suppress(RuntimeError):  # its loop already closed
                state.loop.call_soon_threadsafe(state.channel_registry.close_all)

    srv = ServerThread(make_worker_app(state), on_stop=end_streams)
    state.url = srv.url
    return state, srv.start()
