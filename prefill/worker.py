"""Prefill worker: computes prompts, answers token #1 at once, sends the cache to a decode worker.

``python -m prefill.worker --host H --port P --model k3-tiny --router-url URL --block-size B``

One request (``POST /internal/prefill``; lifecycle steps 4–7 of :mod:`k3serve.protocol`)::

    handler ──loop.call──▶ engine.add_prefill_request(rid, ids, params, on_admit, layer_hook)
    step: admission ──▶ on_admit(handle): KVSender(ticket, bootstrap_addr, layout, handle)
                         (pairing with the decode worker starts now, in the background)
          forward   ──▶ layer_hook(layer, upto) → sender.layer_ready: writes of layer l go
                         out while layer l+1 computes
          sample    ──▶ token #1 (output.handle.first_token)
    tick: paired (or pairing slow) → answer token #1 to the router; sender.finish(metadata)
          sender terminal + released ──▶ engine.release(rid)   (cached blocks stay cached)

A pairing that fails (fingerprint mismatch, ticket refused or closed, decode bootstrap
unreachable) answers an error instead of token #1 and drops the prefill; a transfer that fails
after pairing still answers token #1 — the decode worker recomputes the prefill itself.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictInt

from k3serve.sampling import SamplingParams
from k3serve.protocol import CacheHandle, FirstToken
from k3serve.worker_common import BaseWorker, error, finite, log, parse_sampling, serve, top_list

#: Hold token #1 at most this long (s) while the sender is still pairing, so that a refused
#: pairing is answered as an error rather than as a token nobody can continue.
PAIR_WAIT_S = 2.0
#: Longest a prefill may take from arrival to token #1 (s), queueing included.
PREFILL_TIMEOUT_S = 600.0


class PrefillBody(BaseModel):
    """``POST /internal/prefill`` body."""

    model_config = ConfigDict(extra="ignore")
    request_id: str = Field(min_length=1)
    prompt_token_ids: list[StrictInt] = Field(min_length=1)
    sampling: dict[str, Any] = Field(default_factory=dict)
    ticket: str = Field(min_length=1)
    bootstrap_addr: str = Field(min_length=1)
    snapshot_at: list[StrictInt] = Field(default_factory=list)
    cache_salt: str | None = None
    debug_fail_transfer_n: int = Field(default=0, ge=0)  # test hook (K3SERVE_TEST_HOOKS=1)


@dataclass(eq=False)
class _Prefill:
    """One prefill request's state on the engine thread."""

    rid: str
    ids: list[int]
    params: SamplingParams
    ticket: str
    addr: str
    fut: asyncio.Future
    fail_first_n: int = 0
    sender: Any = None  # KVSender, created at admission
    num_cached: int = 0
    first: FirstToken | None = None
    first_at: float = 0.0
    held: bool = False  # token #1 sampled: the engine holds slot + pages until release
    answered: bool = False
    aborting: bool = False
    abort_reason: tuple[int, str, str] = (409, "aborted", "aborted")
    sender_released: bool = False
    counted: bool = False
    ended: bool = False  # released or aborted in the engine


