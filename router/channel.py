"""Decode channels: one connection per decode worker carrying every request's token stream.

The channel transport of :class:`router.decode_stream.DecodeStreams`: ``POST
/internal/channel`` held open (:class:`DecodeChannel`), each request's stream sent on it by
``POST /internal/attach`` (:meth:`DecodeChannels.start`), each event tagged with its request
id (:class:`k3serve.messages.ChannelRequest`). The router then reads one connection per
decode worker, and the events of many requests that one worker wrote together in one network
read: the per-read cost of the HTTP client and the event loop is paid per worker write, not
per request.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Awaitable, Callable, Mapping

import aiohttp

from k3serve.messages import (
    CHANNEL_PING_S,
    AttachRequest,
    ChannelRequest,
    StreamEvent,
    StreamRequest,
)
from router.client import WorkerClient, check_status
from router.sse import SSEReader, decode_event
from router.workers import Worker, WorkerError

log = logging.getLogger("k3serve.router")

#: Takes one batch of a stream's events (those of one network read); True: stop the stream.
Deliver = Callable[[list[StreamEvent]], bool]
#: Ends a stream: ``None`` after its last event, else the error that ended it.
End = Callable[[BaseException | None], None]

#: A decode channel: its worker writes at least a keep-alive every ``CHANNEL_PING_S``; one
#: silent for 3 × that is given up (its streams fail, the next attach opens a new one).
CHANNEL_TIMEOUT = aiohttp.ClientTimeout(total=None, sock_connect=5.0,
                                        sock_read=3 * CHANNEL_PING_S)


def stream_event(url: str, data: bytes) -> StreamEvent | None:
    """One ``data:`` payload of decode worker ``url``'s stream (its own, or its part of a
    channel) as a ``StreamEvent`` (:func:`router.sse.decode_event`); ``None`` for ``[DONE]``.

    Raises:
        WorkerError: a malformed event, or an error event without tokens.
    """
    if data.strip() == b"[DONE]":
        return None
    try:
        ev = decode_event(data)
    except ValueError as e:
        raise WorkerError(url, f"stream: malformed StreamEvent: {e}") from None
    if ev.error is not None and not ev.token_ids:
        raise WorkerError(url, f"stream: {ev.error}")
    return ev



class DecodeChannel:
    """This router process's decode channel to one decode worker: ``POST /internal/channel``
    held open in a task of its own (:meth:`open`), whose body carries the token streams of
    every request attached to it (:meth:`DecodeChannels.start`), each event tagged with its
    request id (:class:`k3serve.messages.ChannelRequest`). Per network read of the channel,
    each attached request's events go to its ``deliver`` as one batch, in order, and its
    stream ends as it would on a stream of its own: ``end(None)`` after a ``finish_reason``,
    ``[DONE]``, or ``deliver`` returning True; ``end`` of a ``WorkerError`` after an error
    or malformed event. A channel whose body ends or fails ends every stream on it with a
    ``WorkerError`` (migration takes them on); the next attach opens a new channel.

    Args:
        client: the calls to the workers (its session and timeouts).
        w: the decode worker.
        on_end: called with the channel when its task ends (``None``: nothing).
    """

    def __init__(self, client: WorkerClient, w: Worker,
                 on_end: Callable[[DecodeChannel], None] | None = None) -> None:
        self.client, self.w, self.on_end = client, w, on_end
        self.cid = ""
        self.task: asyncio.Task | None = None
        self._opened: asyncio.Future | None = None
        self._subs: dict[bytes, tuple[Deliver, End]] = {}

    @property
    def attached(self) -> Mapping[bytes, tuple[Deliver, End]]:
        """The requests attached to the open channel: request id → (deliver, end)."""
        return self._subs

    @property
    def open_id(self) -> str | None:
        """The id of the channel when it is open (the worker answered it), else ``None``."""
        t, opened = self.task, self._opened
        if t is None or t.done() or opened is None or not opened.done():
            return None
        return self.cid if opened.exception() is None else None

    async def open(self) -> str:
        """The channel's id, once the worker has answered its ``POST /internal/channel``
        (opened now when it is not open).

        Raises:
            WorkerError: the worker refused it or could not be reached; ``hung``: no answer
                within the call timeout (``timeout_s``).
        """
        if self.task is None or self.task.done():
            self.cid = secrets.token_hex(8)
            self._subs = {}
            self._opened = asyncio.get_running_loop().create_future()
            self.task = asyncio.create_task(self._run(self.cid, self._opened, self._subs))
        try:  # shielded: a caller that goes away leaves it opening for the others
            await asyncio.wait_for(asyncio.shield(self._opened), self.client.timeout_s)
        except TimeoutError:
            self.close(self.cid)
            raise WorkerError(self.w.url, f"channel: not answered within "
                                          f"{self.client.timeout_s:g} s", hung=True) from None
        return self.cid

    def attach(self, cid: str, rid: bytes, deliver: Callable[[list[StreamEvent]], bool],
               end: Callable[[BaseException | None], None]) -> None:
        """Route the events of request ``rid`` (its id, ASCII bytes) on channel ``cid`` (as
        :meth:`open` returned it) to ``deliver``/``end``.

        Raises:
            WorkerError: ``cid`` is not the open channel any more (retryable, code
                ``unknown_channel``: open it again).
        """
        if cid != self.cid or self.task is None or self.task.done():
            raise WorkerError(self.w.url, "channel: closed", retryable=True,
                              code="unknown_channel")
        self._subs[rid] = (deliver, end)

    def detach(self, cid: str, rid: bytes) -> bool:
        """Drop request ``rid`` of channel ``cid``: what the worker still sends for it is
        ignored. Returns whether it was still attached (its stream had not ended)."""
        return cid == self.cid and self._subs.pop(rid, None) is not None

    def close(self, cid: str | None = None) -> None:
        """End the channel (``cid``: only if it is still the open one); its streams end with
        a ``WorkerError`` and the next :meth:`open` opens a new one at once."""
        if self.task is not None and (cid is None or cid == self.cid):
            self.task.cancel()
            self.client.spawn(self.task)  # kept (and awaited by the client's close) as it ends
            self.task = None

    async def _run(self, cid: str, opened: asyncio.Future,
                   subs: dict[bytes, tuple[Deliver, End]]) -> None:
        w = self.w
        err: WorkerError | None = None
        try:
            async with self.client.open_stream(w, "/internal/channel",
                                               ChannelRequest(channel=cid),
                                               CHANNEL_TIMEOUT) as r:
                if r.status // 100 != 2:
                    data = await r.read()
                    check_status(w.url, "/internal/channel", r.status, data)
                opened.set_result(None)
                sse = SSEReader()
                async for chunk in r.content.iter_any():
                    self._dispatch(sse.feed_tagged(chunk), subs)
            err = WorkerError(w.url, "channel: the decode worker ended it")
        except WorkerError as e:
            err = e
        except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as e:
            err = WorkerError(w.url, f"channel: {e!r}", retryable=True)
        except aiohttp.ClientError as e:
            err = WorkerError(w.url, f"channel: {e!r}")
        except asyncio.CancelledError:
            err = WorkerError(w.url, "channel: closed by the router", retryable=True)
            raise
        except Exception as e:  # a bug here must not leave the channel's streams hanging
            log.exception("decode channel to %s failed", w.url)
            err = WorkerError(w.url, f"channel: {e!r}")
        finally:
            if not opened.done():
                opened.set_exception(err)
                opened.exception()  # retrieved: nobody may be waiting any more
            ends = [end for _, end in subs.values()]
            subs.clear()
            for end in ends:
                end(err)
            if self.on_end is not None:
                self.on_end(self)

    def _dispatch(self, items: list[tuple[bytes, bytes]],
                  subs: dict[bytes, tuple[Deliver, End]]) -> None:
        """One network read of the channel: each attached request's events as one batch."""
        url = self.w.url
        batches: dict[bytes, list[StreamEvent]] = {}

        def finish(rid: bytes, err: BaseException | None) -> None:
            deliver, end = subs.pop(rid)
            batch = batches.pop(rid, None)
            if batch:
                deliver(batch)
            end(err)

        for rid, data in items:
            if rid not in subs:  # detached (the router finished it first), or not ours
                continue
            try:
                ev = stream_event(url, data)
            except WorkerError as e:
                finish(rid, e)
                continue
            if ev is None:  # [DONE]
                finish(rid, None)
                continue
            batch = batches.get(rid)
            if batch is None:
                batches[rid] = [ev]
            else:
                batch.append(ev)
            if ev.finish_reason:
                finish(rid, None)
        for rid, batch in batches.items():
            deliver, end = subs[rid]
            if deliver(batch):  # the consumer stopped: what follows is not its news
                del subs[rid]
                end(None)


