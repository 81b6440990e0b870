"""Prefill worker: computes prompts, answers token #1 at once, sends the cache to a decode worker.

``python -m prefill.worker --host H --port P --model k3-tiny --router-url URL --block-size B``

Lifecycle steps 4–7 of :mod:`k3serve.protocol` (the numbered walkthrough); here, one
``POST /internal/prefill`` (:class:`~k3serve.messages.PrefillRequest`) goes through the
phases of :class:`PrefillPhase`::

    WAITING    disagg.add_prefill_request(rid, ids, params, on_admit, layer_hook)
    COMPUTING  admission: on_admit(handle) → KVSender(ticket, bootstrap_addr, layout, handle)
               (pairing with the decode worker starts now); forward: layer_hook(layer, upto)
               → sender.layer_ready — writes of layer l go out while layer l+1 computes
    SAMPLED    token #1 sampled (the engine holds slot + pages); held while the sender is still
               pairing (at most PAIR_WAIT_S), so a refused pairing is answered as an error
    ANSWERED   sender.finish(TransferMetadata); PrefillResponse (token #1) to the router
    ENDED      sender terminal and released → disagg.release(rid) (cached blocks stay cached)
    ABORTING   from any phase before ENDED: the error is answered (unless token #1 was), the
               sender aborted; once it no longer reads the pages → engine.abort_request → ENDED

A pairing that fails (fingerprint mismatch, ticket refused or closed, decode bootstrap
unreachable) answers an error instead of token #1; a transfer that fails after pairing still
answers token #1 — the decode worker recomputes the prefill itself.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from fastapi import Request

from k3serve import tracing
from k3serve.messages import (
    ANSWER_EVENTS_LIMIT,
    PrefillRequest,
    PrefillResponse,
    RequestsDebug,
    RequestState,
    TransferMetadata,
    WorkerUsage,
    finite,
    top_pairs,
)
from k3serve.protocol import CacheHandle
from k3serve.sampling import SamplingParams
from kvstore import (
    BootstrapClient,
    BootstrapError,
    CacheRef,
    FingerprintMismatch,
    KVPoll,
    KVSender,
)
from kvstore.faults import FaultPlan
from prefill.state import PrefillPhase, PrefillState
from worker.base import BaseWorker, Failure, sampling_params
from worker.http import errors
from worker.serve import serve

log = logging.getLogger("k3serve.worker")

#: Hold token #1 at most this long (s) while the sender is still pairing, so that a refused
#: pairing is answered as an error rather than as a token nobody can continue.
PAIR_WAIT_S = 2.0
#: Longest a prefill may take from arrival to token #1 (s), queueing included.
PREFILL_TIMEOUT_S = 600.0


class PrefillWorker(BaseWorker):
    """The prefill role (see the module docstring)."""

    role = "prefill"

    def __init__(self, config, engine=None) -> None:
        super().__init__(config, engine)
        # An admitted prompt's sender runs under a deadline from admission on: admit a prompt
        # only while little prefill work runs ahead of it (FCFS), so its own prefill ends in
        # about (cap + its tokens) of compute however long the queue is (the queue waits
        # unadmitted, with no sender). Uncapped, every queued prompt is admitted and they all
        # share the steps: under load each one's prefill outlasts the sender's deadline.
        cap = config.max_prefill_backlog
        cap = self.engine.scheduler.max_num_batched_tokens if cap is None else cap
        self.engine.scheduler.max_prefill_backlog = cap if cap > 0 else None
        self.client = BootstrapClient(cluster_token=config.cluster_token)
        self.reqs: dict[str, PrefillState] = {}
        self.prefills, self.prefill_tokens = 0, 0  # reported with the cache events
        self.cached_source: dict[str, str] = {}  # rid → "local" | "store", until answered
        # tracing on: rid → its ``prefill`` span (until answered) / ``kv.transfer`` span
        # (until the sender is released); empty when off
        self.spans: dict[str, Any] = {}
        self.transfer_spans: dict[str, Any] = {}
        c = self.kv_config
        self.faults = FaultPlan(c.fault_fail_fraction, c.fault_hang_fraction,
                                c.fault_pair_fraction)
        if self.faults.active:
            log.warning("prefill %s: injecting transfer faults (fail %.3g, hang %.3g, pair "
                        "%.3g)", self.worker_id, c.fault_fail_fraction, c.fault_hang_fraction,
                        c.fault_pair_fraction)

    def close(self) -> None:
        super().close()
        self.client.close()

    # ------------------------------------------------------------------ engine thread
    def _abort(self, r: PrefillState, why: Failure) -> None:
        """End ``r`` early: answer ``why`` unless token #1 went out, stop the sender."""
        if r.phase in (PrefillPhase.ABORTING, PrefillPhase.ENDED):
            return
        answered = r.answered
        r.to(PrefillPhase.ABORTING)
        if not answered:
            self.resolve(r.fut, exc=why)
        if r.sender is not None and not r.sender.state.terminal:
            r.sender.abort(why.message)

    # ------------------------------------------------------------------ engine thread
    def admit_prefill(self, body: PrefillRequest, params: SamplingParams, fut: asyncio.Future) -> None:
        rid = body.request_id
        if rid in self.reqs:
            raise ValueError(f"request_id: {rid!r} is already live")
        r = PrefillState(rid, list(body.prompt_token_ids), params, body.ticket, body.bootstrap_addr,
                     fut, body.debug_fail_transfer_n, events_after=body.events_after)
        self.disagg.add_prefill_request(
            rid, r.ids, params, cache_salt=body.cache_salt, snapshot_at=body.snapshot_at,
            on_admit=lambda h: self._on_admit(r, h),
            layer_hook=lambda layer, upto: self._layer_hook(r, layer, upto))
        self.reqs[rid] = r

    def _on_admit(self, r: PrefillState, h: CacheHandle) -> None:
        if r.phase is not PrefillPhase.WAITING:
            return
        r.to(PrefillPhase.COMPUTING)
        r.num_cached = h.num_cached_tokens
        self.prefills += 1
        self.prefill_tokens += len(r.ids) - h.num_cached_tokens
        self._count_hit(r, h)
        c = self.kv_config
        fault = self.faults.next() if self.faults.active else None
        if fault is not None:
            self.metrics.fault(fault)
        try:
            r.sender_at = time.monotonic()
            r.sender = KVSender(
                r.ticket, r.addr, self.layout, CacheRef(h.slot, h.pages, h.num_tokens),
                engine=self.kv, client=self.client, timeout_s=c.sender_timeout_s,
                max_retries=c.max_retries, notify=c.notify,
                fail_first_n=c.fail_first_n + r.fail_first_n,
                on_release=lambda: self._count_transfer(r), fault=fault)
            if self.spans:
                self.trace_transfer(r)
        except Exception as e:  # noqa: BLE001 - answered as an error
            log.warning("prefill %s: cannot start the transfer: %s", r.rid, e)
            self._abort(r, Failure(502, "transfer_setup_failed",
                                   f"cannot start the transfer: {e}"))

    def trace_transfer(self, r: PrefillState) -> None:
        """Start ``r``'s ``kv.transfer`` span under its ``prefill`` span (when traced), with
        the cached tokens now known."""
        parent = self.spans.get(r.rid)
        if parent is None:
            return
        tracing.set_attributes(parent, {"k3serve.cached_tokens": r.num_cached})
        self.transfer_spans[r.rid] = tracing.start_span("kv.transfer", parent, {
            "k3serve.worker_id": self.worker_id, "k3serve.peer": r.addr})

    def _count_hit(self, r: PrefillState, h: CacheHandle) -> None:
        """Count the prefix query, splitting the hit by source (local pools | shared store)."""
        src, local, store = "local", h.num_cached_tokens, 0
        if self.store is not None:
            src, local, store = self.store.source(r.rid, h.num_cached_tokens)
        self.cached_source[r.rid] = src
        self.metrics.prefix_query(h.num_tokens, local)
        if store:
            self.metrics.prefix_query(0, store, source="store")

    def _layer_hook(self, r: PrefillState, layer: int, upto: int) -> None:
        s = r.sender
        if s is not None and not s.state.terminal:
            try:
                s.layer_ready(layer, upto)
            except ValueError as e:
                log.warning("prefill %s: layer_ready(%d, %d): %s", r.rid, layer, upto, e)

    def _count_transfer(self, r: PrefillState) -> None:
        """The sender is terminal and released (called once, by the sender)."""
        s = r.sender
        if s is None:
            return
        if self.transfer_spans:
            tracing.end_span(self.transfer_spans.pop(r.rid, None), {
                "k3serve.bytes": s.bytes_sent, "k3serve.tokens": s.src.num_tokens,
                "k3serve.transfer_state": s.state.name},
                error=None if s.state == KVPoll.SUCCESS else str(s.error or s.state.name))
        self.metrics.transfer(s.state == KVPoll.SUCCESS, s.bytes_sent, s.stats.get("t_done"),
                              r.write_tail_s())
        if s.expired:
            self.metrics.expiry()
        if s.state == KVPoll.FAILED:
            log.info("prefill %s: transfer failed: %s", r.rid, s.error)
        log.info("prefill %s: transfer %s in %.2f s (%d tokens, %d runs, %d B): %s", r.rid,
                 s.state.name, s.elapsed_s, s.src.num_tokens, s.num_runs, s.bytes_sent,
                 {k: round(v, 3) for k, v in s.stats.items()})

    def on_outputs(self, outs: list) -> None:
        for out in outs:
            r = self.reqs.get(out.request_id)
            h = out.handle
            if (r is None or r.phase not in (PrefillPhase.WAITING, PrefillPhase.COMPUTING)
                    or h is None or h.first_token is None):
                continue
            r.to(PrefillPhase.SAMPLED)
            r.first, r.first_at = h.first_token, time.monotonic()
            c = out.outputs[0]  # held after token #1: its text and (stop) finish so far
            r.first_text, r.first_finish = c.text, c.finish_reason
            r.num_cached = h.num_cached_tokens

    def tick(self) -> bool:
        now = time.monotonic()
        active = False
        for r in list(self.reqs.values()):
            if not r.pages_free:
                active = True
                r.sender.poll()  # its on_release counts the outcome
            if r.phase in (PrefillPhase.COMPUTING, PrefillPhase.SAMPLED):
                self._maybe_answer(r, now)
            self._maybe_end(r)
        return active

    def _maybe_answer(self, r: PrefillState, now: float) -> None:
        s = r.sender
        if s is not None and s.state == KVPoll.FAILED and "t_paired" not in s.stats:
            e = s.error
            if isinstance(e, FingerprintMismatch):
                status, code = 409, "fingerprint_mismatch"
            elif isinstance(e, BootstrapError) and 400 <= e.status < 500:
                status, code = 409, "ticket_refused"
            else:
                status, code = 502, "transfer_pairing_failed"
            self._abort(r, Failure(status, code, f"prefill {self.worker_id} could not pair "
                                                 f"with the decode worker at {r.addr}: {e}"))
            return
        if r.phase is not PrefillPhase.SAMPLED or r.first is None:
            return
        if s is not None and s.state == KVPoll.BOOTSTRAPPING and now < r.first_at + PAIR_WAIT_S:
            return
        ft = r.first
        logprob, top = finite(ft.logprob), top_pairs(ft.top_logprobs)
        if s is not None and not s.state.terminal:
            s.finish(TransferMetadata(
                request_id=r.rid, prompt_token_ids=r.ids, token_id=ft.token_id,
                logprob=logprob, top_logprobs=top,
                sampling=r.params.with_seed(ft.seed), position=ft.position,
                num_cached_tokens=r.num_cached))
        r.to(PrefillPhase.ANSWERED)
        self.resolve(r.fut, PrefillResponse(
            request_id=r.rid, token_id=ft.token_id, logprob=logprob, top_logprobs=top,
            num_cached_tokens=r.num_cached, cached_source=self.cached_source.pop(r.rid, "local"),
            text=r.first_text, finish_reason=r.first_finish,
            position=ft.position, seed=ft.seed,
            # the prompt's stored blocks (and the rest since the router's cursor): indexed by
            # the router from the answer, without a pull
            cache_events=None if r.events_after is None
            else self.cache_events(r.events_after, ANSWER_EVENTS_LIMIT)))

    def _maybe_end(self, r: PrefillState) -> None:
        """Give the slot and pages back once no write reads them any more."""
        if r.pages_free:
            if r.phase is PrefillPhase.ABORTING:
                self.engine.abort_request(r.rid)
                r.to(PrefillPhase.ENDED)
            elif r.phase is PrefillPhase.ANSWERED and (r.sender is None or r.sender.state.terminal):
                self.disagg.release(r.rid)
                r.to(PrefillPhase.ENDED)
        if r.phase is PrefillPhase.ENDED:
            self.reqs.pop(r.rid, None)
            self.cached_source.pop(r.rid, None)
            if self.store is not None:
                self.store.local_before.pop(r.rid, None)

    def abort(self, rid: str, reason: str) -> bool:
        r = self.reqs.get(rid)
        if r is None:
            return self.engine.abort_request(rid)
        self._abort(r, Failure(409, "aborted", reason))
        self.tick()
        return True

    def fail_all(self, err: BaseException) -> None:
        for r in list(self.reqs.values()):
            self._abort(r, Failure(500, "engine_error", f"engine error: {err!r}"))
        self.tick()

    def usage(self) -> WorkerUsage:
        pending = sum(1 for r in self.reqs.values() if not r.pages_free)
        return super().usage().model_copy(update={"num_transfers_pending": pending})

    def describe(self, rid: str | None) -> RequestsDebug:
        """``GET /internal/requests`` body: tracked requests and their transfer state."""
        out = {}
        for r in self.reqs.values():
            if rid is None or r.rid == rid:
                s = r.sender
                out[r.rid] = RequestState(
                    phase=r.phase.value, sender_state=s.state.name if s is not None else None,
                    held=r.phase in (PrefillPhase.SAMPLED, PrefillPhase.ANSWERED),
                    answered=r.answered,
                    aborting=r.phase is PrefillPhase.ABORTING, num_cached_tokens=r.num_cached)
        return RequestsDebug(requests=out)

    # ------------------------------------------------------------------ HTTP
    def routes(self, app: Any) -> None:
        worker = self

        @app.post("/internal/prefill", response_model=PrefillResponse,
                  responses=errors(400, 403, 409, 502, 504))
        async def prefill(body: PrefillRequest, request: Request) -> PrefillResponse:
            """Token #1 of ``body``; traced (a ``prefill`` span under the caller's
            ``traceparent``) when tracing is on."""
            if not tracing.enabled():
                return await run(body)
            rid = body.request_id
            span = tracing.start_span("prefill", tracing.extract(request.headers), {
                "k3serve.request_id": rid, "k3serve.worker_id": worker.worker_id,
                "k3serve.prompt_tokens": len(body.prompt_token_ids)})
            worker.spans[rid] = span
            try:
                out = await run(body)
            except BaseException as e:
                tracing.end_span(span, error=str(e) or type(e).__name__)
                raise
            finally:
                worker.spans.pop(rid, None)
            tracing.end_span(span, {"k3serve.cached_tokens": out.num_cached_tokens,
                                    "k3serve.cached_source": out.cached_source})
            return out

        async def run(body: PrefillRequest) -> PrefillResponse:
            params = sampling_params(body.sampling)
            if body.debug_fail_transfer_n and not worker.config.test_hooks:
                raise Failure(400, "invalid_request",
                              "debug_fail_transfer_n needs K3SERVE_TEST_HOOKS=1")
            fut = asyncio.get_running_loop().create_future()
            if worker.store is not None:  # a deeper prefix from the shared store, if any
                await worker.store.fetch(body.request_id, list(body.prompt_token_ids),
                                         body.cache_salt)
            try:
                await worker.loop.call(worker.admit_prefill, body, params, fut)
            except ValueError as e:
                raise Failure(400, "invalid_request", str(e)) from None
            try:
                return await asyncio.wait_for(asyncio.shield(fut), PREFILL_TIMEOUT_S)
            except TimeoutError:
                await worker.loop.call(worker.abort, body.request_id, "prefill timed out")
                raise Failure(504, "timeout",
                              f"no token #1 within {PREFILL_TIMEOUT_S:.0f} s") from None
            except asyncio.CancelledError:  # the caller went away
                worker.loop.submit(worker.abort, body.request_id, "caller disconnected")
                raise


def main(argv: list[str] | None = None) -> int:
    return serve(PrefillWorker, "prefill", argv)


if __name__ == "__main__":
    raise SystemExit(main())