class PrefillWorker(BaseWorker):
    """The prefill role (see the module docstring)."""

    role = "prefill"

    def __init__(self, args, engine=None) -> None:
        from kvstore import BootstrapClient

        super().__init__(args, engine)
        self.client = BootstrapClient()
        self.reqs: dict[str, _Prefill] = {}

    def close(self) -> None:
        super().close()
        self.client.close()

    # ------------------------------------------------------------------ engine thread
    def _add(self, body: PrefillBody, params: SamplingParams, fut: asyncio.Future) -> None:
        rid = body.request_id
        if rid in self.reqs:
            raise ValueError(f"request_id: {rid!r} is already live")
        r = _Prefill(rid, list(body.prompt_token_ids), params, body.ticket, body.bootstrap_addr,
                     fut, body.debug_fail_transfer_n)
        self.engine.add_prefill_request(
            rid, r.ids, params, cache_salt=body.cache_salt, snapshot_at=body.snapshot_at,
            on_admit=lambda h: self._on_admit(r, h),
            layer_hook=lambda layer, upto: self._layer_hook(r, layer, upto))
        self.reqs[rid] = r

    def _on_admit(self, r: _Prefill, h: CacheHandle) -> None:
        from kvstore import CacheRef, KVSender

        r.num_cached = h.num_cached_tokens
        self.metrics.prefix_query(h.num_tokens, h.num_cached_tokens)
        c = self.kv_config
        try:
            r.sender = KVSender(
                r.ticket, r.addr, self.layout, CacheRef(h.slot, h.pages, h.num_tokens),
                engine=self.kv, client=self.client, timeout_s=c.sender_timeout_s,
                max_retries=c.max_retries, notify=c.notify,
                fail_first_n=c.fail_first_n + r.fail_first_n,
                on_release=lambda: setattr(r, "sender_released", True))
        except Exception as e:  # noqa: BLE001 - answered as an error
            log.warning("prefill %s: cannot start the transfer: %s", r.rid, e)
            self._abort(r, (502, "transfer_setup_failed", f"cannot start the transfer: {e}"))

    def _layer_hook(self, r: _Prefill, layer: int, upto: int) -> None:
        s = r.sender
        if s is not None and not s.state.terminal:
            try:
                s.layer_ready(layer, upto)
            except ValueError as e:
                log.warning("prefill %s: layer_ready(%d, %d): %s", r.rid, layer, upto, e)

    def on_outputs(self, outs: list) -> None:
        for out in outs:
            r = self.reqs.get(out.request_id)
            h = out.handle
            if r is None or r.first is not None or h is None or h.first_token is None:
                continue
            r.first, r.first_at, r.held = h.first_token, time.monotonic(), True
            r.num_cached = h.num_cached_tokens

    def tick(self) -> bool:
        from kvstore import KVPoll

        now = time.monotonic()
        active = False
        for r in list(self.reqs.values()):
            s = r.sender
            if s is not None and not r.sender_released:
                active = True
                st = s.poll()
                if st.terminal and not r.counted:
                    r.counted = True
                    self.metrics.transfer(st == KVPoll.SUCCESS, s.bytes_sent,
                                          s.stats.get("t_done"))
                    if st == KVPoll.FAILED:
                        log.info("prefill %s: transfer failed: %s", r.rid, s.error)
            if not r.answered:
                self._maybe_answer(r, now)
            self._maybe_end(r)
        return active

    def _maybe_answer(self, r: _Prefill, now: float) -> None:
        from kvstore import BootstrapError, FingerprintMismatch, KVPoll

        if r.aborting:
            self._answer(r, error=r.abort_reason)
            return
        s = r.sender
        if s is not None and s.state == KVPoll.FAILED and "t_paired" not in s.stats:
            e = s.error
            if isinstance(e, FingerprintMismatch):
                code = (409, "fingerprint_mismatch")
            elif isinstance(e, BootstrapError) and 400 <= e.status < 500:
                code = (409, "ticket_refused")
            else:
                code = (502, "transfer_pairing_failed")
            self._abort(r, (*code, (f"prefill {self.worker_id} could not pair with the decode "
                                   f"worker at {r.addr}: {e}")))
            self._answer(r, error=r.abort_reason)
            return
        if r.first is None:
            return
        if s is not None and s.state == KVPoll.BOOTSTRAPPING and now < r.first_at + PAIR_WAIT_S:
            return
        ft = r.first
        if s is not None and not s.state.terminal:
            s.finish({
                "request_id": r.rid,
                "prompt_token_ids": r.ids,
                "token_id": ft.token_id,
                "logprob": finite(ft.logprob),
                "top_logprobs": top_list(ft.top_logprobs),
                "sampling": r.params.with_seed(ft.seed).to_dict(),
                "position": ft.position,
                "num_cached_tokens": r.num_cached,
            })
        self._answer(r, {
            "request_id": r.rid,
            "token_id": ft.token_id,
            "logprob": finite(ft.logprob),
            "top_logprobs": top_list(ft.top_logprobs),
            "num_cached_tokens": r.num_cached,
            "cached_source": "local",
            "text": self._text(ft.token_id),
            "position": ft.position,
            "seed": ft.seed,
        })

    def _text(self, tok: int) -> str:
        t = self.engine.tokenizer
        if t is None:
            return ""
        try:
            return t.decode([tok], skip_special_tokens=False)
        except Exception:  # noqa: BLE001 - text is a courtesy; the router detokenizes
            return ""

    def _answer(self, r: _Prefill, body: dict | None = None,
                error: tuple[int, str, str] | None = None) -> None:
        r.answered = True
        self.resolve(r.fut, ("ok", body) if error is None else ("error", error))

    def _abort(self, r: _Prefill, reason: tuple[int, str, str]) -> None:
        if r.aborting:
            return
        r.aborting, r.abort_reason = True, reason
        s = r.sender
        if s is not None and not s.state.terminal:
            s.abort(reason[2])

    def _maybe_end(self, r: _Prefill) -> None:
        """Give the slot and pages back once no write reads them any more."""
        if not r.ended and (r.sender is None or r.sender_released):
            if r.aborting:
                self.engine.abort_request(r.rid)
                r.ended = True
            elif r.held and (r.sender is None or r.sender.state.terminal) and r.answered:
                self.engine.release(r.rid)
                r.ended = True
        if r.ended and r.answered:
            self.reqs.pop(r.rid, None)

    def abort(self, rid: str, reason: str) -> bool:
        r = self.reqs.get(rid)
        if r is None:
            return self.engine.abort_request(rid)
        self._abort(r, (409, "aborted", reason))
        self.tick()
        return True

    def fail_all(self, err: BaseException) -> None:
        for r in list(self.reqs.values()):
            self._abort(r, (500, "engine_error", f"engine error: {err!r}"))
        self.tick()

    def info(self) -> dict[str, Any]:
        d = super().info()
        d["num_transfers_pending"] = sum(1 for r in self.reqs.values() if r.sender is not None
                                         and not r.sender_released)
        return d

    def describe(self, rid: str | None) -> dict[str, Any]:
        """``GET /internal/requests`` body: tracked requests and their transfer state."""
        out = {}
        for r in self.reqs.values():
            if rid is None or r.rid == rid:
                s = r.sender
                out[r.rid] = {"sender_state": s.state.name if s is not None else None,
                              "held": r.held, "answered": r.answered, "aborting": r.aborting,
                              "num_cached_tokens": r.num_cached}
        return {"requests": out}

    # ------------------------------------------------------------------ HTTP
    def routes(self, app) -> None:
        worker = self

        @app.post("/internal/prefill")
        async def prefill(body: PrefillBody):
            params = parse_sampling(body.sampling)
            if not isinstance(params, SamplingParams):
                return params
            if body.debug_fail_transfer_n and not worker.args.test_hooks:
                return error(400, "invalid_request", "debug_fail_transfer_n needs "
                                                     "K3SERVE_TEST_HOOKS=1")
            fut = asyncio.get_running_loop().create_future()
            try:
                await worker.loop.call(worker._add, body, params, fut)
            except ValueError as e:
                return error(400, "invalid_request", str(e))
            try:
                kind, res = await asyncio.wait_for(asyncio.shield(fut), PREFILL_TIMEOUT_S)
            except TimeoutError:
                await worker.loop.call(worker.abort, body.request_id, "prefill timed out")
                return error(504, "timeout", f"no token #1 within {PREFILL_TIMEOUT_S:.0f} s")
            except asyncio.CancelledError:  # the caller went away
                worker.loop.submit(worker.abort, body.request_id, "caller disconnected")
                raise
            if kind == "error":
                return error(*res)
            return res


def main(argv: list[str] | None = None) -> int:
    return serve(PrefillWorker, "prefill", argv)


if __name__ == "__main__":
    raise SystemExit(main())
