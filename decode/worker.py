"""Decode worker: reserves cache for incoming requests, receives it, streams tokens #2…

``python -m decode.worker --host H --port P --model k3-tiny --router-url URL --block-size B``

Lifecycle steps 3 and 7–9 of :mod:`k3serve.protocol` (the numbered walkthrough); here, one
request goes through the phases of :class:`DecodePhase`::

    POST /internal/reserve (ReserveRequest) ─▶ disagg.reserve(rid, prompt) → slot + pages;
        KVReceiver(bootstrap server, slot/pages) ─▶ ReserveResponse{ticket, bootstrap_addr}
    TRANSFER     the prefill worker pairs with our bootstrap server and writes the cache
      │ receiver SUCCESS ─▶ disagg.admit(rid, [token #1], TransferMetadata's params) ─▶ RUNNING
      │ receiver FAILED  ─▶ AWAIT_FIRST: the reservation is freed once no sender can still
      │                     write into it (on_release); as soon as the router has passed
      │                     token #1 (``/internal/stream``): engine.add_request(rid#fallback,
      │                     prompt, params, output_token_ids=[token #1]) ─▶ RUNNING — the
      │                     prefill recomputed here, continuing from the prefill worker's
      │                     token #1 (never re-sampled); k3serve:kv_transfer_fallbacks_total
    RUNNING      one StreamEvent per engine step from token #2 on: the tokens, the text the
                 engine's detokenizer released for them (it decides the stops), logprobs
    DONE         finished or aborted; its events wait STREAM_TTL_S for an unopened stream

    POST /internal/stream (StreamRequest: token #1 as the prefill worker answered it)
        ─▶ SSE of StreamEvent, then ``data: [DONE]``
    POST /internal/generate (GenerateRequest; monolithic serving, no prefill worker)
        ─▶ engine.add_request(rid, prompt) here ─▶ RUNNING; token #1 answers the call as a
        PrefillResponse (num_cached_tokens from this worker's prefix cache), then the stream
        above yields tokens #2… as after an admitted transfer
    POST /internal/resume (ResumeRequest; request migration: the request's decode worker failed
        mid-stream) ─▶ engine.add_request(rid, prompt, params, output_token_ids=the tokens the
        client has) ─▶ RUNNING; the prefill of prompt + outputs is recomputed here and sampling
        continues at position L + len(outputs) with the request's seed; the stream above
        yields the tokens after the outputs; k3serve:requests_resumed_total
    POST /internal/abort  at any point: the ticket fails (the sender stops), the engine request
        ends, every slot and page comes back.
    POST /internal/channel (ChannelRequest) ─▶ a decode channel: one SSE body for the streams
        of many requests, each event tagged ``event: <request id>`` (decode/stream.py)
    POST /internal/attach (AttachRequest: /internal/stream's body + the channel) ─▶ the
        request's stream goes on that channel; answered at once (AttachResponse)

Token #1 has one source: the token the prefill worker sampled, as its ``PrefillResponse``
gave it to the router and the client (monolithic: this worker's own ``PrefillResponse``).
The transfer's ``TransferMetadata`` carries a copy so that decoding starts before the router's
stream request (which carries the router's copy) arrives. A copy that differs from the
router's is never continued silently: before admission the prompt is recomputed from the
router's token #1; after it, the stream ends with an error event (the router migrates the
request with the tokens the client has).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Any

from decode.routes import add_routes
from decode.state import DecodePhase, DecodeState
from decode.stream import Channels, token_texts
from decode.trace import DecodeTraces
from k3serve.messages import (
    GenerateRequest,
    PrefillResponse,
    RequestsDebug,
    RequestState,
    ReserveRequest,
    ReserveResponse,
    ResumeRequest,
    ResumeResponse,
    StreamEvent,
    StreamRequest,
    TokenLogprob,
    WorkerInfo,
    WorkerUsage,
    finite,
    top_pairs,
)
from k3serve.sampling import SamplingParams, draw_seed
from kvstore import CacheRef, KVBootstrapServer, KVPoll, KVReceiver
from worker.base import BaseWorker, Failure
from worker.serve import serve

log = logging.getLogger("k3serve.worker")

FALLBACK_SUFFIX = "#fallback"
#: Keep a finished request's events this long for a stream that has not been opened (s).
STREAM_TTL_S = 60.0
#: After a failed transfer, wait this long for the router to open the stream with token #1
#: (s): longer than a prefill may take (``prefill.worker.PREFILL_TIMEOUT_S``, 600 s). Nothing
#: is held meanwhile (the reservation is freed).
FIRST_TOKEN_TTL_S = 700.0


class DecodeWorker(BaseWorker):
    """The decode role (see the module docstring)."""

    role = "decode"

    def __init__(self, config, engine=None) -> None:
        super().__init__(config, engine)
        c = self.kv_config
        self.server = KVBootstrapServer(self.kv, self.layout, c.bootstrap_host, c.bootstrap_port,
                                        cluster_token=config.cluster_token)
        self.reqs: dict[str, DecodeState] = {}
        self.by_engine: dict[str, DecodeState] = {}
        #: monolithic requests whose token #1 is not answered yet: request id → the future
        #: ``POST /internal/generate`` awaits (:meth:`generate_request`)
        self.direct: dict[str, asyncio.Future] = {}
        #: aborts that arrived before their reservation (the router's abort overtook its own
        #: cancelled reserve call): request id → when; such a reserve is refused (409)
        self.aborted_early: dict[str, float] = {}
        self.stream_idle_s = max(120.0, c.receiver_timeout_s + 60.0)
        self.channels = Channels()  # decode channels open here (POST /internal/channel)
        self.traces = DecodeTraces(self.worker_id)  # tracing on: the traced requests' spans

    def start(self) -> None:
        self.server.start()
        super().start()

    def close(self) -> None:
        super().close()
        self.server.stop()

    # ------------------------------------------------------------------ engine thread
    def reserve_request(self, body: ReserveRequest, params: SamplingParams,
                 events: asyncio.Queue) -> ReserveResponse:
        rid = body.request_id
        if rid in self.reqs:
            raise ValueError(f"request_id: {rid!r} is already live")
        if self.aborted_early.pop(rid, None) is not None:
            raise Failure(409, "aborted", f"request {rid!r} was aborted before its reservation")
        h = self.disagg.reserve(rid, list(body.prompt_token_ids), cache_salt=body.cache_salt)
        r = DecodeState(rid, list(body.prompt_token_ids), params, body.cache_salt, events)
        try:
            r.receiver = KVReceiver(self.server, CacheRef(h.slot, h.pages, h.num_tokens),
                                    timeout_s=self.kv_config.receiver_timeout_s,
                                    pair_timeout_s=self.kv_config.pair_timeout_s,
                                    on_release=lambda: self._free_reservation(r))
        except Exception:
            self.engine.abort_request(rid)
            raise
        self.reqs[rid] = r
        return ReserveResponse(request_id=rid, ticket=r.receiver.ticket,
                               bootstrap_addr=self.server.address)

    def _free_reservation(self, r: DecodeState) -> None:
        """A failed ticket's reservation may be reused now (no sender can write into it)."""
        if r.reservation_open:
            self.engine.abort_request(r.rid)
            r.reservation_open = False

    def tick(self) -> bool:
        self.server.pump()
        now = time.monotonic()
        active = False
        for r in list(self.reqs.values()):
            rx = r.receiver
            if r.phase is DecodePhase.TRANSFER:
                active = True
                if rx.state == KVPoll.SUCCESS:
                    self._admit(r)
                elif rx.state == KVPoll.FAILED:
                    self._fallback(r)
            elif r.phase is DecodePhase.AWAIT_FIRST and now - r.failed_at > FIRST_TOKEN_TTL_S:
                self._end(r, StreamEvent.failure("no stream opened after the transfer failed"))
            if rx is not None and rx.state.terminal and (rx.state == KVPoll.SUCCESS
                                                          or rx.released):
                rx.close()
                r.receiver = None
            elif rx is not None:
                active = True  # a release is pending: keep pumping
            if (r.phase is DecodePhase.DONE and r.receiver is None and not r.reservation_open
                    and (r.stream_closed or now - (r.finished_at or now) > STREAM_TTL_S)):
                del self.reqs[r.rid]
        return active

    def _admit(self, r: DecodeState) -> None:
        res = r.receiver.result
        try:
            if res is None:
                raise ValueError("the receiver succeeded without a result")
            meta = res.metadata
            if meta.prompt_token_ids != r.prompt:
                raise ValueError("metadata prompt_token_ids differ from the reserved prompt")
            if meta.position != len(r.prompt):
                raise ValueError(f"metadata position {meta.position} != prompt length "
                                 f"{len(r.prompt)}")
            params = meta.sampling
            tok, lp = meta.token_id, meta.logprob
            if r.first is not None and r.first[0] != tok:
                raise ValueError(f"token #1 {r.first[0]} from the router differs from the "
                                 f"transferred {tok}")
            r.transferred_first = tok
            out = self.disagg.admit(r.rid, [tok], params,
                                    output_logprobs=[math.nan if lp is None else float(lp)])
        except (KeyError, TypeError, ValueError) as e:
            # the sender is done writing (SUCCESS), so the reservation can go right away
            log.warning("decode %s: cannot admit the transferred cache (%s); recomputing",
                        r.rid, e)
            self._free_reservation(r)
            self._fallback(r)
            return
        r.reservation_open = False  # slot and pages now belong to the running request
        self._run(r, r.rid, out)

    def _run(self, r: DecodeState, engine_rid: str, out: Any) -> None:
        """The engine request ``engine_rid`` (token #1 fed) produces ``r``'s tokens from now on;
        ``out``: its output when token #1 already finished it."""
        r.to(DecodePhase.RUNNING)
        r.engine_rid = engine_rid
        if self.traces.spans:
            self.traces.admitted(r.rid)
        self.by_engine[engine_rid] = r
        # the text the client has (token #1's from P's answer, or the streamed outputs'): the
        # stream's text starts after it (the engine's detokenizer released the same)
        if out is not None:
            r.text_len = len(out.outputs[0].text)
            self._emit(r, out)
        else:
            r.text_len = len(self.engine.requests[engine_rid].seqs[0].detok.text)

    def _fallback(self, r: DecodeState) -> None:
        """The transfer failed: recompute here, from token #1 once the stream brought it."""
        if r.phase is not DecodePhase.TRANSFER:
            return
        err = r.receiver.error if r.receiver is not None else "admit failed"
        if r.receiver is not None and r.receiver.expired:
            self.metrics.expiry()
        r.to(DecodePhase.AWAIT_FIRST)
        if r.first is None:
            log.warning("decode %s: transfer failed (%s); recomputing once the stream brings "
                        "token #1", r.rid, err)
            return
        log.warning("decode %s: transfer failed (%s); recomputing the prefill here", r.rid, err)
        self._start_fallback(r)

    def _start_fallback(self, r: DecodeState) -> None:
        """Prefill ``prompt + token #1`` here and continue from token #2 (token #1 is the
        prefill worker's, already sent to the client: it is not sampled again)."""
        if r.first is None:
            raise RuntimeError(f"decode {r.rid}: fallback without token #1")
        self.metrics.fallback()
        fb = r.rid + FALLBACK_SUFFIX
        tok, lp = r.first
        try:
            out = self.engine.add_request(fb, r.prompt, r.params, cache_salt=r.cache_salt,
                                          output_token_ids=[tok], output_logprobs=[lp])
        except ValueError as e:
            self._end(r, StreamEvent.failure(f"fallback prefill failed: {e}"))
            return
        self._run(r, fb, out)

    # ------------------------------------------------------------------ monolithic (engine thread)
    def generate_request(self, body: GenerateRequest, params: SamplingParams, events: asyncio.Queue,
                  fut: asyncio.Future) -> None:
        """Monolithic serving: prefill ``body``'s prompt HERE and decode it here (no reserve,
        no transfer). ``fut`` gets token #1 as a :class:`PrefillResponse` (with the prefix
        cache's ``num_cached_tokens``); tokens #2… queue on ``events`` for the stream the
        router opens next, exactly as after an admitted transfer.

        Raises:
            ValueError: a live ``request_id``, or a prompt the engine refuses.
            CacheFullError: no room now (answered 503 ``busy``).
        """
        rid = body.request_id
        if rid in self.reqs:
            raise ValueError(f"request_id: {rid!r} is already live")
        if params.seed is None:  # resolved here: the answer carries it, as a prefill's does
            params = params.with_seed(draw_seed())
        r = DecodeState(rid, list(body.prompt_token_ids), params, body.cache_salt, events,
                        reservation_open=False, sent=0)
        out = self.engine.add_request(rid, r.prompt, params, cache_salt=body.cache_salt,
                                      snapshot_at=body.snapshot_at)
        self.reqs[rid] = r
        self.direct[rid] = fut
        self._run(r, rid, out)

    def resume_request(self, body: ResumeRequest, params: SamplingParams,
                events: asyncio.Queue) -> ResumeResponse:
        """Request migration: continue ``body``'s request here after ``output_token_ids`` (the
        tokens its failed decode worker already streamed; the prefill of prompt + outputs is
        recomputed here, nothing is sampled again). Its stream, opened next, yields only the
        tokens after the outputs.

        Raises:
            ValueError: a live ``request_id``, an unseeded ``sampling`` (the resumed request
                must sample with the seed it started with), or prompt / outputs the engine
                refuses (out of vocabulary, too long, going on after a finishing token).
        """
        rid = body.request_id
        if rid in self.reqs:
            raise ValueError(f"request_id: {rid!r} is already live")
        if params.seed is None:
            raise ValueError("sampling.seed: a resumed request needs the seed it was sampled "
                             "with")
        outs = list(body.output_token_ids)
        lps = [math.nan if lp is None else float(lp) for lp in body.output_logprobs[:len(outs)]]
        r = DecodeState(rid, list(body.prompt_token_ids), params, body.cache_salt, events,
                        reservation_open=False, sent=len(outs))
        out = self.engine.add_request(rid, r.prompt, params, cache_salt=body.cache_salt,
                                      output_token_ids=outs, output_logprobs=lps)
        self.reqs[rid] = r
        self.metrics.resumed()
        self._run(r, rid, out)
        return ResumeResponse(request_id=rid, position=len(r.prompt) + len(outs))

    def _answer_first(self, r: DecodeState, out: Any) -> None:
        """A monolithic request produced token #1: answer ``POST /internal/generate`` with it
        and start its stream after it."""
        fut = self.direct.pop(r.rid)
        c = out.outputs[0]
        self.metrics.prefix_query(len(r.prompt), out.num_cached_tokens)
        tops = c.top_logprobs[0] if c.top_logprobs else None
        r.sent = 1
        one = len(c.token_ids) == 1
        if one:
            r.text_len = len(c.text)
        self.resolve(fut, PrefillResponse(
            request_id=r.rid, token_id=c.token_ids[0], logprob=finite(c.logprobs[0]),
            top_logprobs=top_pairs(tops) if tops is not None else None,
            num_cached_tokens=out.num_cached_tokens, cached_source="local",
            text=c.text if one else "",
            finish_reason=c.finish_reason if one and out.finished else None,
            position=len(r.prompt), seed=r.params.seed))

    def _fail_first(self, rid: str, message: str) -> None:
        """A monolithic request ended before token #1: fail its ``/internal/generate``."""
        fut = self.direct.pop(rid, None)
        if fut is not None:
            self.resolve(fut, exc=Failure(409, "aborted", message))

    def on_outputs(self, outs: list) -> None:
        for out in outs:
            r = self.by_engine.get(out.request_id)
            if r is not None and r.phase is DecodePhase.RUNNING:
                self._emit(r, out)

    def _emit(self, r: DecodeState, out: Any) -> None:
        c = out.outputs[0]
        if r.rid in self.direct:
            if c.token_ids:
                self._answer_first(r, out)
            elif out.finished:
                self._fail_first(r.rid, "the request ended before token #1")
        if r.fallback and not r.fb_counted:
            r.fb_counted = True
            self.metrics.prefix_query(len(r.prompt), out.num_cached_tokens)
        toks = list(c.token_ids[r.sent:])
        lps = list(c.logprobs[r.sent:])
        tops = list(c.top_logprobs[r.sent:]) if c.top_logprobs is not None else None
        texts = (token_texts(c.text, c.text_ends[r.sent:len(c.token_ids)], r.text_len)
                 if toks and c.text_ends is not None else None)
        r.sent = max(r.sent, len(c.token_ids))
        text = c.text[r.text_len:] if len(c.text) > r.text_len else ""
        r.text_len = max(r.text_len, len(c.text))
        fin = (c.finish_reason or "abort") if out.finished else None
        if toks or fin:
            self.push(r.events, StreamEvent(
                token_ids=toks, text=text, texts=texts, finish_reason=fin,
                logprobs=[TokenLogprob(logprob=finite(lp),
                                       top_logprobs=top_pairs(tops[k]) if tops is not None
                                       else None)
                          for k, lp in enumerate(lps)]))
        if out.finished:
            self.by_engine.pop(r.engine_rid, None)
            r.to(DecodePhase.DONE)
            if self.traces.spans:
                self.traces.end(r.rid, r.sent)

    def _end(self, r: DecodeState, event: StreamEvent) -> None:
        """Stop a request that has not finished: free what it holds, send a final event."""
        if r.phase is DecodePhase.TRANSFER:
            r.receiver.abort(event.error or "aborted by decode")
        elif r.phase is DecodePhase.RUNNING:
            self.engine.abort_request(r.engine_rid)
            self.by_engine.pop(r.engine_rid, None)
        if r.phase is not DecodePhase.DONE:
            r.to(DecodePhase.DONE)
            self.push(r.events, event)
            if self.traces.spans:
                self.traces.end(r.rid, r.sent, error=event.error or "aborted")
        self._fail_first(r.rid, event.error or "aborted")

    def abort(self, rid: str, reason: str) -> bool:
        r = self.reqs.get(rid)
        if r is None:  # its reserve may still be on the way: refuse it when it lands
            now = time.monotonic()
            self.aborted_early = {k: t for k, t in self.aborted_early.items()
                                  if now - t < STREAM_TTL_S}
            self.aborted_early[rid] = now
            return False
        self._end(r, StreamEvent(finish_reason="abort"))
        self.tick()
        log.info("decode %s: %s", rid, reason)
        return True

    def fail_all(self, err: BaseException) -> None:
        for r in list(self.reqs.values()):
            self._end(r, StreamEvent.failure(f"engine error: {err!r}"))

    def open_stream(self, body: StreamRequest) -> asyncio.Queue:
        """The events of ``body.request_id``; token #1 noted (a pending fallback starts).

        Raises:
            Failure: 404 ``unknown_request``, 409 ``stream_taken``.
        """
        rid = body.request_id
        r = self.reqs.get(rid)
        if r is None:
            raise Failure(404, "unknown_request", f"no request {rid!r} here")
        if r.stream_opened:
            raise Failure(409, "stream_taken", f"request {rid!r} is already streaming")
        r.stream_opened = True
        r.first = (body.token_id, math.nan if body.logprob is None else float(body.logprob))
        if r.phase is DecodePhase.AWAIT_FIRST:
            self._start_fallback(r)
        elif r.transferred_first is not None and r.transferred_first != body.token_id:
            self._end(r, StreamEvent.failure(
                f"token #1 {body.token_id} from the router differs from the transferred "
                f"{r.transferred_first} this request continued from"))
        return r.events

    def close_stream(self, rid: str) -> None:
        r = self.reqs.get(rid)
        if r is not None:
            r.stream_closed = True

    def end_streams(self) -> None:
        """Close the decode channels (the end of a drain, on the server's loop)."""
        self.channels.close_all()

    def num_waiting(self) -> int:
        return len(self.engine.scheduler.waiting) + self._num_transferring()

    def settled(self, r: DecodeState) -> bool:  # a drain does not wait for a stream never opened
        return (r.phase is DecodePhase.DONE and r.receiver is None and not r.reservation_open
                and (r.stream_closed or not r.stream_opened))

    def _num_transferring(self) -> int:
        return sum(1 for r in self.reqs.values() if r.phase is DecodePhase.TRANSFER)

    def usage(self) -> WorkerUsage:
        return super().usage().model_copy(update={
            "open_tickets": self.server.open_tickets(),
            "unreleased_tickets": self.server.unreleased(),
            "num_transfers_pending": self._num_transferring(),
            "num_requests_tracked": len(self.reqs)})

    def info(self) -> WorkerInfo:
        return super().info().model_copy(update={"bootstrap_addr": self.server.address,
                                                  "channels": True})

    def describe(self, rid: str | None) -> RequestsDebug:
        """``GET /internal/requests`` body: tracked requests, their phase and ticket state."""
        out = {}
        for r in self.reqs.values():
            if rid is None or r.rid == rid:
                rx = r.receiver
                out[r.rid] = RequestState(
                    phase=r.phase.value, fallback=r.fallback,
                    ticket_state=rx.state.name if rx is not None else None,
                    ticket_error=rx.error if rx is not None else None,
                    reservation_open=r.reservation_open, tokens_sent=r.sent)
        return RequestsDebug(requests=out)

    # ------------------------------------------------------------------ HTTP
    def routes(self, app: Any) -> None:
        add_routes(app, self)


def main(argv: list[str] | None = None) -> int:
    return serve(DecodeWorker, "decode", argv)


if __name__ == "__main__":
    raise SystemExit(main())