class DecodeChannels:
    """The channel transport: this process's decode channel to each decode worker, by URL.

    Args:
        client: the calls to the workers.
        workers: the registered workers by URL (a channel of a worker no longer registered
            is forgotten when it ends).
    """

    def __init__(self, client: WorkerClient, workers: Mapping[str, Worker]) -> None:
        self.client, self.workers = client, workers
        self.by_url: dict[str, DecodeChannel] = {}

    def tasks(self) -> list[asyncio.Task]:
        """The channels' reader tasks (cancelled by the owner's close)."""
        return [c.task for c in self.by_url.values() if c.task is not None]

    def _ended(self, ch: DecodeChannel) -> None:
        if self.workers.get(ch.w.url) is not ch.w and self.by_url.get(ch.w.url) is ch:
            del self.by_url[ch.w.url]  # the worker is gone: forget its channel

    async def start(self, w: Worker, body: StreamRequest, deliver: Deliver, end: End,
                    ended: asyncio.Future) -> Callable[[], Awaitable[None]]:
        """Send ``body``'s stream on this process's decode channel to ``w`` (opened first
        when it is not open): ``deliver`` / ``end`` as :meth:`router.decode_stream.PerRequestStreams.start` calls them, from
        the channel's reader; ``ended``: done once ``end`` was called. Returns the coroutine
        function that detaches the stream: one the worker did not end (a watcher gave up on
        it, the caller went away) is aborted there too, as closing a stream of its own does.

        A channel the worker no longer knows (409 ``unknown_channel``: it restarted, or the
        channel's connection just dropped) is opened again once, unless the stream already
        ended meanwhile (the old channel's end reached it).

        Raises:
            WorkerError: the channel could not be opened, or the attach call failed (as
                :meth:`WorkerClient.attach`); ``PoolBusy``: no free connection for the call.
        """
        ch = self.by_url.get(w.url)
        if ch is None:
            ch = self.by_url[w.url] = DecodeChannel(self.client, w, self._ended)
        key = body.request_id.encode()
        for again in (False, True):
            cid = ch.open_id or await self.client.bounded(w, ch.open())
            try:
                ch.attach(cid, key, deliver, end)
                await self.client.attach(w, AttachRequest(channel=cid, **body.model_dump()))
            except WorkerError as e:
                ch.detach(cid, key)
                if e.code == "unknown_channel" and not again and not ended.done():
                    ch.close(cid)
                    continue
                raise
            except BaseException:
                if ch.detach(cid, key):  # the worker may have taken it: end it there
                    self.client.spawn(self.client.abort(w, body.request_id))
                raise
            break

        async def detach() -> None:
            if ch.detach(cid, key):  # still streaming on the worker: stop it there
                self.client.spawn(self.client.abort(w, body.request_id))

        return detach
