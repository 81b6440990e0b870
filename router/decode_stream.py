"""The decode stream of a choice: one interface, two transports.

:meth:`DecodeStreams.relay` reads a request's token stream from its decode worker D and hands
each batch of events (those of one network read) to a callback in the task that read it.
The transport is D's decode channel (:class:`router.channel.DecodeChannels`: one connection
per decode worker, every request's events on it) when D serves channels and the router uses
them, else a ``POST /internal/stream`` of the request's own (:class:`PerRequestStreams`).
Either way the stream goes through D's breaker and the wait between two batches is bounded
(:data:`LEFT_S` once D left placement, ``timeout_s`` on any).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Awaitable, Callable

import aiohttp

from k3serve.messages import StreamEvent, StreamRequest
from router.channel import DecodeChannels, Deliver, End, stream_event
from router.client import WorkerClient
from router.sse import SSEReader
from router.workers import Worker, WorkerError

#: Longest a stream's reader reads the rest of a body after D ended the stream (s).
DRAIN_S = 1.0

#: Seconds a stream waits for its next batch once its decode worker is out of placement (its
#: liveness probes, polls or breaker took it out: stopped, wedged or failing) before it fails
#: as hung, and its choice moves to another decode worker (:mod:`router.migrate`); also the
#: period of the check, so a silent stream moves within ``2 × LEFT_S`` of D leaving placement
#: (or ``deadline_s``, when smaller).
LEFT_S = 1.0


async def stop_reader(reader: asyncio.Task, draining: set[asyncio.Task]) -> None:
    """Cancel a stream's reader task once and wait (5 s at most) for it to end; a reader in
    ``draining`` (reading the rest of a body D ended, :meth:`PerRequestStreams.drain`) is left to
    end by itself (within ``DRAIN_S``).

    The reader owns the connection and is cancelled once, here: a close that a second
    cancellation interrupts (a client that goes away cancels its choices more than once)
    leaves the connection checked out of the pool for good, and a pool of such connections
    starves every later call.
    """
    if reader in draining:
        return
    reader.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.wait([reader], timeout=5.0)

class PerRequestStreams:
    """The per-request transport: ``POST /internal/stream`` on D, read in a task of its own.

    Args:
        client: the calls to the workers (its session and connection slots).
    """

    def __init__(self, client: WorkerClient) -> None:
        self.client = client
        self.draining: set[asyncio.Task] = set()  # readers in :meth:`drain`
        self._timeout = aiohttp.ClientTimeout(total=None, sock_connect=5.0, sock_read=None)

    def tasks(self) -> list[asyncio.Task]:
        """The readers still draining a body (cancelled by the owner's close)."""
        return list(self.draining)

    async def start(self, w: Worker, body: StreamRequest, deliver: Deliver, end: End,
                    ended: asyncio.Future) -> Callable[[], Awaitable[None]]:
        """Start reading ``body``'s stream from ``w``: ``deliver`` a list of ``StreamEvent``
        s per network read (it returns True to stop reading), then ``end(None)`` at the end,
        or ``end`` of the ``WorkerError`` that ended it (after the events before it were
        delivered; a reader that died of a bug ends it with its exception). Returns the
        coroutine function that stops the reader (:func:`stop_reader`)."""
        def reader_done(t: asyncio.Task) -> None:  # a reader that died of a bug
            end(None if t.cancelled() or t.exception() is None else t.exception())

        reader = asyncio.create_task(self.read(w, body, deliver, end))
        reader.add_done_callback(reader_done)
        return functools.partial(stop_reader, reader, self.draining)

    async def drain(self, r: aiohttp.ClientResponse) -> None:
        """Read what is left of a decode stream's body after D ended the stream (``[DONE]``,
        the chunked end: they follow at once), for ``DRAIN_S`` at most, so that its
        connection goes back to the pool: aiohttp closes a connection whose response was
        left unread, and every stream then paid for a new connection on both sides. The
        reader is not cancelled meanwhile (:func:`stop_reader`); a body that does not end in
        time, or fails, just closes its connection."""
        me = asyncio.current_task()
        self.draining.add(me)
        try:
            async with asyncio.timeout(DRAIN_S):
                async for _ in r.content.iter_any():
                    pass
        except (TimeoutError, aiohttp.ClientError):
            pass
        finally:
            self.draining.discard(me)

    async def read(self, w: Worker, body: StreamRequest, deliver: Deliver, end: End) -> None:
        """Read D's SSE stream: ``deliver`` a list of ``StreamEvent`` s per network read (it
        returns True to stop reading), then ``end(None)`` at the end, or ``end`` of the
        ``WorkerError`` that ended it (after the events before it were delivered). The events
        are decoded by :func:`router.sse.decode_event` (msgspec's decoder of a struct derived from
        :class:`~k3serve.messages.StreamEvent`: :class:`router.sse.StreamEventWire`)."""
        try:
            # the wait between two events is bounded by the stream's watcher (``timeout_s``,
            # :meth:`DecodeStreams.relay`), not by aiohttp's read timeout, which re-arms a
            # timer on every network read of the stream
            async with self.client.slot(w, "stream"), self.client.open_stream(
                    w, "/internal/stream", body, self._timeout) as r:
                if r.status // 100 != 2:
                    text = (await r.read()).decode("utf-8", "replace")
                    raise WorkerError(w.url, f"stream: HTTP {r.status}: {text[:200]}",
                                      retryable=r.status == 503, status=r.status)
                sse = SSEReader()
                done = ended = False  # ended: D ended the stream (a finish, or [DONE])
                async for chunk in r.content.iter_any():
                    batch: list[StreamEvent] = []
                    failed: WorkerError | None = None
                    try:
                        for data in sse.feed(chunk):
                            ev = stream_event(w.url, data)
                            if ev is None:
                                done = ended = True
                                break
                            batch.append(ev)
                            if ev.finish_reason:
                                done = ended = True
                                break
                    except WorkerError as e:  # after the events before it
                        failed = e
                    if batch and deliver(batch):
                        # stopped by the consumer: if D's end was not in this batch, what
                        # follows is not its news (the router aborts the request on D); if it
                        # was (the finish it stopped at), the rest of the body is drained
                        done = True
                    elif failed is not None:
                        raise failed
                    if done:
                        break
                if ended and not r.content.at_eof():
                    end(None)  # the consumer has the end; the rest of the body follows
                    await self.drain(r)
                    return
            end(None)
        except WorkerError as e:
            end(e)
        except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as e:
            end(WorkerError(w.url, f"stream: {e!r}", retryable=True))
        except TimeoutError as e:
            end(WorkerError(w.url, f"stream: no event in time: {e!r}", hung=True))
        except aiohttp.ClientError as e:
            end(WorkerError(w.url, f"stream: {e!r}"))


class DecodeStreams:
    """The one way the router reads a decode stream (:meth:`relay`), over either transport.

    Args:
        client: the calls to the workers (breakers, timeouts).
        channels: the channel transport.
        use_channels: read the streams of a decode worker that serves decode channels
            (``WorkerInfo.channels``) on its channel; False: one stream per request.
    """

    def __init__(self, client: WorkerClient, channels: DecodeChannels,
                 use_channels: bool = True) -> None:
        self.client, self.channels, self.use_channels = client, channels, use_channels
        self.per_request = PerRequestStreams(client)

    def tasks(self) -> list[asyncio.Task]:
        """Both transports' tasks (cancelled by the owner's close)."""
        return self.channels.tasks() + self.per_request.tasks()

    async def relay(self, w: Worker, body: StreamRequest,
                    handle: Callable[[list[StreamEvent]], bool]) -> None:
        """Read the decode stream of ``body`` from ``w``, each batch (the events of one
        network read, a non-empty list in order) passed to ``handle`` at once in the task
        that reads it: no queue and no second task between the read and the relay.

        Args:
            w: The decode worker.
            body: The reserved request and token #1 as the prefill worker answered it (the
                decode worker continues from it when the transfer failed).
            handle: Called with each non-empty batch, in order; returns True to stop reading
                (the router finished the choice itself). Must not block; what it raises ends
                the stream and is raised here.

        A decode worker that serves decode channels (``WorkerInfo.channels``) sends the
        stream on this process's channel to it (:meth:`DecodeChannels.start`): ``handle`` is
        then called in the channel's reader task, with the events of one network read of the
        channel; else the stream is a ``POST /internal/stream`` of its own.

        Returns once the stream ended (an event with a ``finish_reason``, ``data: [DONE]``,
        the end of the body) or ``handle`` returned True. The wait between two batches is
        bounded: :data:`LEFT_S` (or ``deadline_s``, when smaller) once ``w`` is out of
        placement (:attr:`Worker.available` false), ``timeout_s`` on any.

        Raises:
            WorkerError: connection failure, non-2xx status, malformed or error event
                (``PoolBusy``: no free connection; ``hung``: no event in time); whatever
                ``handle`` raised.
        """
        client = self.client
        with client.calling(w, "/internal/stream"):
            loop = asyncio.get_running_loop()
            ended: asyncio.Future = loop.create_future()
            last = time.monotonic()  # the last batch (or the start): the wait's start

            def end(item: BaseException | None) -> None:
                if not ended.done():
                    ended.set_result(item)

            def deliver(batch: list[StreamEvent]) -> bool:
                nonlocal last
                last = time.monotonic()
                try:
                    return handle(batch) or bool(batch[-1].finish_reason)
                except BaseException as e:  # noqa: BLE001 - raised by relay
                    end(e)
                    return True

            transport = (self.channels if self.use_channels and w.info.channels
                         else self.per_request)
            stop = await transport.start(w, body, deliver, end, ended)
            deadline_s, timeout_s = min(LEFT_S, client.deadline_s), client.timeout_s
            every = min(1.0, deadline_s, timeout_s)
            timer: asyncio.TimerHandle | None = None

            def watch() -> None:
                nonlocal timer
                waited = time.monotonic() - last
                if waited >= deadline_s and not w.available:
                    end(WorkerError(w.url, f"no event for {waited:.1f} s from a worker out "
                                           f"of placement", hung=True))
                    return
                if waited >= timeout_s:
                    end(WorkerError(w.url, f"stream: no event within {timeout_s:g} s",
                                    hung=True))
                    return
                timer = loop.call_later(every, watch)

            timer = loop.call_later(every, watch)
            try:
                item = await ended
                if item is not None:
                    raise item
            finally:
                timer.cancel()
                await stop()
