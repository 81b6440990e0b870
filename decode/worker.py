"""Decode worker: reserves cache for incoming requests, receives it, streams tokens #2…

``python -m decode.worker --host H --port P --model k3-tiny --router-url URL --block-size B``

One request (lifecycle steps 3, 7–9 of :mod:`k3serve.protocol`)::

    POST /internal/reserve ─▶ engine.reserve(rid, prompt) → slot + pages
                              KVReceiver(bootstrap server, slot/pages) → {ticket, bootstrap_addr}
    (the prefill worker pairs with our bootstrap server and writes the cache, layer by layer)
    tick: receiver SUCCESS ─▶ engine.admit(rid, [token #1], params from the metadata)
                              the request joins the decode batch at token #2
          receiver FAILED  ─▶ fallback: engine.add_request(rid#fallback, prompt, params,
                              output_token_ids=[token #1]) — the prefill of prompt + token #1
                              recomputed here, continuing from the prefill worker's token #1
                              (the one the client has; never re-sampled here), as soon as the
                              router has passed it (``/internal/stream``); counted in
                              k3serve:kv_transfer_fallbacks_total. The reservation is freed
                              once no sender can still write into it (on_release).
    POST /internal/stream  ─▶ {request_id, token_id, logprob}: token #1 as the prefill worker
                              answered it; SSE: {"token_ids", "text", "logprobs",
                              "finish_reason"} per step from token #2 on, then ``data: [DONE]``
    POST /internal/abort   ─▶ at any point: the ticket fails (the sender stops), the engine
                              request ends, every slot and page comes back.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictInt

from k3serve.sampling import SamplingParams
from k3serve.worker_common import (
    BaseWorker,
    RequestBody,
    error,
    finite,
    log,
    parse_sampling,
    serve,
    top_list,
)

FALLBACK_SUFFIX = "#fallback"
#: Keep a finished request's events this long for a stream that has not been opened (s).
STREAM_TTL_S = 60.0
#: After a failed transfer, wait this long for the router to open the stream with token #1
#: (s): longer than a prefill may take (``prefill.worker.PREFILL_TIMEOUT_S``, 600 s). Nothing
#: is held meanwhile (the reservation is freed).
FIRST_TOKEN_TTL_S = 700.0


class ReserveBody(BaseModel):
    """``POST /internal/reserve`` body."""

    model_config = ConfigDict(extra="ignore")
    request_id: str = Field(min_length=1)
    prompt_token_ids: list[StrictInt] = Field(min_length=1)
    sampling: dict[str, Any] = Field(default_factory=dict)
    n: int = Field(default=1, ge=1, le=1)
    cache_salt: str | None = None


class StreamBody(RequestBody):
    """``POST /internal/stream`` body: token #1 as the prefill worker answered it (a failed
    transfer's fallback continues from it)."""

    token_id: StrictInt = Field(ge=0)
    logprob: float | None = None


@dataclass(eq=False)
class _Decode:
    """One request's state on the engine thread.

    ``phase``: ``transfer`` (reserved, cache arriving) → ``running`` (admitted, or recomputing
    after a failed transfer) → ``done`` (finished or aborted; events may still be unread). A
    transfer that fails before the stream brought token #1 goes through ``await_first``
    (nothing held) until it does.
    """

    rid: str
    prompt: list[int]
    params: SamplingParams
    cache_salt: str | None
    events: asyncio.Queue
    receiver: Any = None  # KVReceiver while its ticket is open or its release pending
    phase: str = "transfer"
    engine_rid: str | None = None  # the engine request producing tokens
    reservation_open: bool = True  # the reserved engine request still holds slot + pages
    fallback: bool = False
    fb_counted: bool = False
    first: tuple[int, float] | None = None  # token #1 + logprob, from the stream request
    failed_at: float = 0.0
    sent: int = 1  # output tokens delivered (token #1 came from the prefill worker)
    text_len: int = 0
    finished_at: float | None = None
    stream_opened: bool = False
    stream_closed: bool = False


