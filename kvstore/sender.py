"""KVSender: the prefill side of one request's cache transfer, a ``poll()`` state machine.

    BOOTSTRAPPING ──pair ok──▶ WAITING_FOR_INPUT ──first write──▶ TRANSFERRING ──done sent──▶ SUCCESS
         │ (retry on unreachable)     │                              │ (retry failed writes)
         └──── refused / fingerprint / timeout / retries exhausted / abort ─────────────▶ FAILED

Use from the prefill worker::

    sender = KVSender(ticket, bootstrap_addr, src_layout, CacheRef(slot, pages, n),
                      engine=engine, client=client)
    model(..., layer_hook=sender.layer_ready)   # writes of layer L start while L+1 computes
    sender.finish({"prompt_token_ids": ids, "token": t1, "logprobs": lp,
                   "sampling_params": sp, "position": n})
    while not sender.poll().terminal: ...        # non-blocking; call from the worker loop

Failures: a failed write (or pairing that could not reach the server, or a lost completion
message) is retried up to ``max_retries`` times in total, with exponential backoff; then the
sender drains (waits until none of its writes is in flight), reports ``failed`` to the decode
side over HTTP and becomes FAILED. A fingerprint mismatch or a refused ticket is not retried.
``on_release`` runs once the sender is terminal *and* no write reads its source any more.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from kvstore.bootstrap import BootstrapClient
from kvstore.descriptors import CacheRef, PoolLayout, Run, check_fingerprints, layer_runs, plan_runs
from kvstore.engine import MAX_NOTIFY_BYTES, KVEngine, TransferHandle
from kvstore.errors import BootstrapError, FingerprintMismatch, KVStoreError, TransferError
from kvstore.states import KVPoll, StatusMessage

log = logging.getLogger(__name__)

_BAD_ADDR = 8  # never registered by anyone: a write there fails inside Mooncake (test hook)


@dataclass
class _Part:
    layer: int
    runs: list[Run]
    handle: TransferHandle
    retry_at: float | None = None  # scheduled resubmission time
    finished: bool = False


class KVSender:
    """Send one request's cache (KDA + conv states, MLA latents) and metadata to a decode worker.

    Args:
        ticket: the transfer ticket the decode worker registered.
        bootstrap_addr: the decode worker's bootstrap server, ``host:port``.
        src_layout: this worker's pool layout.
        src: where the request's cache lives here: a :class:`CacheRef` or anything with
            ``slot``, ``pages``, ``num_tokens`` (``k3serve.protocol.CacheHandle``).
        engine: this process's :class:`KVEngine` (pools registered).
        client: shared :class:`BootstrapClient` (default: a private one, closed when done).
        timeout_s: give up (FAILED) if not SUCCESS within this many seconds.
        max_retries: retries in total (pairing, writes, completion message).
        retry_backoff_s: first backoff; doubles per retry, at most 1 s.
        notify: ``"te"`` (TE notification; HTTP when the message exceeds
            :data:`MAX_NOTIFY_BYTES`) or ``"http"`` (POST to the bootstrap server, acknowledged).
        progress: also report each layer as it lands (the receiver's TRANSFERRING state).
        fail_first_n: test hook: the first n write submissions go to an unregistered address
            and fail inside Mooncake.
        on_release: called once (from :meth:`poll`/:meth:`abort`) when the source slot/pages
            are no longer read by any write.

    Raises:
        ValueError: ``notify`` not ``te``/``http``.
    """

    def __init__(
        self,
        ticket: str,
        bootstrap_addr: str,
        src_layout: PoolLayout,
        src: CacheRef | Any,
        *,
        engine: KVEngine,
        client: BootstrapClient | None = None,
        timeout_s: float = 30.0,
        max_retries: int = 2,
        retry_backoff_s: float = 0.05,
        notify: str = "te",
        progress: bool = True,
        fail_first_n: int = 0,
        on_release: Callable[[], None] | None = None,
    ) -> None:
        if notify not in ("te", "http"):
            raise ValueError(f"KVSender.notify: 'te' or 'http', not {notify!r}")
        self.ticket, self.bootstrap_addr = ticket, bootstrap_addr
        self.layout, self.src, self.engine = src_layout, CacheRef.of(src), engine
        self.sender_id = uuid.uuid4().hex
        self.timeout_s, self.max_retries, self.retry_backoff_s = (
            timeout_s,
            max_retries,
            retry_backoff_s,
        )
        self.notify_mode, self.progress = notify, progress
        self._inject_left = int(fail_first_n)
        self._on_release = on_release
        self._own_client = client is None
        self.client = client or BootstrapClient()

        self._t0 = time.monotonic()
        self._deadline = self._t0 + timeout_s
        self._state = KVPoll.BOOTSTRAPPING
        self.error: KVStoreError | None = None
        self._failing = False
        self._fail_kind = "failed"
        self._released = False
        self.retries_used = 0

        self._fp = src_layout.fingerprint()
        self._layers = src_layout.layers
        self._ready: dict[int, int] = {}  # layer -> tokens ready
        self._sent_upto: dict[int, int] = {}  # layer -> tokens submitted
        self._state_sent: set[int] = set()
        self._parts: list[_Part] = []
        self._layer_bytes: dict[int, int] = {}
        self._reported: set[int] = set()
        self._metadata: dict[str, Any] | None = None

        self._peer = ""
        self._notify_addr = 0
        self._dst: CacheRef | None = None
        self._dst_layout: PoolLayout | None = None
        self._pair_job: Future | None = None
        self._pair_retry_at = 0.0
        self._progress_pending: dict[int, int] = {}  # layer -> bytes, not yet reported
        self._done_msg: StatusMessage | None = None
        self._job: tuple[str, Future] | None = None
        self._done_queued = False
        self.stats: dict[str, float] = {}  # t_paired, t_first_write, t_written, t_done (s)
        self._start_pairing()

    # ------------------------------------------------------------------ public API
    @property
    def state(self) -> KVPoll:
        return self._state

    def layer_ready(self, layer: int, upto_tokens: int | None = None) -> None:
        """Layer ``layer`` (global index) has written its cache for tokens ``[0, upto_tokens)``
        (default: the whole prompt, which also makes its KDA/conv state final). Submits the
        writes at once if paired; cheap; never blocks on the network.

        Raises:
            ValueError: the layer has no cache in the layout; ``upto_tokens`` out of range.
        """
        if layer not in self._layers:
            raise ValueError(f"layer {layer} has no cache in this layout")
        n = self.src.num_tokens if upto_tokens is None else int(upto_tokens)
        if not 0 <= n <= self.src.num_tokens:
            raise ValueError(f"upto_tokens {n} outside [0, {self.src.num_tokens}]")
        self._ready[layer] = max(n, self._ready.get(layer, 0))
        if self._dst is not None and not self._failing and not self._state.terminal:
            self._submit_ready(time.monotonic())

    def finish(self, metadata: dict[str, Any]) -> None:
        """Every layer is final (layers not yet reported are marked ready now) and here is the
        request's metadata (JSON-serialisable: prompt token ids, token #1 + logprobs,
        sampling params, position, ...). The completion message goes out once all writes land.

        Raises:
            RuntimeError: called twice.
        """
        if self._metadata is not None:
            raise RuntimeError("KVSender.finish called twice")
        # a TransferMetadata (k3serve.messages) travels as its JSON form
        self._metadata = (metadata.model_dump(mode="json") if hasattr(metadata, "model_dump")
                          else dict(metadata))
        for l in self._layers:
            self._ready[l] = self.src.num_tokens
        if self._dst is not None and not self._failing and not self._state.terminal:
            self._submit_ready(time.monotonic())

    def poll(self) -> KVPoll:
        """Advance the state machine (non-blocking) and return the state. Never raises: see
        :attr:`error` when FAILED."""
        if not self._state.terminal:
            try:
                self._step(time.monotonic())
            except Exception as e:  # a bug must not hang the request: fail it
                log.exception("KVSender %s: unexpected error", self.ticket)
                self._fail(KVStoreError(f"internal error: {e!r}"))
                self._step(time.monotonic())
        self._maybe_release()
        return self._state

    def abort(self, reason: str = "aborted by prefill") -> None:
        """Stop: no new writes; the decode side is told (``aborted``) once in-flight writes
        drained; FAILED after that (keep polling until terminal)."""
        if not self._state.terminal and not self._failing:
            self._fail(KVStoreError(reason), kind="aborted")
        self.poll()

    @property
    def bytes_sent(self) -> int:
        return sum(self._layer_bytes.values())

    @property
    def num_runs(self) -> int:
        """Runs of the latest submission of each part (what the destination got)."""
        return sum(len(p.runs) for p in self._parts)

    @property
    def attempts(self) -> int:
        return 1 + self.retries_used

    @property
    def elapsed_s(self) -> float:
        return time.monotonic() - self._t0

    # ------------------------------------------------------------------ pairing
    def _start_pairing(self) -> None:
        body = {
            "ticket": self.ticket,
            "sender": self.sender_id,
            "fingerprint": self._fp,
            # latest time (from now) any write of ours may still land: our deadline plus the
            # engine's timeout and abandon window for a chunk in flight.
            "quiesce_by_s": max(0.0, self._deadline - time.monotonic())
            + 2 * self.engine.config.transfer_timeout_s,
        }
        self._pair_job = self.client.submit(self.client.pair, self.bootstrap_addr, body, self._fp)

    def _on_paired(self, resp: dict[str, Any], now: float) -> None:
        # peer first: should a check below fail, the failure report still reaches the decode side
        self._peer, self._notify_addr = resp["session_id"], int(resp["notify_addr"])
        self._dst = CacheRef.from_dict(resp["dst"])
        check_fingerprints(
            self._fp, resp.get("fingerprint") or {}, f"prefill vs decode {self.bootstrap_addr}"
        )
        dst_layout = PoolLayout.from_dict(resp["layout"])
        plan_runs(self.layout, self.src, dst_layout, self._dst)  # validates both refs (ValueError)
        self._dst_layout = dst_layout
        self._state = KVPoll.WAITING_FOR_INPUT
        self.stats["t_paired"] = now - self._t0

    # ------------------------------------------------------------------ the step
    def _step(self, now: float) -> None:
        if not self._failing and now > self._deadline:
            self._fail(
                KVStoreError(f"timed out after {self.timeout_s} s in state {self._state.name}")
            )
        if self._state == KVPoll.BOOTSTRAPPING:
            self._step_pairing(now)
        if self._dst is not None and not self._failing:
            self._submit_ready(now)
        self.engine.progress()
        self._check_parts(now)
        if (
            not self._failing
            and self._dst is not None
            and self._metadata is not None
            and not self._done_queued
            and self._all_written()
        ):
            self._done_queued = True
            self.stats["t_written"] = now - self._t0
            self._queue_done()
        self._step_outbox(now)
        if self._failing and self._settled() and self._job is None and self._pair_job is None:
            self._report_failure()
            self._state = KVPoll.FAILED

    def _step_pairing(self, now: float) -> None:
        if self._pair_job is None:
            if now >= self._pair_retry_at and not self._failing:
                self._start_pairing()
            return
        if not self._pair_job.done():
            return
        job, self._pair_job = self._pair_job, None
        if self._failing:  # harvest only: if it paired, the failure report must reach them
            try:
                resp = job.result()
                self._peer, self._notify_addr = resp["session_id"], int(resp["notify_addr"])
                self._dst = CacheRef.from_dict(resp["dst"])
            except Exception as e:  # noqa: BLE001 - not paired, nothing to report
                log.debug("KVSender %s: pairing ended after failure: %r", self.ticket, e)
            return
        try:
            self._on_paired(job.result(), now)
        except FingerprintMismatch as e:
            self._fail(e)
        except BootstrapError as e:
            if e.retryable and self._take_retry():
                self._pair_retry_at = now + self._backoff()
                log.info("KVSender %s: pairing retry %d: %s", self.ticket, self.retries_used, e)
            else:
                self._fail(e)
        except ValueError as e:
            self._fail(KVStoreError(f"destination does not fit: {e}"))

    def _submit_ready(self, now: float) -> None:
        assert self._dst is not None and self._dst_layout is not None
        n_total = self.src.num_tokens
        for layer in list(self._ready):
            upto = self._ready[layer]
            start = self._sent_upto.get(layer, 0)
            with_state = upto == n_total and layer not in self._state_sent
            if upto <= start and not with_state:
                continue
            runs = layer_runs(
                self.layout,
                self.src,
                self._dst_layout,
                self._dst,
                layer,
                start,
                upto,
                with_state=with_state,
            )
            self._sent_upto[layer] = upto
            if with_state:
                self._state_sent.add(layer)
            if runs:
                self._parts.append(_Part(layer, runs, self._submit(runs)))
                self.stats.setdefault("t_first_write", now - self._t0)
                if self._state == KVPoll.WAITING_FOR_INPUT:
                    self._state = KVPoll.TRANSFERRING
            elif with_state:
                self._layer_bytes.setdefault(layer, 0)

    def _submit(self, runs: list[Run]) -> TransferHandle:
        if self._inject_left > 0:
            self._inject_left -= 1
            r = runs[0]
            return self.engine.submit(self._peer, [(r.src, _BAD_ADDR, min(8, r.length))])
        return self.engine.submit(self._peer, runs)

    def _check_parts(self, now: float) -> None:
        for p in self._parts:
            if p.finished:
                continue
            h = p.handle
            if h.error is not None:
                if self._failing:
                    if h.settled:
                        p.finished = True
                    continue
                if p.retry_at is None:
                    if not self._take_retry():
                        self._fail(
                            TransferError(
                                h.error.op,
                                h.error.code,
                                h.peer,
                                f"layer {p.layer}: {h.error.detail}; retries exhausted "
                                f"({self.max_retries})",
                            )
                        )
                        continue
                    p.retry_at = now + self._backoff()
                    log.info(
                        "KVSender %s: layer %d write failed (%s), retry %d",
                        self.ticket,
                        p.layer,
                        h.error,
                        self.retries_used,
                    )
                if now >= p.retry_at and h.settled:
                    p.handle, p.retry_at = self._submit(p.runs), None
                continue
            if h.done:
                p.finished = True
                self._layer_bytes[p.layer] = self._layer_bytes.get(p.layer, 0) + h.total_bytes
                self._maybe_report_layer(p.layer)

    def _layer_complete(self, layer: int) -> bool:
        return (
            self._sent_upto.get(layer, 0) == self.src.num_tokens
            and layer in self._state_sent
            and all(p.finished and p.handle.done for p in self._parts if p.layer == layer)
        )

    def _all_written(self) -> bool:
        return all(self._layer_complete(l) for l in self._layers)

    def _settled(self) -> bool:
        return all(p.handle.settled for p in self._parts)

    def _maybe_report_layer(self, layer: int) -> None:
        if not self.progress or layer in self._reported or not self._layer_complete(layer):
            return
        self._reported.add(layer)
        self._progress_pending[layer] = self._layer_bytes[layer]

    def _queue_done(self) -> None:
        self._done_msg = StatusMessage(
            self.ticket,
            self.sender_id,
            "done",
            layers=dict(self._layer_bytes),
            runs=self.num_runs,
            attempts=self.attempts,
            elapsed_s=self.elapsed_s,
            metadata=self._metadata or {},
        )

    def _deliver_job(self, msg: StatusMessage) -> Callable[[], Any]:
        text = msg.to_json()
        if self.notify_mode == "te" and len(text.encode()) <= MAX_NOTIFY_BYTES:
            return lambda: self.engine.notify(self._peer, self._notify_addr, text)
        return lambda: self.client.post_status(self.bootstrap_addr, msg)

    def _step_outbox(self, now: float) -> None:
        """One message in flight at a time, in order: progress (every layer completed since
        the previous message, coalesced), then ``done`` (which supersedes pending progress)."""
        if self._job is not None:
            kind, fut = self._job
            if not fut.done():
                return
            self._job = None
            err = fut.exception()
            if kind == "done":
                if err is None:
                    self.stats["t_done"] = now - self._t0
                    self._state = KVPoll.SUCCESS
                    return
                retryable = not isinstance(err, BootstrapError) or err.retryable
                if retryable and not self._failing and self._take_retry():
                    self._done_queued = False  # rebuilt and re-sent by the next step
                elif not self._failing:
                    self._fail(err if isinstance(err, KVStoreError) else KVStoreError(repr(err)))
            elif err is not None:
                log.info("KVSender %s: progress message lost: %s", self.ticket, err)
        if self._failing:
            return
        if self._done_msg is not None:
            msg, self._done_msg = self._done_msg, None
            self._progress_pending.clear()
            self._job = ("done", self.client.submit(self._deliver_job(msg)))
        elif self._progress_pending:
            msg = StatusMessage(
                self.ticket, self.sender_id, "layer", layers=dict(self._progress_pending)
            )
            self._progress_pending.clear()
            self._job = ("layer", self.client.submit(self._deliver_job(msg)))

    # ------------------------------------------------------------------ failure / release
    def _take_retry(self) -> bool:
        if self.retries_used >= self.max_retries:
            return False
        self.retries_used += 1
        return True

    def _backoff(self) -> float:
        return min(1.0, self.retry_backoff_s * 2 ** max(0, self.retries_used - 1))

    def _fail(self, err: KVStoreError, kind: str = "failed") -> None:
        if self._failing:
            return
        log.info("KVSender %s: %s: %s", self.ticket, kind, err)
        self.error, self._failing, self._fail_kind = err, True, kind
        self._done_msg = None
        self._progress_pending.clear()

    def _report_failure(self) -> None:
        if self._dst is None:  # never paired: the decode side has nothing to learn from us
            return
        msg = StatusMessage(
            self.ticket,
            self.sender_id,
            self._fail_kind,
            layers=dict(self._layer_bytes),
            runs=self.num_runs,
            attempts=self.attempts,
            elapsed_s=self.elapsed_s,
            error=str(self.error),
            quiesced=True,
        )

        def report() -> None:
            try:
                self.client.post_status(self.bootstrap_addr, msg)
            except BootstrapError:
                if self._peer:  # HTTP gone: try the TE channel
                    self.engine.notify(self._peer, self._notify_addr, msg.to_json())

        self.client.submit(report)

    def _maybe_release(self) -> None:
        if self._released or not self._state.terminal or not self._settled():
            return
        self._released = True
        if self._on_release is not None:
            self._on_release()
        if self._own_client:  # close after the queued jobs (e.g. the failure report) ran
            threading.Thread(target=self.client.close, name="kv-ctl-close", daemon=True).start()

    @property
    def released(self) -> bool:
        return self._released


__all__ = ["KVSender"]
