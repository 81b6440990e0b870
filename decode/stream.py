"""The decode stream on the wire: each :class:`~k3serve.messages.StreamEvent` is one SSE
``data:`` line (written by sse-starlette), then ``data: [DONE]``.

Events that are ready together (the engine stepped again while the previous event was still
being written: a busy loop or a slow reader) go out as ONE event: their ``token_ids``,
``text`` and ``logprobs`` concatenated (:func:`merge`), so the per-event cost of the HTTP
path and of the router's relay is paid once per write rather than once per token. A reader
that keeps up sees one event per engine step, as before.

``error`` is written only when set: readers tell a failed request by the key.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from sse_starlette import EventSourceResponse, ServerSentEvent

from k3serve.messages import StreamEvent

DONE = "[DONE]"

#: Most tokens one coalesced event carries (bounds a write after a long stall).
MAX_TOKENS_PER_EVENT = 256


class StreamEventsResponse(EventSourceResponse):
    """An SSE answer; ``media_type`` on the class so the OpenAPI schema lists StreamEvent under
    ``text/event-stream``."""

    media_type = "text/event-stream"


def sse(ev: StreamEvent) -> ServerSentEvent:
    """One event as an SSE ``data:`` line."""
    return ServerSentEvent(data=ev.model_dump_json(exclude={"error"} if ev.error is None
                                                   else None))


def _aligned(ev: StreamEvent) -> bool:
    return len(ev.logprobs) == len(ev.token_ids)


def mergeable(a: StreamEvent, b: object) -> bool:
    """Whether ``b`` may be appended to ``a``: ``a`` is not final, and the merged
    ``logprobs`` stay aligned with ``token_ids`` (both carry them per token, or neither)."""
    if not isinstance(b, StreamEvent) or a.finish_reason is not None or a.error is not None:
        return False
    if len(a.token_ids) + len(b.token_ids) > MAX_TOKENS_PER_EVENT:
        return False
    if not a.logprobs and not b.logprobs:
        return True
    return _aligned(a) and _aligned(b)


def merge(a: StreamEvent, b: StreamEvent) -> StreamEvent:
    """``a`` then ``b`` as one event (``mergeable(a, b)`` must hold): concatenated tokens,
    text and logprobs; ``b``'s finish reason and error."""
    return StreamEvent(token_ids=[*a.token_ids, *b.token_ids], text=a.text + b.text,
                       logprobs=[*a.logprobs, *b.logprobs], finish_reason=b.finish_reason,
                       error=b.error)


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


__all__ = ["DONE", "MAX_TOKENS_PER_EVENT", "StreamEventsResponse", "events", "merge",
           "mergeable", "sse", "take_ready"]