class DecodeWorker(BaseWorker):
    """The decode role (see the module docstring)."""

    role = "decode"

    def __init__(self, args, engine=None) -> None:
        from kvstore import KVBootstrapServer

        super().__init__(args, engine)
        c = self.kv_config
        self.server = KVBootstrapServer(self.kv, self.layout, c.bootstrap_host, c.bootstrap_port)
        self.reqs: dict[str, _Decode] = {}
        self.by_engine: dict[str, _Decode] = {}
        self.stream_idle_s = max(120.0, c.receiver_timeout_s + 60.0)

    def start(self) -> None:
        self.server.start()
        super().start()

    def close(self) -> None:
        super().close()
        self.server.stop()

    # ------------------------------------------------------------------ engine thread
    def _reserve(self, body: ReserveBody, params: SamplingParams,
                 events: asyncio.Queue) -> dict[str, Any]:
        from kvstore import CacheRef, KVReceiver

        rid = body.request_id
        if rid in self.reqs:
            raise ValueError(f"request_id: {rid!r} is already live")
        h = self.engine.reserve(rid, list(body.prompt_token_ids), cache_salt=body.cache_salt)
        r = _Decode(rid, list(body.prompt_token_ids), params, body.cache_salt, events)
        try:
            r.receiver = KVReceiver(self.server, CacheRef(h.slot, h.pages, h.num_tokens),
                                    timeout_s=self.kv_config.receiver_timeout_s,
                                    pair_timeout_s=self.kv_config.pair_timeout_s,
                                    on_release=lambda: self._free_reservation(r))
        except Exception:
            self.engine.abort_request(rid)
            raise
        self.reqs[rid] = r
        return {"request_id": rid, "ticket": r.receiver.ticket,
                "bootstrap_addr": self.server.address}

    def _free_reservation(self, r: _Decode) -> None:
        """A failed ticket's reservation may be reused now (no sender can write into it)."""
        if r.reservation_open:
            self.engine.abort_request(r.rid)
            r.reservation_open = False

    def tick(self) -> bool:
        from kvstore import KVPoll

        self.server.pump()
        now = time.monotonic()
        active = False
        for r in list(self.reqs.values()):
            rx = r.receiver
            if r.phase == "transfer":
                active = True
                st = rx.state
                if st == KVPoll.SUCCESS:
                    self._admit(r)
                elif st == KVPoll.FAILED:
                    self._fallback(r)
            elif r.phase == "await_first" and now - r.failed_at > FIRST_TOKEN_TTL_S:
                self._end(r, {"error": "no stream opened after the transfer failed",
                              "token_ids": [], "finish_reason": "abort"})
            if rx is not None and rx.state.terminal and (rx.state == KVPoll.SUCCESS
                                                          or rx.released):
                rx.close()
                r.receiver = None
            elif rx is not None:
                active = True  # a release is pending: keep pumping
            if (r.phase == "done" and r.receiver is None and not r.reservation_open
                    and (r.stream_closed or now - (r.finished_at or now) > STREAM_TTL_S)):
                del self.reqs[r.rid]
        return active

    def _admit(self, r: _Decode) -> None:
        res = r.receiver.result
        meta = res.metadata if res is not None else {}
        try:
            if list(meta.get("prompt_token_ids") or ()) != r.prompt:
                raise ValueError("metadata prompt_token_ids differ from the reserved prompt")
            if int(meta.get("position", -1)) != len(r.prompt):
                raise ValueError(f"metadata position {meta.get('position')} != prompt length "
                                 f"{len(r.prompt)}")
            params = SamplingParams.from_dict(dict(meta["sampling"]))
            lp = meta.get("logprob")
            tok = int(meta["token_id"])
            if r.first is not None and r.first[0] != tok:
                log.warning("decode %s: token #1 %d from the router differs from the "
                            "transferred %d", r.rid, r.first[0], tok)
            out = self.engine.admit(r.rid, [tok], params,
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

    def _run(self, r: _Decode, engine_rid: str, out: Any) -> None:
        """The engine request ``engine_rid`` (token #1 fed) produces ``r``'s tokens from now on;
        ``out``: its output when token #1 already finished it."""
        r.phase, r.engine_rid = "running", engine_rid
        self.by_engine[engine_rid] = r
        # text of token #1 (the router has it), so the stream's text starts after it
        if out is not None:
            r.text_len = len(out.outputs[0].text)
            self._emit(r, out)
        else:
            r.text_len = len(self.engine.requests[engine_rid].seqs[0].detok.text)

    def _fallback(self, r: _Decode) -> None:
        """The transfer failed: recompute here, from token #1 once the stream brought it."""
        if r.phase != "transfer":
            return
        err = r.receiver.error if r.receiver is not None else "admit failed"
        r.fallback, r.failed_at, r.phase = True, time.monotonic(), "await_first"
        if r.first is None:
            log.warning("decode %s: transfer failed (%s); recomputing once the stream brings "
                        "token #1", r.rid, err)
            return
        log.warning("decode %s: transfer failed (%s); recomputing the prefill here", r.rid, err)
        self._start_fallback(r)

    def _start_fallback(self, r: _Decode) -> None:
        """Prefill ``prompt + token #1`` here and continue from token #2 (token #1 is the
        prefill worker's, already sent to the client: it is not sampled again)."""
        assert r.first is not None
        self.metrics.fallback()
        fb = r.rid + FALLBACK_SUFFIX
        tok, lp = r.first
        try:
            out = self.engine.add_request(fb, r.prompt, r.params, cache_salt=r.cache_salt,
                                          output_token_ids=[tok], output_logprobs=[lp])
        except ValueError as e:
            self._end(r, {"error": f"fallback prefill failed: {e}", "token_ids": [],
                          "finish_reason": "abort"})
            return
        self._run(r, fb, out)

    def on_outputs(self, outs: list) -> None:
        for out in outs:
            r = self.by_engine.get(out.request_id)
            if r is not None and r.phase == "running":
                self._emit(r, out)

    def _emit(self, r: _Decode, out: Any) -> None:
        c = out.outputs[0]
        if r.fallback and not r.fb_counted:
            r.fb_counted = True
            self.metrics.prefix_query(len(r.prompt), out.num_cached_tokens)
        toks = list(c.token_ids[r.sent:])
        lps = list(c.logprobs[r.sent:])
        tops = list(c.top_logprobs[r.sent:]) if c.top_logprobs is not None else None
        r.sent = max(r.sent, len(c.token_ids))
        text = c.text[r.text_len:] if len(c.text) > r.text_len else ""
        r.text_len = max(r.text_len, len(c.text))
        fin = (c.finish_reason or "abort") if out.finished else None
        if toks or fin:
            self.push(r.events, {
                "token_ids": toks,
                "text": text,
                "logprobs": [{"logprob": finite(lp),
                              "top_logprobs": top_list(tops[k]) if tops is not None else None}
                             for k, lp in enumerate(lps)],
                "finish_reason": fin,
            })
        if out.finished:
            self.by_engine.pop(r.engine_rid, None)
            r.phase, r.finished_at = "done", time.monotonic()

    def _end(self, r: _Decode, event: dict[str, Any]) -> None:
        """Stop a request that has not finished: free what it holds, send a final event."""
        if r.phase == "transfer":
            r.receiver.abort(event.get("error") or "aborted by decode")
        elif r.phase == "running":
            self.engine.abort_request(r.engine_rid)
            self.by_engine.pop(r.engine_rid, None)
        if r.phase != "done":
            r.phase, r.finished_at = "done", time.monotonic()
            self.push(r.events, event)

    def abort(self, rid: str, reason: str) -> bool:
        r = self.reqs.get(rid)
        if r is None:
            return False
        self._end(r, {"token_ids": [], "finish_reason": "abort"})
        self.tick()
        log.info("decode %s: %s", rid, reason)
        return True

    def fail_all(self, err: BaseException) -> None:
        for r in list(self.reqs.values()):
            self._end(r, {"error": f"engine error: {err!r}", "token_ids": [],
                          "finish_reason": "abort"})

    def _open_stream(self, rid: str, token_id: int, logprob: float | None) -> asyncio.Queue | str:
        r = self.reqs.get(rid)
        if r is None:
            return "unknown"
        if r.stream_opened:
            return "taken"
        r.stream_opened = True
        r.first = (token_id, math.nan if logprob is None else float(logprob))
        if r.phase == "await_first":
            self._start_fallback(r)
        return r.events

    def _close_stream(self, rid: str) -> None:
        r = self.reqs.get(rid)
        if r is not None:
            r.stream_closed = True

    def num_waiting(self) -> int:
        return len(self.engine.scheduler.waiting) + sum(
            1 for r in self.reqs.values() if r.phase == "transfer")

    def usage(self) -> dict[str, Any]:
        d = super().usage()
        d["open_tickets"] = self.server.open_tickets()
        d["unreleased_tickets"] = self.server.unreleased()
        d["num_transfers_pending"] = sum(1 for r in self.reqs.values() if r.phase == "transfer")
        d["num_requests_tracked"] = len(self.reqs)
        return d

    def info(self) -> dict[str, Any]:
        d = super().info()
        d["bootstrap_addr"] = self.server.address
        return d

    def describe(self, rid: str | None) -> dict[str, Any]:
        """``GET /internal/requests`` body: tracked requests, their phase and ticket state."""
        out = {}
        for r in self.reqs.values():
            if rid is None or r.rid == rid:
                rx = r.receiver
                out[r.rid] = {"phase": r.phase, "fallback": r.fallback,
                              "ticket_state": rx.state.name if rx is not None else None,
                              "reservation_open": r.reservation_open, "tokens_sent": r.sent}
        return {"requests": out}

    # ------------------------------------------------------------------ HTTP
    def routes(self, app) -> None:
        from fastapi.responses import StreamingResponse

        from k3serve.cache.allocator import CacheFullError

        worker = self

        @app.post("/internal/reserve")
        async def reserve(body: ReserveBody):
            params = parse_sampling(body.sampling)
            if not isinstance(params, SamplingParams):
                return params
            try:
                return await worker.loop.call(worker._reserve, body, params, asyncio.Queue())
            except CacheFullError as e:
                return error(503, "busy", str(e))
            except ValueError as e:
                return error(400, "invalid_request", str(e))

        @app.post("/internal/stream")
        async def stream(body: StreamBody):
            rid = body.request_id
            q = await worker.loop.call(worker._open_stream, rid, body.token_id, body.logprob)
            if q == "unknown":
                return error(404, "unknown_request", f"no request {rid!r} here")
            if q == "taken":
                return error(409, "stream_taken", f"request {rid!r} is already streaming")

            async def gen():
                finished = False
                try:
                    while True:
                        try:
                            ev = await asyncio.wait_for(q.get(), worker.stream_idle_s)
                        except TimeoutError:
                            ev = {"error": f"no token within {worker.stream_idle_s:.0f} s",
                                  "token_ids": [], "finish_reason": "abort"}
                            yield f"data: {json.dumps(ev, separators=(',', ':'))}\n\n"
                            break  # the finally aborts the request
                        yield f"data: {json.dumps(ev, separators=(',', ':'))}\n\n"
                        if ev.get("finish_reason"):
                            finished = True
                            break
                    yield "data: [DONE]\n\n"
                finally:
                    if not finished:
                        worker.loop.submit(worker.abort, rid, "stream closed early")
                    worker.loop.submit(worker._close_stream, rid)

            return StreamingResponse(gen(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})


def main(argv: list[str] | None = None) -> int:
    return serve(DecodeWorker, "decode", argv)


if __name__ == "__main__":
    raise SystemExit(main())
