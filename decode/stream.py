"""The decode stream on the wire: each :class:`~k3serve.messages.StreamEvent` is one SSE
``data:`` line (written by sse-starlette), then ``data: [DONE]``.

``error`` is written only when set: readers tell a failed request by the key.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from sse_starlette import EventSourceResponse, ServerSentEvent

from k3serve.messages import StreamEvent

DONE = "[DONE]"


class StreamEventsResponse(EventSourceResponse):
    """An SSE answer; ``media_type`` on the class so the OpenAPI schema lists StreamEvent under
    ``text/event-stream``."""

    media_type = "text/event-stream"


def sse(ev: StreamEvent) -> ServerSentEvent:
    """One event as an SSE ``data:`` line."""
    return ServerSentEvent(data=ev.model_dump_json(exclude={"error"} if ev.error is None
                                                   else None))


async def events(q: asyncio.Queue, idle_s: float,
                 on_close: Callable[[bool], None]) -> AsyncIterator[ServerSentEvent]:
    """The SSE events of queue ``q`` (of :class:`StreamEvent`) up to the one with a
    ``finish_reason``, then ``[DONE]``.

    Args:
        q: the request's events (filled from the engine thread).
        idle_s: no event for this many seconds: a final failure event ends the stream.
        on_close: called once when the stream ends, with whether it saw the finish (False:
            the client left, or the stream timed out).
    """
    finished = False
    try:
        while True:
            try:
                ev = await asyncio.wait_for(q.get(), idle_s)
            except TimeoutError:
                yield sse(StreamEvent.failure(f"no token within {idle_s:.0f} s"))
                break
            yield sse(ev)
            if ev.finish_reason:
                finished = True
                break
        yield ServerSentEvent(data=DONE)
    finally:
        on_close(finished)


__all__ = ["DONE", "StreamEventsResponse", "events", "sse"]
