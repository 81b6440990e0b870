"""The router's request spans (:mod:`k3serve.tracing`): the request's root span travels in a
context variable, so the tasks a request starts (:meth:`router.pipeline.Router.execute`: they
copy the context) and the calls they make (:mod:`router.client`) find it without an argument.

Tracing off: :data:`REQUEST` stays ``None`` and every function here returns at its first
check — no span, no header, no allocation per request or per token.

Span tree of one request (router side; the workers' spans hang under the call spans)::

    router.request                       k3serve.request_id, prompt / completion tokens
    ├── router.admission                 the capacity check (429 past it)
    ├── router.queue                     a choice waiting for a decode slot
    ├── router.placement                 k3serve.prefill_worker_id, k3serve.decode_worker_id,
    │                                    k3serve.cached_tokens (predicted)
    ├── router.reserve / router.prefill / router.generate / router.resume / router.attach
    │                                    one internal call, k3serve.worker_id; ``traceparent``
    │                                    names it to the worker
    └── router.stream                    token #1 out → the body's end, completion tokens
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Any

from k3serve import tracing

#: The root span of the request this task serves (``None``: tracing off, or no request).
REQUEST: ContextVar[Any] = ContextVar("k3serve_request_span", default=None)

#: Span names of the internal calls, by path.
CALL_SPANS = {"/internal/reserve": "router.reserve", "/internal/prefill": "router.prefill",
              "/internal/generate": "router.generate", "/internal/resume": "router.resume",
              "/internal/attach": "router.attach"}


def child(name: str, attributes: dict[str, Any] | None = None) -> Any:
    """A started child of this task's request span (``None`` when there is none)."""
    parent = REQUEST.get()
    if parent is None:
        return None
    return tracing.start_span(name, parent, attributes)


def call_span(path: str, worker: Any) -> Any:
    """The span of one internal call to ``worker`` (a :class:`router.workers.Worker`;
    ``None`` when tracing is off)."""
    parent = REQUEST.get()
    if parent is None:
        return None
    return tracing.start_span(CALL_SPANS.get(path, "router.call"), parent,
                              {"k3serve.worker_id": worker.name, "http.route": path})


def placed(span: Any, placement: Any, prefill: Any, decode: Any) -> None:
    """End a ``router.placement`` span with the chosen workers and the predicted cached
    tokens (``placement``: a :class:`router.placement.Placement`)."""
    if span is None:
        return
    tracing.end_span(span, {"k3serve.prefill_worker_id": prefill.name,
                            "k3serve.decode_worker_id": decode.name,
                            "k3serve.cached_tokens": placement.predicted_cached_tokens})


def headers(span: Any) -> dict[str, str] | None:
    """``{"traceparent": ...}`` naming ``span`` (``None`` when ``span`` is)."""
    if span is None:
        return None
    return tracing.inject(span, {})
