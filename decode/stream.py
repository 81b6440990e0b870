"""The decode stream on the wire: each :class:`~k3serve.messages.StreamEvent` is one SSE
``data:`` line (written by sse-starlette), then ``data: [DONE]``.

Events that are ready together (the engine stepped again while the previous event was still
being written: a busy loop or a slow reader) go out as ONE event: their ``token_ids``,
``text`` and ``logprobs`` concatenated (:func:`merge`), so the per-event cost of the HTTP
path and of the router's relay is paid once per write rather than once per token. A reader
that keeps up sees one event per engine step.

``error`` is written only when set: readers tell a failed request by the key.

A decode channel (:class:`Channel`; ``POST /internal/channel``, ``POST /internal/attach``)
carries the same events of many requests on one body, each tagged with its request id as the
SSE ``event:`` field, and writes every event that is ready, of any request, at once: a router
reads one connection per decode worker instead of one per request.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.responses import StreamingResponse

from k3serve.messages import CHANNEL_PING_S, StreamEvent

DONE = "[DONE]"

#: Most tokens one coalesced event carries (bounds a write after a long stall).
MAX_TOKENS_PER_EVENT = 256


class StreamEventsResponse(EventSourceResponse):
    """An SSE answer; ``media_type`` on the class so the OpenAPI schema lists StreamEvent under
    ``text/event-stream``."""

    media_type = "text/event-stream"


def sse(ev: StreamEvent) -> ServerSentEvent:
    """One event as an SSE ``data:`` line (``error`` and ``texts`` only when set)."""
    skip = {k for k in ("error", "texts") if getattr(ev, k) is None}
    return ServerSentEvent(data=ev.model_dump_json(exclude=skip or None))


def _aligned(ev: StreamEvent) -> bool:
    return len(ev.logprobs) == len(ev.token_ids)


def token_texts(text: str, ends: list[int], start: int) -> list[str]:
    """The text each of some tokens released, from the detokenizer's record.

    Args:
        text: the choice's output text now (:attr:`CompletionOutput.text`).
        ends: per token, ``len(text)`` right after it (:attr:`CompletionOutput.text_ends`,
            the tokens' slice); at least one.
        start: where these tokens' text starts (the text sent before them).

    Returns:
        One piece per token, ``"".join(pieces) == text[start:]`` (text a finish flushed after
        the last token's step goes to the last token).
    """
    out = []
    for e in ends:
        e = max(start, e)
        out.append(text[start:e])
        start = e
    out[-1] += text[start:]
    return out


def mergeable(a: StreamEvent, b: object) -> bool:
    """Whether ``b`` may be appended to ``a``: ``a`` is not final, and the merged
    ``logprobs`` and ``texts`` stay aligned with ``token_ids`` (both carry them per token, or
    neither)."""
    if not isinstance(b, StreamEvent) or a.finish_reason is not None or a.error is not None:
        return False
    if len(a.token_ids) + len(b.token_ids) > MAX_TOKENS_PER_EVENT:
        return False
    if (a.texts is None) != (b.texts is None):
        return False
    if not a.logprobs and not b.logprobs:
        return True
    return _aligned(a) and _aligned(b)


def merge(a: StreamEvent, b: StreamEvent) -> StreamEvent:
    """``a`` then ``b`` as one event (``mergeable(a, b)`` must hold): concatenated tokens,
    text and logprobs; ``b``'s finish reason and error."""
    texts = None if a.texts is None or b.texts is None else [*a.texts, *b.texts]
    return StreamEvent(token_ids=[*a.token_ids, *b.token_ids], text=a.text + b.text,
                       texts=texts, logprobs=[*a.logprobs, *b.logprobs],
                       finish_reason=b.finish_reason, error=b.error)


def take_ready(q: asyncio.Queue, ev: StreamEvent) -> tuple[StreamEvent, StreamEvent | None]:
    """``ev`` merged with the events already waiting in ``q``, up to a final one.

    Returns:
        The merged event, and the event taken from ``q`` that did not merge (to be sent
        next), else ``None``.
    """
    while not q.empty() and ev.finish_reason is None and ev.error is None:
        nxt = q.get_nowait()
        if not mergeable(ev, nxt):
            return ev, nxt
        ev = merge(ev, nxt)
    return ev, None


async def events(q: asyncio.Queue, idle_s: float,
                 on_close: Callable[[bool], None]) -> AsyncIterator[ServerSentEvent]:
    """The SSE events of queue ``q`` (of :class:`StreamEvent`) up to the one with a
    ``finish_reason``, then ``[DONE]``; events ready together are coalesced (:func:`take_ready`).

    Args:
        q: the request's events (filled from the engine thread).
        idle_s: no event for this many seconds: a final failure event ends the stream.
        on_close: called once when the stream ends, with whether it saw the finish (False:
            the client left, or the stream timed out).
    """
    finished = False
    left: StreamEvent | None = None
    try:
        while True:
            if left is not None:
                ev, left = left, None
            elif q.empty():
                try:
                    ev = await asyncio.wait_for(q.get(), idle_s)
                except TimeoutError:
                    yield sse(StreamEvent.failure(f"no token within {idle_s:.0f} s"))
                    break
            else:
                ev = q.get_nowait()
            ev, left = take_ready(q, ev)
            yield sse(ev)
            if ev.finish_reason:
                finished = True
                break
        yield ServerSentEvent(data=DONE)
    finally:
        on_close(finished)


class Channel:
    """A decode channel (:class:`k3serve.messages.ChannelRequest`): the events of the
    requests attached to it (:meth:`forward`) as one SSE body (:meth:`body`), each event
    ``event: <request id>`` and its ``data:`` line, every event ready at a write in that write.

    Args:
        cid: the channel's id (the router's).
    """

    def __init__(self, cid: str) -> None:
        self.cid = cid
        self._q: asyncio.Queue[bytes | None] = asyncio.Queue()  # None: the body ends
        self._forwarders: set[asyncio.Task] = set()
        self.closed = False

    def put(self, rid: str, data: str) -> None:
        """Queue one event of request ``rid`` (``data``: one line, a JSON message or
        ``[DONE]``)."""
        self._q.put_nowait(f"event: {rid}\ndata: {data}\n\n".encode())

    def forward(self, rid: str, stream: AsyncIterator[ServerSentEvent | str],
                abandoned: Callable[[], None] | None = None) -> None:
        """Send ``stream`` (a request's SSE events, as :func:`events` yields them) on this
        channel, tagged with ``rid``, in a task of its own; closing the channel cancels it
        (the stream's generator then closes: as a stream whose reader went away).
        ``abandoned`` is called when the stream never started (the channel closed first:
        its generator's own ``finally`` does not run then)."""
        started = False

        async def run() -> None:
            nonlocal started
            started = True
            try:
                async for ev in stream:
                    self.put(rid, ev.data if isinstance(ev, ServerSentEvent) else ev)
            finally:
                aclose = getattr(stream, "aclose", None)
                if aclose is not None:
                    await aclose()

        def done(t: asyncio.Task) -> None:
            self._forwarders.discard(t)
            if not started and abandoned is not None:
                abandoned()

        if self.closed:  # nothing will be sent: as a stream that never started
            if abandoned is not None:
                abandoned()
            return
        t = asyncio.create_task(run())
        self._forwarders.add(t)
        t.add_done_callback(done)

    async def body(self) -> AsyncIterator[bytes]:
        """The channel's SSE body: what is queued, in one chunk per write (an SSE comment
        after ``CHANNEL_PING_S`` s without an event). Ends the channel when closed."""
        q = self._q
        try:
            while True:
                try:
                    first = await asyncio.wait_for(q.get(), CHANNEL_PING_S)
                except TimeoutError:
                    yield b": ping\n\n"
                    continue
                parts, item = [], first
                while item is not None:  # what is queued now, up to the end
                    parts.append(item)
                    if q.empty():
                        break
                    item = q.get_nowait()
                if parts:
                    yield parts[0] if len(parts) == 1 else b"".join(parts)
                if item is None:
                    return
        finally:
            self.close()

    def close(self) -> None:
        """Cancel every forwarder (their requests end as streams closed early) and end the
        body after what is queued."""
        if not self.closed:
            self.closed = True
            self._q.put_nowait(None)
        for t in list(self._forwarders):
            t.cancel()


class Channels:
    """A decode worker's open channels, by id."""

    def __init__(self) -> None:
        self._open: dict[str, Channel] = {}

    def open(self, cid: str) -> Channel:
        """A new channel ``cid``; an open one of that id is closed first."""
        old = self._open.pop(cid, None)
        if old is not None:
            old.close()
        ch = self._open[cid] = Channel(cid)
        return ch

    def get(self, cid: str) -> Channel | None:
        """The open channel ``cid``, else ``None``."""
        ch = self._open.get(cid)
        return ch if ch is not None and not ch.closed else None

    def drop(self, ch: Channel) -> None:
        """Forget ``ch`` (its body ended) and close it."""
        if self._open.get(ch.cid) is ch:
            del self._open[ch.cid]
        ch.close()

    def close_all(self) -> None:
        """Close every open channel (a worker that stops: their bodies end, so the server's
        shutdown does not wait on them, and the routers see the channels end)."""
        for ch in list(self._open.values()):
            self.drop(ch)

    def response(self, ch: Channel) -> StreamingResponse:
        """The ``POST /internal/channel`` answer: ``ch``'s body; dropped when it ends (the
        router went away)."""
        async def body() -> AsyncIterator[bytes]:
            try:
                async for chunk in ch.body():
                    yield chunk
            finally:
                self.drop(ch)

        return ChannelResponse(body(), headers={"Cache-Control": "no-cache"})


class ChannelResponse(StreamingResponse):
    """A decode channel's SSE body (``media_type`` on the class for the OpenAPI schema)."""

    media_type = "text/event-stream"


__all__ = ["DONE", "MAX_TOKENS_PER_EVENT", "Channel", "ChannelResponse",
           "Channels", "StreamEventsResponse", "events", "merge", "mergeable", "sse",
           "take_ready", "token_texts"]
