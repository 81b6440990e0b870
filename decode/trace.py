"""The decode worker's request spans (:mod:`k3serve.tracing`), under the router's call span
named by the ``traceparent`` of ``/internal/reserve`` (``/generate``, ``/resume``)::

    decode.admission   the reservation → the request admitted into the running batch
                       (its transferred cache arrived, or it was recomputed here)
    decode             admitted → finished; k3serve.completion_tokens

Tracing off: :attr:`DecodeTraces.spans` stays empty; the worker checks it (one truth test)
before each call here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from k3serve import tracing


class DecodeTraces:
    """The spans of the traced requests on one decode worker, by request id.

    :meth:`begin` runs on the event loop (a route handler); :meth:`admitted` and :meth:`end`
    on the engine thread: each request's entry is touched by one thread at a time (the
    engine sees the request only after :meth:`begin` returned).

    Args:
        worker_id: The ``k3serve.worker_id`` attribute of every span.
    """

    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id
        #: request id → [the router's context, the open span]
        self.spans: dict[str, list[Any]] = {}

    def begin(self, rid: str, headers: Mapping[str, str], prompt_tokens: int) -> None:
        """Open ``rid``'s ``decode.admission`` span under the caller's ``traceparent`` (none
        sent: a root span)."""
        parent = tracing.extract(headers)
        span = tracing.start_span("decode.admission", parent, {
            "k3serve.request_id": rid, "k3serve.worker_id": self.worker_id,
            "k3serve.prompt_tokens": prompt_tokens})
        if span is not None:
            self.spans[rid] = [parent, span]

    def admitted(self, rid: str, cached_tokens: int | None = None) -> None:
        """End ``rid``'s ``decode.admission`` span, open its ``decode`` span."""
        entry = self.spans.get(rid)
        if entry is None or entry[1].name != "decode.admission":
            return
        tracing.end_span(entry[1], {"k3serve.cached_tokens": cached_tokens})
        entry[1] = tracing.start_span("decode", entry[0], {
            "k3serve.request_id": rid, "k3serve.worker_id": self.worker_id})

    def end(self, rid: str, completion_tokens: int | None = None,
            error: str | None = None) -> None:
        """End ``rid``'s open span (``error``: the request failed or was aborted)."""
        entry = self.spans.pop(rid, None)
        if entry is not None:
            tracing.end_span(entry[1], {"k3serve.completion_tokens": completion_tokens},
                             error=error)
