"""KVSender: the prefill side of one request's cache transfer, a ``poll()`` state machine.

    BOOTSTRAPPING ──pair ok──▶ WAITING_FOR_INPUT ──first write──▶ TRANSFERRING ──done sent──▶ SUCCESS
         │ (retry on unreachable)     │                              │ (retry failed writes)
         └──── refused / fingerprint / timeout / retries exhausted / abort ─────────────▶ FAILED

Each sender registers with its engine's transfer thread (:mod:`kvstore.pump`), which advances
it between the worker's polls: writes are submitted as soon as a layer is ready and its staging
copy landed, completions and replies are seen when they happen, and the completion message
goes out without waiting for the worker loop. The worker's :meth:`KVSender.poll` reads the
state and runs ``on_release`` (always on the polling thread).

Use from the prefill worker::

    sender = KVSender(ticket, bootstrap_addr, src_layout, CacheRef(slot, pages, n),
                      engine=engine, client=client)
    model(..., layer_hook=sender.layer_ready)   # writes of layer L start while L+1 computes
    sender.finish(TransferMetadata(request_id=rid, prompt_token_ids=ids, token_id=t1, ...))
    while not sender.poll().terminal: ...        # non-blocking; call from the worker loop

Failures: a failed write (or pairing that could not reach the server, or a lost completion
message) is retried up to ``max_retries`` times in total, with exponential backoff
(:class:`kvstore.retry.RetryBudget`); then the sender drains (waits until none of its writes
is in flight), reports ``failed`` to the decode side (best effort: dropped only when that peer
does not answer, :meth:`~kvstore.client.BootstrapClient.submit_best_effort`) and becomes FAILED.
The report goes out whenever a pairing request was sent, also when its answer never came back
(a pairing job given up on, a reply lost to a timeout): the decode side may have paired this
sender, and until it hears from it, it holds the reservation until the announced quiesce time. A fingerprint mismatch or a refused
ticket is not retried. Control messages run on the decode peer's own executor of the
:class:`~kvstore.client.BootstrapClient`; a failing sender waits at most ``job_grace_s`` for
one still running (a peer that does not answer) before it gives up on it.
``on_release`` runs once the sender is terminal *and* no write reads its source any more.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from k3serve.messages import PairRequest, PairResponse, StatusMessage, TransferMetadata
from kvstore.client import BootstrapClient
from kvstore.config import P2PHANDSHAKE
from kvstore.control import PeerChannel
from kvstore.descriptors import CacheRef, PoolLayout, check_fingerprints, plan_runs
from kvstore.engine import KVEngine
from kvstore.errors import KVStoreError
from kvstore.pump import Progress
from kvstore.retry import RetryBudget
from kvstore.states import KVPoll
from kvstore.writes import LayerWrites

log = logging.getLogger(__name__)


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
        fault: an injected fault (:mod:`kvstore.faults`): ``"fail"`` once paired,
            ``"hang"`` (paired, then nothing until the deadline) or ``"pair"`` (fails before
            pairing); ``None``: none.
        job_grace_s: once failing, how long to wait for a control message still running
            before giving up on it (seconds).
        pump: the transfer thread that advances this sender (default ``engine.pump``;
            ``None`` on an engine without one: only :meth:`poll` advances it).

    Attributes:
        expired: FAILED because the deadline passed (``timeout_s``).

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
        fault: str | None = None,
        job_grace_s: float = 1.0,
        pump: Any = None,
    ) -> None:
        if notify not in ("te", "http"):
            raise ValueError(f"KVSender.notify: 'te' or 'http', not {notify!r}")
        self.ticket, self.bootstrap_addr = ticket, bootstrap_addr
        self.layout, self.src, self.engine = src_layout, CacheRef.of(src), engine
        self.sender_id = uuid.uuid4().hex
        self.timeout_s, self.max_retries = timeout_s, max_retries
        self._budget = RetryBudget(max_retries, retry_backoff_s)
        self.notify_mode, self.progress = notify, progress
        self._on_release, self._own_client = on_release, client is None
        self.client = client or BootstrapClient()
        self._t0 = time.monotonic()
        self._deadline = self._t0 + timeout_s
        self._state = KVPoll.BOOTSTRAPPING
        self._published = KVPoll.BOOTSTRAPPING  # the state as of the latest poll()
        self.error: KVStoreError | None = None
        self._failing = False
        self._stopping = threading.Event()  # set with _failing: background retries stop
        self._fail_kind, self._released = "failed", False
        self.fault, self.expired = fault, False
        self._fp = src_layout.fingerprint()
        self._writes = LayerWrites(
            src_layout, self.src, engine, self._budget, fail_first_n, f"KVSender {ticket}"
        )
        self._metadata: TransferMetadata | None = None
        self._dst: CacheRef | None = None
        self._dst_layout: PoolLayout | None = None
        self._pair_job: Future | None = None
        self._pair_sent = False  # a pairing request went out: the decode side may have paired us
        self._progress_pending: dict[int, int] = {}  # layer -> bytes, not yet reported
        self._done_due = False  # the completion message is to be sent
        self._job: tuple[str, Future] | None = None
        self._done_queued = False
        self.stats: dict[str, float] = {}  # t_paired, t_first_write, t_written, t_done (s)
        self.job_grace_s = job_grace_s
        self._give_up_jobs_at = float("inf")  # set when failing: stop waiting for jobs
        self._lock = threading.RLock()  # the worker's thread and the transfer thread
        self._pump = pump if pump is not None else getattr(engine, "pump", None)
        self._ch = PeerChannel(self.client, bootstrap_addr, engine, notify, self._kick)
        if fault == "pair":
            self._fail(KVStoreError("injected pairing failure (K3SERVE_KV_FAULT_PAIR_FRACTION)"))
        else:
            self._start_pairing()
        if self._pump is not None:
            self._pump.add(self)

    # ------------------------------------------------------------------ public API
    @property
    def state(self) -> KVPoll:
        """The state as of the latest :meth:`poll` (or :meth:`abort`): the transfer thread
        advances the machine in between, the caller sees it (and ``on_release`` runs) when it
        polls."""
        return self._published

    def layer_ready(self, layer: int, upto_tokens: int | None = None) -> None:
        """Layer ``layer`` (global index) has written its cache for tokens ``[0, upto_tokens)``
        (default: the whole prompt, which also makes its KDA/conv state final). Call it on the
        thread (and CUDA stream) that computed the layer, right after its kernels: with host
        staging the device → mirror copy is enqueued here. The transfer thread submits the
        writes as soon as the sender is paired and the copy landed; cheap; never blocks.

        Raises:
            ValueError: the layer has no cache in the layout; ``upto_tokens`` out of range.
        """
        with self._lock:
            self._writes.mark(layer, upto_tokens)
        self._kick()

    def finish(self, metadata: TransferMetadata) -> None:
        """Every layer is final (layers not yet reported are marked ready now) and here is the
        request's :class:`TransferMetadata` (prompt token ids, token #1 + logprobs, sampling
        with the resolved seed, position). The completion message goes out once all writes
        land.

        Raises:
            RuntimeError: called twice.
            TypeError: ``metadata`` is not a :class:`TransferMetadata`.
        """
        if not isinstance(metadata, TransferMetadata):
            raise TypeError(f"metadata: expected a TransferMetadata, got {type(metadata).__name__}")
        with self._lock:
            if self._metadata is not None:
                raise RuntimeError("KVSender.finish called twice")
            self._metadata = metadata
            self._writes.mark_all()
        self._kick()

    def poll(self) -> KVPoll:
        """Advance the state machine (non-blocking) and return the state. Never raises: see
        :attr:`error` when FAILED."""
        with self._lock:
            self._advance()
            self._published = self._state  # before on_release: it may read the state
            self._maybe_release()
            return self._state

    def advance(self) -> Progress:
        """One step of the state machine for the transfer thread (:mod:`kvstore.pump`):
        BUSY while writes or staging copies are in flight, DONE once terminal. Never runs
        ``on_release``."""
        with self._lock:
            self._advance()
            if self._state.terminal:
                return Progress.DONE
            if self._writes.in_flight() or self._writes.pending_staging():
                return Progress.BUSY
            return Progress.IDLE

    def _advance(self) -> None:
        if not self._state.terminal:
            try:
                self._step(time.monotonic())
            except Exception as e:  # a bug must not hang the request: fail it
                log.exception("KVSender %s: unexpected error", self.ticket)
                self._fail(KVStoreError(f"internal error: {e!r}"))
                self._step(time.monotonic())

    def _kick(self) -> None:
        if self._pump is not None:
            self._pump.kick()

    def abort(self, reason: str = "aborted by prefill") -> None:
        """Stop: no new writes; the decode side is told (``aborted``) once in-flight writes
        drained; FAILED after that (keep polling until terminal)."""
        with self._lock:
            if not self._state.terminal and not self._failing:
                self._fail(KVStoreError(reason), kind="aborted")
        self.poll()

    @property
    def bytes_sent(self) -> int:
        return sum(self._writes.layer_bytes.values())

    @property
    def num_runs(self) -> int:
        """Runs of the latest submission of each part (what the destination got)."""
        return self._writes.num_runs

    @property
    def retries_used(self) -> int:
        """Retries taken (pairing, writes and completion message together)."""
        return self._budget.used

    @property
    def attempts(self) -> int:
        return 1 + self.retries_used

    @property
    def elapsed_s(self) -> float:
        return time.monotonic() - self._t0

    # ------------------------------------------------------------------ pairing
    def _pair_request(self) -> PairRequest:
        return PairRequest(
            ticket=self.ticket,
            sender=self.sender_id,
            fingerprint=self._fp,
            # latest time (from now) any write of ours may still land: our deadline plus the
            # engine's timeout and abandon window for a chunk in flight.
            quiesce_by_s=max(0.0, self._deadline - time.monotonic())
            + 2 * self.engine.config.transfer_timeout_s,
            # P2P mode: host:rpc_port, which the decode side may probe (a metadata server's
            # segment name has no port)
            sender_session=self.engine.session_id
            if self.engine.config.metadata_server == P2PHANDSHAKE else None,
        )

    def _retrying(self, job: Callable[[], Any], what: str) -> Any:
        """``job()`` (on the client pool) with the shared retry budget; an abort stops it."""
        return self._budget.run(
            job,
            stop_early=lambda: self._stopping.is_set() or time.monotonic() > self._deadline,
            sleep=self._stopping.wait,
            what=f"KVSender {self.ticket}: {what}",
        )

    def _start_pairing(self) -> None:
        def pair() -> PairResponse:
            resp = self.client.pair(self.bootstrap_addr, self._pair_request(), self._fp)
            self._ch.open_session(resp.session_id, int(resp.notify_addr))
            return resp

        self._pair_job = self._ch.submit(self._retrying, pair, "pairing")
        self._pair_sent = True

    def _take_peer(self, resp: PairResponse) -> None:
        self._ch.session, self._ch.notify_addr = resp.session_id, int(resp.notify_addr)
        self._dst = CacheRef.from_msg(resp.dst)

    def _on_paired(self, resp: PairResponse, now: float) -> None:
        # peer first: should a check below fail, the failure report still reaches the decode side
        self._take_peer(resp)
        check_fingerprints(self._fp, resp.fingerprint, f"prefill vs decode {self.bootstrap_addr}")
        dst_layout = PoolLayout.from_msg(resp.layout)
        plan_runs(self.layout, self.src, dst_layout, self._dst)  # validates both refs (ValueError)
        self._dst_layout = dst_layout
        self._state = KVPoll.WAITING_FOR_INPUT
        self.stats["t_paired"] = now - self._t0
        if self.fault == "fail":
            self._fail(KVStoreError("injected transfer failure (K3SERVE_KV_FAULT_FAIL_FRACTION)"))

    # ------------------------------------------------------------------ the step
    def _step(self, now: float) -> None:
        if not self._failing and now > self._deadline:
            self.expired = True
            self._fail(
                KVStoreError(f"timed out after {self.timeout_s} s in state {self._state.name}")
            )
        if self._state == KVPoll.BOOTSTRAPPING:
            self._step_pairing(now)
        if self._dst is not None and not self._failing and self.fault != "hang":
            self._submit_ready(now)
        self.engine.progress()
        done_layers, err = self._writes.check(now, self._ch.session, self._failing)
        if err is not None:
            self._fail(err)
        if self.progress and not self._failing:
            for layer in done_layers:  # reported in the next progress message
                self._progress_pending[layer] = self._writes.layer_bytes[layer]
        if (
            not self._failing
            and self._dst is not None
            and self._metadata is not None
            and not self._done_queued
            and self._writes.all_written()
        ):
            self._done_queued = self._done_due = True
            self.stats["t_written"] = now - self._t0
        self._step_outbox(now)
        if self._failing and now > self._give_up_jobs_at:  # their peer does not answer
            self._ch.abandon([self._pair_job, self._job[1] if self._job else None],
                             f"KVSender {self.ticket}", self.job_grace_s)
            self._pair_job = self._job = None
        if (
            self._failing
            and self._writes.settled()
            and self._job is None
            and self._pair_job is None
        ):
            self._report_failure()
            self._state = KVPoll.FAILED

    def _step_pairing(self, now: float) -> None:
        if self._pair_job is None or not self._pair_job.done():
            return
        job, self._pair_job = self._pair_job, None
        if self._failing:  # harvest only: if it paired, the failure report must reach them
            try:
                self._take_peer(job.result())
            except Exception as e:  # noqa: BLE001 - not paired, nothing to report
                log.debug("KVSender %s: pairing ended after failure: %r", self.ticket, e)
            return
        try:
            self._on_paired(job.result(), now)
        except KVStoreError as e:  # refused, unreachable after the retries, fingerprint
            self._fail(e)
        except ValueError as e:
            self._fail(KVStoreError(f"destination does not fit: {e}"))

    def _submit_ready(self, now: float) -> None:
        assert self._dst is not None and self._dst_layout is not None
        if self._writes.submit_ready(self._ch.session, self._dst_layout, self._dst):
            self.stats.setdefault("t_first_write", now - self._t0)
            if self._state == KVPoll.WAITING_FOR_INPUT:
                self._state = KVPoll.TRANSFERRING

    def _status(self, kind: str, layers: dict[int, int] | None = None, **kw: Any) -> StatusMessage:
        """A status message; ``layers`` default: every layer's landed bytes."""
        return StatusMessage(
            ticket=self.ticket,
            sender=self.sender_id,
            kind=kind,
            layers=dict(self._writes.layer_bytes if layers is None else layers),
            runs=self.num_runs,
            attempts=self.attempts,
            elapsed_s=self.elapsed_s,
            **kw,
        )

    def _step_outbox(self, now: float) -> None:
        """One message in flight at a time, in order: progress (every layer completed since
        the previous message, coalesced), then ``done`` (which supersedes pending progress;
        retried in the background with the shared budget)."""
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
                if not self._failing:
                    self._fail(err if isinstance(err, KVStoreError) else KVStoreError(repr(err)))
            elif err is not None:
                log.info("KVSender %s: progress message lost: %s", self.ticket, err)
        if self._failing:
            return
        if self._done_due:
            self._done_due = False
            self._progress_pending.clear()
            meta = self._metadata

            def done() -> None:  # rebuilt per attempt: attempts and elapsed_s stay current
                self._ch.deliver(self._status("done", metadata=meta))

            self._job = ("done", self._ch.submit(self._retrying, done, "completion message"))
        elif self._progress_pending:
            msg = self._status("layer", self._progress_pending)
            self._progress_pending.clear()
            self._job = ("layer", self._ch.submit(self._ch.deliver, msg))

    # ------------------------------------------------------------------ failure / release
    def _fail(self, err: KVStoreError, kind: str = "failed") -> None:
        if self._failing:
            return
        log.info("KVSender %s: %s: %s", self.ticket, kind, err)
        self.error, self._failing, self._fail_kind = err, True, kind
        self._give_up_jobs_at = time.monotonic() + self.job_grace_s
        self._stopping.set()
        self._done_due = False
        self._progress_pending.clear()

    def _report_failure(self) -> None:
        # no pairing request sent: the decode side has nothing to learn from us; one sent but
        # not answered (or its answer lost): it may have paired us, so it hears from us too
        if self._dst is not None or self._pair_sent:
            self._ch.report(self._status(self._fail_kind, error=str(self.error), quiesced=True))

    def _maybe_release(self) -> None:
        if self._released or not self._state.terminal or not self._writes.settled():
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
