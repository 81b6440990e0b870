"""The choice pipeline: place → reserve on D → prefill on P (token #1) → stream from D.

Steps 2–10 of the request lifecycle, router side (:mod:`k3serve.protocol` numbers them).
:class:`Router` owns the worker pool, the metrics and the per-choice driver; the load counters
of the chosen workers are held by :meth:`router.workers.Worker.load` for exactly as long as
the request occupies them, and retries (a failed worker, a busy decode worker) are
:mod:`tenacity` policies.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import secrets
import time
from collections.abc import Sequence
from contextlib import ExitStack
from typing import TYPE_CHECKING

import httpx
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception,
    stop_after_attempt,
    stop_after_delay,
    wait_fixed,
)

from k3serve import tracing
from k3serve.messages import (
    GenerateRequest,
    PrefillRequest,
    ReserveRequest,
    ResumeRequest,
)
from router import trace
from router.admission import Admission, decode_capacity
from router.choose import choose
from router.config import RouterConfig, model_context_len
from router.memory import MemoryTrimmer
from router.metrics import RouterMetrics
from router.placement import NoWorkerAvailable, Placement
from router.pool import WorkerPool
from router.preprocess import Preprocessor, PromptJob
from router.retries import (
    BUSY_RETRY_S,
    FIRST_TOKEN_ATTEMPTS,
    RESUME_WAIT_S,
    BusyGate,
    busy,
    failover,
    first_then_retrying,
    no_room,
    refused,
    wait_for_live,
)
from router.schemas import ChatCompletionRequest, CompletionRequest
from router.stream import END, Placed, stream_choice
from router.workers import Worker, WorkerError

if TYPE_CHECKING:
    from k3serve.sampling import SamplingParams

log = logging.getLogger("k3serve.router")


#: the longest prompt + output, tokens, when neither the flags, the workers nor the model's
#: config give one
UNKNOWN_MODEL_LEN = 1 << 20

class Router:
    """Request pipeline, worker pool and metrics of one router process.

    Args:
        config: The router's configuration.
        transport: httpx transport for registration reads and cache-event polls (the request
            path always goes over the network: ``WorkerClient.session``).
    """

    def __init__(self, config: RouterConfig,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        from k3serve.tokenizer import get_tokenizer

        self.config = config
        self.metrics = RouterMetrics(multiprocess_dir=config.metrics_dir)
        self.pool = WorkerPool.of(config, transport,
                                  lambda w: self.metrics.add_worker(w.name, w.role))
        self.registry, self.client = self.pool.registry, self.pool.client
        self.metrics.add_spec_totals(lambda: self.registry.workers.values())
        self.admission = Admission(
            lambda: decode_capacity(self.registry.live("decode")), config.max_queued,
            config.retry_after_s, max_tokens=config.max_admitted_tokens,
            configured=lambda: decode_capacity(
                w for w in self.registry.workers.values() if w.role == "decode"))
        self.memory = MemoryTrimmer()  # the heap freed by large bodies goes back to the kernel
        self.tokenizer = get_tokenizer(config.tokenizer or config.model)
        self.pre = Preprocessor(self.tokenizer, config.add_bos)
        # ``seq`` drives only round_robin / random now (cost ties break by the prompt's content,
        # router.placement.tie_breaks); replicas start those rotations apart
        self._seq = itertools.count(0 if config.replica is None else secrets.randbits(16))
        self._background: set[asyncio.Task] = set()
        self._pd = False  # a prefill worker has registered: the stack is PD from then on
        self._busy_gate = BusyGate()

    async def close(self) -> None:
        for t in list(self._background):
            with contextlib.suppress(Exception):
                await asyncio.wait_for(t, 5.0)
        await self.pool.close()

    def _spawn(self, coro) -> None:
        t = asyncio.create_task(coro)
        self._background.add(t)
        t.add_done_callback(self._background.discard)

    def _abort(self, w: Worker, sub: str) -> None:
        """Abort ``sub`` on ``w`` in the background (best effort)."""
        self._spawn(self.client.abort(w, sub))

    @property
    def max_model_len(self) -> int:
        """Longest prompt + output, tokens: config, else the smallest an available (healthy,
        breaker closed) worker reports, else the model config's ``max_position_embeddings``."""
        reported = [w.info.max_model_len for w in self.registry.workers.values()
                    if w.info.max_model_len and w.available]
        return (self.config.max_model_len or (min(reported) if reported else 0)
                or model_context_len(self.config.model) or UNKNOWN_MODEL_LEN)

    # ------------------------------------------------------------------ placement
    def place(self, ids: list[int], cache_salt: str | None, max_new: int,
              exclude: frozenset[str] = frozenset()) -> tuple[Placement, Worker, Worker]:
        """Score the healthy workers and choose (prefill, decode) for one choice.

        Raises:
            NoWorkerAvailable: no healthy prefill or decode worker.
        """
        # ``exclude``: workers this choice failed on; skipped only while another of the role
        # is live (the one that failed first may be the only one left once another hung)
        live_p, live_d = self.registry.live("prefill"), self.registry.live("decode")
        prefill = [w for w in live_p if w.url not in exclude] or live_p
        decode = [w for w in live_d if w.url not in exclude] or live_d
        layout = self.registry.layout
        if not prefill or not decode or layout is None:
            raise NoWorkerAvailable(
                f"no healthy {'prefill' if not prefill else 'decode'} worker")
        p = self._choose(layout, prefill, decode, ids, cache_salt, max_new)
        workers = self.registry.workers
        return p, workers[p.prefill], workers[p.decode]

    def _choose(self, layout: tuple[str, int], prefill: list[Worker], decode: list[Worker],
                ids: list[int], cache_salt: str | None, max_new: int) -> Placement:
        """:func:`router.choose.choose` with this router's index, policy and sequence."""
        cfg = self.config
        return choose(self.pool.index, layout, prefill, decode, ids, cache_salt, max_new,
                      next(self._seq), cfg.policy, cfg.placement, cfg.prefill_rate,
                      self.pool.recent)

    # ------------------------------------------------------------------ token #1
    async def _reserve(self, job: PromptJob, spec: SamplingParams, cache_salt: str | None,
                       sub: str, exclude: frozenset[str]
                       ) -> tuple[Placement, Worker, Worker, str, str, ExitStack]:
        """Place the choice and reserve on its decode worker D, waiting (up to
        ``busy_wait_s``) while every D is busy. The returned stack holds D's load."""
        need = len(job.token_ids) + job.max_new
        deadline = time.monotonic() + self.config.busy_wait_s

        async def attempt(_: int) -> tuple[Placement, Worker, Worker, str, str, ExitStack]:
            span = trace.child("router.placement")
            p, P, D = self.place(job.token_ids, cache_salt, job.max_new, exclude)
            trace.placed(span, p, P, D)
            with ExitStack() as hold:
                hold.enter_context(D.load(running=1, reserved_tokens=need))
                try:
                    res = await self.client.reserve(D, ReserveRequest(
                        request_id=sub, prompt_token_ids=job.token_ids, sampling=spec,
                        cache_salt=cache_salt))
                except asyncio.CancelledError:
                    self._abort(D, sub)
                    raise
                return p, P, D, res.ticket, res.bootstrap_addr, hold.pop_all()

        def retrying() -> AsyncRetrying:  # the wait for room, from the first busy answer
            return AsyncRetrying(
                retry=retry_if_exception(busy),
                stop=stop_after_delay(max(0.0, deadline - time.monotonic())),
                wait=wait_fixed(BUSY_RETRY_S), retry_error_callback=no_room(self.config.busy_wait_s),
                sleep=lambda s: self._busy_gate.turn(s, deadline))

        return await first_then_retrying(attempt, busy, retrying)

    async def _first_token(self, job: PromptJob, spec: SamplingParams, cache_salt: str | None,
                           sub: str, exclude: frozenset[str]) -> Placed:
        """Reserve on D, then prefill on P: token #1. On failure D's reservation is aborted."""
        p, P, D, ticket, addr, hold = await self._reserve(job, spec, cache_salt, sub, exclude)
        with hold:
            uncached = len(job.token_ids) - p.predicted_cached_tokens
            try:
                with P.load(queued_tokens=uncached), \
                        self.metrics.waiting.labels(P.name).track_inprogress():
                    first = await self.client.prefill(P, PrefillRequest(
                        request_id=sub, prompt_token_ids=job.token_ids, sampling=spec,
                        ticket=ticket, bootstrap_addr=addr, snapshot_at=list(p.snapshot_at),
                        cache_salt=cache_salt,
                        events_after=self.pool.index_sync.events_cursor(P)))
                if not 0 <= first.num_cached_tokens <= len(job.token_ids):
                    raise WorkerError(P.url, f"prefill: malformed answer: num_cached_tokens "
                                             f"{first.num_cached_tokens}")
                # its new blocks into the index before the next request (carried by the
                # answer, else pulled)
                self.pool.index_sync.answered(P, first.cache_events)
            except BaseException as e:
                self._abort(D, sub)
                if isinstance(e, asyncio.CancelledError):
                    self._abort(P, sub)
                raise
            return Placed(sub, p, P, D, first, hold.pop_all())

    # ------------------------------------------------------------------ monolithic stacks
    @property
    def monolithic(self) -> bool:
        """True when the stack has no prefill worker at all (``k3serve serve --monolithic N``):
        every choice then runs on one worker that prefills and decodes it
        (:meth:`_first_token_monolithic`). A stack where a prefill worker ever registered
        stays PD, also with every prefill worker down or deregistered."""
        ws = self.registry.workers.values()
        self._pd = self._pd or any(w.role == "prefill" for w in ws)
        return bool(ws) and not self._pd

    async def _first_token_monolithic(self, job: PromptJob, spec: SamplingParams,
                                      cache_salt: str | None, sub: str,
                                      exclude: frozenset[str]) -> Placed:
        """Place the choice on one worker W (cache-aware over the workers' prefixes and queued
        prefill), ``POST /internal/generate`` there: token #1. W's decode load is held in the
        returned ``hold`` for the stream, as a decode worker's is in the PD path."""
        live_d = self.registry.live("decode")
        live = [w for w in live_d if w.url not in exclude] or live_d
        layout = self.registry.layout
        if not live or layout is None:
            raise NoWorkerAvailable("no healthy worker")
        span = trace.child("router.placement")
        p = self._choose(layout, live, [], job.token_ids, cache_salt, job.max_new)
        W = self.registry.workers[p.prefill]
        trace.placed(span, p, W, W)
        with ExitStack() as hold:
            hold.enter_context(W.load(running=1,
                                      reserved_tokens=len(job.token_ids) + job.max_new))
            try:
                with W.load(queued_tokens=len(job.token_ids) - p.predicted_cached_tokens), \
                        self.metrics.waiting.labels(W.name).track_inprogress():
                    first = await self.client.generate(W, GenerateRequest(
                        request_id=sub, prompt_token_ids=job.token_ids, sampling=spec,
                        snapshot_at=list(p.snapshot_at), cache_salt=cache_salt))
                if not 0 <= first.num_cached_tokens <= len(job.token_ids):
                    raise WorkerError(W.url, f"generate: malformed answer: num_cached_tokens "
                                             f"{first.num_cached_tokens}")
                self.pool.index_sync.answered(W, first.cache_events)
            except BaseException:
                self._abort(W, sub)
                raise
            return Placed(sub, p, W, W, first, hold.pop_all())

    # ------------------------------------------------------------------ one choice
    async def run_choice(self, job: PromptJob, index: int, choice: int,
                         sampling: SamplingParams, cache_salt: str | None, rid: str,
                         arrival: float, out: asyncio.Queue) -> Worker:
        """Run one choice through reserve → prefill → stream, pushing ``Delta``s to ``out``.

        A worker that cannot be reached before anything was computed is marked unhealthy and
        the choice is placed once more elsewhere (with none of its role live, once one is back:
        :func:`router.retries.wait_for_live`). A decode worker that answers ``busy`` (no free
        slot or pages) stays healthy: the choice is placed again after a short backoff, for up
        to ``RouterConfig.busy_wait_s``. Cancelling the task aborts the request on both workers.

        The workers detokenize and decide stops and ``max_tokens`` (token #1's in P's answer);
        the choice ends with:

        * D's ``finish_reason`` when D sent one: ``"length"`` (D's own model length, below
          what the router allowed: only with ``--max-model-len`` above a worker's),
          ``"stop"``, or ``"abort"`` (D aborted the request: the output is truncated);
        * with no ``finish_reason`` at all (``[DONE]`` or the body ended early):
          ``"length"`` when the prompt plus the tokens received reach D's model length (D
          cannot go on), else ``"abort"``; D is told to abort.

        A broken connection, a non-2xx status or an error event is a worker failure
        (``WorkerError``: 503, or an error event mid-stream).

        Returns:
            The prefill worker that ran it.

        Raises:
            NoWorkerAvailable: no healthy worker.
            WorkerError: a worker failed.
        """
        tried: set[str] = set()

        def exclude_failed(state: RetryCallState) -> None:
            """An unreachable worker (connection refused, 503) leaves placement until a poll
            succeeds; any failed worker is skipped by this choice while another healthy one
            of its role is left."""
            e = state.outcome.exception() if state.outcome else None
            if isinstance(e, WorkerError) and e.worker in self.registry.workers:
                w = self.registry.workers[e.worker]
                if e.retryable and not e.busy:
                    self.registry.mark_failed(w)
                log.warning("request %s-%d: %s failed before token #1 (%s); placing it again",
                            rid, index, w.name, e)
                others = {o.url for o in self.registry.live(w.role) if o.url != w.url}
                if others:  # skip the worker that failed last; the others get another turn
                    if others <= tried:
                        tried.difference_update(others)
                    tried.add(w.url)

        async def attempt(n: int) -> Placed:
            sub = f"{rid}-{index}" + (f"-r{n - 1}" if n > 1 else "")
            if n > 1:  # its worker failed: wait for a live one (a restarted one)
                wait_s = self.config.busy_wait_s
                await wait_for_live(self.registry.live, self.monolithic, arrival + wait_s, sub)
            first_token = (self._first_token_monolithic if self.monolithic
                           else self._first_token)
            return await first_token(job, sampling, cache_salt, sub, frozenset(tried))

        try:
            placed = await first_then_retrying(
                attempt, failover,
                lambda: AsyncRetrying(retry=retry_if_exception(failover),
                                      stop=stop_after_attempt(FIRST_TOKEN_ATTEMPTS),
                                      reraise=True, before_sleep=exclude_failed))
        except WorkerError as e:
            if e.client_error:
                raise refused(e) from None
            raise
        with placed.hold:
            if choice == 0:
                job.cached_tokens = placed.first.num_cached_tokens
                job.prefill, job.decode = placed.prefill, placed.decode
            async def resume(failed: Worker, tokens: list[int], lps: list[float | None],
                             k: int) -> tuple[Worker, str]:
                return await self._resume(placed, job, sampling, cache_salt, failed, tokens,
                                          lps, k)

            await stream_choice(placed, len(job.token_ids), index, sampling, out,
                                self.pool.streams, self.metrics, self._abort,
                                ttft_since=arrival if choice == 0 and job.prompt_index == 0
                                else None, resume=resume)
        return placed.prefill

    # ------------------------------------------------------------------ migration
    async def _resume(self, c: Placed, job: PromptJob, spec: SamplingParams,
                      cache_salt: str | None, failed: Worker, tokens: list[int],
                      logprobs: list[float | None], k: int) -> tuple[Worker, str]:
        """Request migration (:mod:`router.migrate`): continue choice ``c`` on another decode
        worker after ``tokens`` (token #1 and every token the client has), sampled on with
        the seed token #1 was sampled with. The new worker's load joins ``c.hold``.

        Returns:
            The decode worker and the request id (``{sub}-m{k}``) that continue the choice.

        Raises:
            NoWorkerAvailable: no decode worker took it within ``busy_wait_s``: busy ones are
                waited for, and with no other healthy one, a healthy one is (the failed worker
                too, once it answers its polls again: restarted by its supervisor).
        """
        if failed.url in self.registry.workers:
            self.registry.mark_failed(failed)
        self.metrics.migrations.inc()
        sub = f"{c.sub}-m{k}"
        body = ResumeRequest(request_id=sub, prompt_token_ids=job.token_ids,
                             output_token_ids=tokens, output_logprobs=logprobs,
                             sampling=spec.with_seed(c.first.seed),
                             cache_salt=cache_salt)
        need = len(job.token_ids) + job.max_new
        deadline = time.monotonic() + self.config.busy_wait_s
        tried = {failed.url}  # unreachable now (may come back)
        refused: set[str] = set()  # answered an error: not asked again
        while True:
            live = [w for w in self.registry.live("decode") if w.url not in tried | refused]
            if not live:
                if time.monotonic() >= deadline:
                    raise NoWorkerAvailable(f"no healthy decode worker to resume the request "
                                            f"on within {self.config.busy_wait_s:g} s")
                await asyncio.sleep(RESUME_WAIT_S)
                tried.clear()  # a worker back to health (polls succeed) may take it now
                continue
            D = min(live, key=lambda w: (w.running, w.reserved_tokens))
            with ExitStack() as hold:
                hold.enter_context(D.load(running=1, reserved_tokens=need))
                try:
                    await self.client.resume(D, body)
                except WorkerError as e:
                    if e.busy and time.monotonic() < deadline:
                        await self._busy_gate.turn(BUSY_RETRY_S, deadline)
                        continue
                    log.warning("request %s: resume on %s failed: %s", sub, D.name, e)
                    if e.retryable and not e.busy:
                        self.registry.mark_failed(D)
                        tried.add(D.url)
                    else:
                        refused.add(D.url)
                    continue
                except asyncio.CancelledError:
                    self._abort(D, sub)
                    raise
                c.hold.enter_context(hold.pop_all())
            return D, sub

    # ------------------------------------------------------------------ one prompt
    async def run_prompt(self, req: CompletionRequest | ChatCompletionRequest, job: PromptJob,
                         rid: str, arrival: float, out: asyncio.Queue) -> None:
        """Run the ``n`` choices of one prompt; every choice ends with ``END`` in ``out``.

        Choice 0 goes first; once its prefill answered (token #1 is out) and that prefill
        worker's cache events are pulled, choices 1..n-1 start together and find the prompt
        cached. An exception is put in ``out`` in place of a choice's ``END``.
        """
        base_seed = req.seed if req.seed is not None else secrets.randbits(63)
        n = req.n
        first_out: asyncio.Queue = asyncio.Queue()
        relay_done = asyncio.Event()

        async def relay() -> None:
            """Forward choice 0's deltas; wake the other choices at its first token."""
            while True:
                item = await first_out.get()
                await out.put(item)
                relay_done.set()
                if item is END or isinstance(item, BaseException):
                    return

        async def choice(j: int) -> Worker | None:
            q = first_out if j == 0 and n > 1 else out  # n = 1: nothing to wake
            span = trace.child("router.queue")
            try:
                async with self.admission.seat():  # a decode slot, in arrival order
                    tracing.end_span(span)
                    return await self.run_choice(
                        job, job.prompt_index * n + j, j,
                        self.pre.sampling(req, job.max_new, j, base_seed), req.cache_salt,
                        rid, arrival, q)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - delivered to the consumer
                await q.put(e)
                return None
            finally:
                await q.put(END)

        if n == 1:  # one choice: its deltas go straight to ``out``
            await choice(0)
            return
        relay_task = asyncio.create_task(relay())
        first = asyncio.create_task(choice(0))
        others: list[asyncio.Task] = []
        try:
            await relay_done.wait()
            if job.prefill is not None:  # pull its events: the prompt is indexed now
                with contextlib.suppress(WorkerError):
                    await self.pool.index_sync.pull(job.prefill)
            others = [asyncio.create_task(choice(j)) for j in range(1, n)]
            await asyncio.gather(first, relay_task, *others)
        finally:
            for t in (first, relay_task, *others):
                t.cancel()

    def execute(self, req: CompletionRequest | ChatCompletionRequest, jobs: list[PromptJob],
                rid: str, arrival: float) -> tuple[asyncio.Queue, list[asyncio.Task], int]:
        """Start every prompt of a request; return (delta queue, tasks, number of choices)."""
        out: asyncio.Queue = asyncio.Queue()
        tasks = [asyncio.create_task(self.run_prompt(req, job, rid, arrival, out))
                 for job in jobs]
        return out, tasks, len(jobs) * req.n


async def cancel(tasks: Sequence[asyncio.Task]) -> None:
    """Cancel tasks and wait for them to end (their errors are dropped)."""
    for t in tasks:
        t.cancel()
    for t in tasks:
        with contextlib.suppress(BaseException):
            await t
