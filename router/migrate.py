"""Request migration: a choice's decode events that survive the death of its decode worker.

When the decode stream of a choice fails mid-way (the worker was killed, its connection
dropped, it sent an error event), :class:`DecodeEvents` asks the router to resume the request
on another decode worker — ``POST /internal/resume`` with the prompt and every token the
client already has (token #1 and the ones streamed since; they count as output there:
``max_tokens``, the penalties, stop tokens), sampled on with the request's seed at position
``L + len(outputs)`` (the sampler's noise is keyed by ``(seed, choice, position)``,
:mod:`k3serve.engine.sampler`, so seeded sampling continues exactly) — and goes on with that
worker's stream. That worker's detokenizer, fed the same outputs, has released the same text
as the failed one (text it holds back stays held), so the text relayed by
:func:`router.stream.stream_choice` continues with no gap and no repeated token::

    stream(D0) ── tokens ──▶ consumer          (tokens += each event the consumer took)
        │ WorkerError
        ▼
    resume(D0, tokens) ─▶ (D1, sub-m1) ─▶ stream(D1) ── tokens after `tokens` ──▶ consumer
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from k3serve.messages import StreamEvent, StreamRequest
from router.decode_stream import DecodeStreams
from router.metrics import HistogramBuffer, RouterMetrics
from router.workers import Worker, WorkerError

log = logging.getLogger("k3serve.router")

#: A choice migrates at most this many times (then its failure reaches the client).
MAX_MIGRATIONS = 2

#: ``resume(failed worker, output token ids, their logprobs, attempt k ≥ 1)`` → the decode
#: worker and request id that continue the choice (raises ``WorkerError`` /
#: ``NoWorkerAvailable`` when none can).
Resume = Callable[[Worker, list[int], list[float | None], int], Awaitable[tuple[Worker, str]]]


class ServedBy:
    """The per-decode-worker series of one choice — ``running`` (gauge) and ``itl``
    (histogram) of :class:`~router.metrics.RouterMetrics`, labelled with the worker's name —
    kept on the worker that serves the choice now: after a migration :meth:`follow` moves the
    choice's count from the failed worker's gauge to the new one's and later inter-token
    latencies go to the new worker's histogram. :meth:`close` (once, when the choice ends)
    takes the count off. Inter-token latencies go through a :class:`HistogramBuffer`
    (``itl.observe_many(value, n, now)``): they reach the histogram every 64 reads or, at a
    read, a second after the last update, and at a migration and :meth:`close`.

    Args:
        metrics: the router's metrics.
        worker: the decode worker the choice streams from first.
    """

    def __init__(self, metrics: RouterMetrics, worker: Worker) -> None:
        self.metrics, self.name = metrics, worker.name
        self.itl = HistogramBuffer(metrics.itl.labels(self.name))
        metrics.running.labels(self.name).inc()
        self._open = True

    def follow(self, worker: Worker) -> None:
        """The choice is served by ``worker`` now (a no-op when it already was)."""
        if worker.name == self.name or not self._open:
            return
        self.itl.flush()
        self.metrics.running.labels(self.name).dec()
        self.name = worker.name
        self.itl = HistogramBuffer(self.metrics.itl.labels(self.name))
        self.metrics.running.labels(self.name).inc()

    def close(self) -> None:
        if self._open:
            self._open = False
            self.itl.flush()
            self.metrics.running.labels(self.name).dec()


#: Delivered batches a :class:`DecodeEvents` holds before it counts their tokens.
COUNT_EVERY = 64


class DecodeEvents:
    """The :class:`StreamEvent` s of one choice from token #2 on, across decode workers, in
    batches (the events that arrived in one network read), handed to a callback
    (:meth:`run`).

    Args:
        streams: the router's decode streams (anything with
            :meth:`~router.decode_stream.DecodeStreams.relay`).
        worker / sub: the decode worker and request id the choice streams from first.
        first: token #1 and its logprob (what the prefill worker answered).
        resume: see :data:`Resume`; ``None``: no migration (a failure is raised).
        served: the choice's per-worker metric series, moved to the new worker as soon as a
            migration found one (``None``: none kept).

    Attributes:
        worker / sub: where the choice streams from now (abort it there).
        tokens: every output token handed to the consumer (token #1 first).
        migrations: how many times the choice moved.
    """

    def __init__(self, streams: DecodeStreams, worker: Worker, sub: str,
                 first: tuple[int, float | None], resume: Resume | None,
                 served: ServedBy | None = None) -> None:
        self.streams, self.worker, self.sub, self.resume = streams, worker, sub, resume
        self.served = served
        self._tokens: list[int] = [first[0]]
        self._logprobs: list[float | None] = [first[1]]
        self._pending: list[list[StreamEvent]] = []  # delivered batches not yet counted
        self.migrations = 0

    @property
    def tokens(self) -> list[int]:
        """Every output token handed to the consumer, token #1 first (the list itself)."""
        self._count()
        return self._tokens

    @property
    def logprobs(self) -> list[float | None]:
        """The logprob of each of :attr:`tokens` (``None``: none sent, or not finite)."""
        self._count()
        return self._logprobs

    async def run(self, handle: Callable[[list[StreamEvent]], bool]) -> None:
        """Pass each batch of the choice's events to ``handle`` in the task that reads the
        stream (:meth:`DecodeStreams.relay`: no hand-over between two tasks per batch); a
        batch counts as delivered once ``handle`` returned, so a migration resumes after
        exactly those tokens. ``handle`` returns True to stop (the consumer finished the
        choice); it must not block.

        Raises:
            WorkerError: the stream failed and no migration was possible (``resume`` is
                ``None``, ``MAX_MIGRATIONS`` reached, or no decode worker could take it);
                whatever ``handle`` raised.
        """
        body = self._first_body()

        def take(batch: list[StreamEvent]) -> bool:
            stop = handle(batch)
            self._delivered(batch)
            return stop

        while True:
            try:
                await self.streams.relay(self.worker, body, take)
                return
            except WorkerError as e:
                body = await self._migrate(e)

    def _first_body(self) -> StreamRequest:
        return StreamRequest(request_id=self.sub, token_id=self.tokens[0],
                             logprob=self.logprobs[0])

    def _delivered(self, batch: list[StreamEvent]) -> None:
        """Note a batch the consumer has: its tokens are counted into :attr:`tokens` when
        they are read (a migration, rarely), or every ``COUNT_EVERY`` batches, not per batch
        on the relay's path (the noted events, their text and logprobs, are held until
        then: a bounded number of them)."""
        pending = self._pending
        pending.append(batch)
        if len(pending) >= COUNT_EVERY:
            self._count()

    def _count(self) -> None:
        """Move the delivered batches' tokens (and their logprobs) into the lists."""
        tokens, lps = self._tokens, self._logprobs
        for batch in self._pending:
            for ev in batch:
                tokens += ev.token_ids
                lps += [lp.logprob for lp in ev.logprobs[:len(ev.token_ids)]]
                lps += [None] * (len(tokens) - len(lps))
        self._pending.clear()

    async def _migrate(self, e: WorkerError) -> StreamRequest:
        """After the stream failed with ``e``: resume the request on another decode worker;
        returns the stream request that continues it there.

        Raises:
            WorkerError: ``e``, when no migration is possible.
        """
        if self.resume is None or self.migrations >= MAX_MIGRATIONS:
            raise e
        failed = self.worker
        self.migrations += 1
        log.warning("request %s: the decode stream of %s failed after %d tokens (%s); "
                    "migrating it (%d)", self.sub, failed.url, len(self.tokens), e,
                    self.migrations)
        try:
            self.worker, self.sub = await self.resume(
                failed, list(self.tokens), list(self.logprobs), self.migrations)
            if self.served is not None:
                self.served.follow(self.worker)
        except Exception as e2:  # noqa: BLE001 - the original failure is the news
            log.warning("request %s: migration failed: %r", self.sub, e2)
            raise e from None
        return StreamRequest(request_id=self.sub, token_id=self.tokens[-1],
                             logprob=self.logprobs[-1])


__all__ = ["MAX_MIGRATIONS", "DecodeEvents", "Resume", "ServedBy"]
