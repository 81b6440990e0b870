"""Request tracing: OpenTelemetry spans exported over OTLP/HTTP, W3C trace context on the wire.

One trace per client request spans the router, the prefill worker, the KV transfer and the
decode worker. Each process calls :func:`configure` once at start with its service name and the
``--otlp-traces-endpoint`` it was given; without an endpoint every function here returns at its
first line (``None`` spans, no header written), and the ``opentelemetry`` packages are never
imported — tracing off costs one global read per call site.

The context crosses processes in the ``traceparent`` header of the internal HTTP calls
(W3C Trace Context, https://www.w3.org/TR/trace-context/): the router injects it into
``/internal/prefill``, ``/internal/reserve`` and the decode stream calls; a worker extracts it
and parents its spans on it. Spans are started and ended explicitly (:func:`start_span`,
:func:`end_span`), so a span may begin on an HTTP handler and end on the engine thread.

Attribute names used by the project (all optional, set where the value is known):

======================  =============================================================
``k3serve.request_id``  the router's request id
``k3serve.worker_id``   the worker that ran the span's work
``k3serve.prompt_tokens`` / ``k3serve.completion_tokens`` / ``k3serve.cached_tokens``
``k3serve.bytes``       bytes moved by a KV transfer
======================  =============================================================
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, MutableMapping
from typing import Any

TRACEPARENT = "traceparent"
#: Seconds one OTLP export may take (then the batch is dropped).
EXPORT_TIMEOUT_S = 2.0
#: The environment variable OpenTelemetry SDKs (and vLLM) read for the OTLP traces endpoint:
#: the default of ``--otlp-traces-endpoint`` on the router and the workers.
ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
TRACESTATE = "tracestate"

_lock = threading.Lock()
_tracer: Any = None  # opentelemetry.trace.Tracer once configured with an endpoint
_provider: Any = None
_propagator: Any = None


def check_endpoint(endpoint: str | None) -> str | None:
    """``endpoint`` as :func:`configure` exports to: ``None`` for none (``None`` or ``""``),
    ``/v1/traces`` appended to a bare ``scheme://host[:port]``.

    Raises:
        ValueError: ``endpoint`` is not an http(s) URL with a host, a numeric port (if any), no
            query, fragment or whitespace (the flag and the value, one line).
    """
    from urllib.parse import urlsplit

    if not endpoint:
        return None
    try:
        u = urlsplit(endpoint)
        ok = (u.scheme.lower() in ("http", "https") and bool(u.hostname) and not u.query
              and not u.fragment and not any(c.isspace() for c in endpoint))
        u.port  # noqa: B018 - raises ValueError on a port that is not a number in range
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(f"--otlp-traces-endpoint / ${ENDPOINT_ENV}: expected an http(s) URL "
                         f"such as http://127.0.0.1:4318, got {endpoint!r}")
    if u.path.strip("/") == "":  # scheme://host[:port] alone
        return endpoint.rstrip("/") + "/v1/traces"
    return endpoint


def configure(service: str, endpoint: str | None) -> bool:
    """Start exporting this process's spans to ``endpoint`` (an OTLP/HTTP traces URL, e.g.
    ``http://127.0.0.1:4318/v1/traces``; a bare ``http://host:port`` gets ``/v1/traces``).

    Args:
        service: the ``service.name`` resource attribute (``k3serve-router``, ...).
        endpoint: where to export; ``None`` or ``""`` leaves tracing off.

    Returns:
        Whether tracing is on.

    Raises:
        ValueError: ``endpoint`` is not an http(s) URL.
    """
    global _tracer, _provider, _propagator
    endpoint = check_endpoint(endpoint)
    if endpoint is None:
        return False
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    with _lock:
        if _provider is not None:
            _provider.shutdown()
        provider = TracerProvider(resource=Resource.create({"service.name": service}))
        # bounded export: a collector that accepts and never answers delays neither serving
        # (the batch is exported off the request path) nor shutdown by more than ~2 s
        provider.add_span_processor(BatchSpanProcessor(
            OTLPSpanExporter(endpoint=endpoint, timeout=EXPORT_TIMEOUT_S),
            schedule_delay_millis=200, export_timeout_millis=int(EXPORT_TIMEOUT_S * 1000)))
        _provider = provider
        _tracer = provider.get_tracer("k3serve")
        _propagator = TraceContextTextMapPropagator()
    return True


def enabled() -> bool:
    return _tracer is not None


def shutdown() -> None:
    """Flush and stop the exporter (at process exit); a no-op when tracing is off."""
    global _tracer, _provider
    with _lock:
        if _provider is not None:
            _provider.shutdown()
        _tracer = _provider = None


def extract(headers: Mapping[str, str] | None) -> Any:
    """The remote parent context carried by ``headers`` (``None`` when off or absent)."""
    if _tracer is None or not headers:
        return None
    carrier = {k.lower(): v for k, v in headers.items()
               if k.lower() in (TRACEPARENT, TRACESTATE)}
    if TRACEPARENT not in carrier:
        return None
    return _propagator.extract(carrier)


def start_span(name: str, parent: Any = None, attributes: Mapping[str, Any] | None = None,
               ) -> Any:
    """A started span (``None`` when tracing is off).

    Args:
        name: span name (``router.request``, ``prefill``, ``kv.transfer``, ...).
        parent: a span from :func:`start_span`, a context from :func:`extract`, or ``None``
            for a root span.
        attributes: initial attributes; ``None`` values are dropped.
    """
    if _tracer is None:
        return None
    from opentelemetry import trace

    if parent is not None and hasattr(parent, "get_span_context"):
        parent = trace.set_span_in_context(parent)
    span = _tracer.start_span(name, context=parent)
    if attributes:
        set_attributes(span, attributes)
    return span


def set_attributes(span: Any, attributes: Mapping[str, Any]) -> None:
    """Set ``attributes`` on ``span`` (nothing when ``span`` is ``None``; ``None`` values
    dropped)."""
    if span is None:
        return
    for k, v in attributes.items():
        if v is not None:
            span.set_attribute(k, v)


def end_span(span: Any, attributes: Mapping[str, Any] | None = None,
             error: str | None = None) -> None:
    """Set the last ``attributes``, mark ``error`` (a message) if given, and end ``span``."""
    if span is None:
        return
    if attributes:
        set_attributes(span, attributes)
    if error:
        from opentelemetry.trace import Status, StatusCode

        span.set_status(Status(StatusCode.ERROR, error))
    span.end()


def inject(span: Any, headers: MutableMapping[str, str]) -> MutableMapping[str, str]:
    """Write ``span``'s context into ``headers`` as ``traceparent`` (no-op when ``span`` is
    ``None``); returns ``headers``."""
    if span is None:
        return headers
    from opentelemetry import trace

    _propagator.inject(headers, context=trace.set_span_in_context(span))
    return headers
