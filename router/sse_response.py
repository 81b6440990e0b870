"""The streaming answer of a completion: ``text/event-stream`` written straight to ASGI.

:class:`SSEResponse` hands the ASGI ``send`` to a coroutine (:meth:`router.answer.Answer.write`)
that writes the status, the headers and one chunk per batch of deltas; :func:`coalesce`
merges the deltas of one choice already queued into one chunk; :data:`GONE` is what a
request's delta queue receives when its client disconnects (:func:`put_when_gone`).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from fastapi.responses import Response

from router.stream import Delta

DONE_FRAME = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-store", "Connection": "keep-alive", "X-Accel-Buffering": "no"}

GONE = object()  # put in a stream's delta queue when its client disconnects


def data(obj: Any) -> str:
    """One SSE ``data:`` payload (compact JSON)."""
    return json.dumps(obj, separators=(",", ":"))


async def put_when_gone(receive: Any, out: asyncio.Queue) -> None:
    """Put :data:`GONE` into ``out`` once the client has disconnected (the ASGI messages
    after the body)."""
    while (await receive()).get("type") != "http.disconnect":
        pass
    out.put_nowait(GONE)


class SSEResponse(Response):
    """A ``text/event-stream`` answer that a coroutine writes to the ASGI ``send`` itself
    (``write(receive, send, start)``, ``start`` the ``http.response.start`` message to send
    first): one ``send`` per chunk, with none of ``StreamingResponse``'s layers (an async
    generator per chunk, a task group listening for the disconnect)."""

    media_type = "text/event-stream"

    def __init__(self, write: Any, headers: dict[str, str] | None = None) -> None:
        self.status_code = 200
        self.background = None
        self._write = write
        self.init_headers(headers)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await self._write(receive, send, {"type": "http.response.start",
                                          "status": self.status_code,
                                          "headers": self.raw_headers})


def coalesce(d: Delta, out: asyncio.Queue) -> Any:
    """Append to ``d`` the deltas of the same choice already waiting in ``out`` (they go out
    as one chunk: same text, tokens and finish); returns the first other item taken from
    ``out`` (to handle next), else ``None``."""
    while d.finish_reason is None and not out.empty():
        nxt = out.get_nowait()
        if not isinstance(nxt, Delta) or nxt.index != d.index:
            return nxt
        d.absorb(nxt)
    return None
