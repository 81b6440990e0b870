"""Router Prometheus metrics: exactly the router names of DESIGN.md §6.

Exposed families (prometheus-client appends ``_total`` to counters, so counters are declared
without it)::

    k3serve:request_prompt_tokens_total{worker}            counter   prompt tokens placed
    k3serve:request_cached_tokens_total{worker,source}     counter   tokens the prefill worker
                                                                     really reused (local|store)
    k3serve:router_predicted_cached_tokens_total{worker}   counter   tokens the router predicted
    k3serve:cache_hit_rate                                 gauge     cached / prompt tokens over
                                                                     the last 5 minutes
    k3serve:time_to_first_token_seconds{worker}            histogram
    k3serve:inter_token_latency_seconds{worker}            histogram
    k3serve:e2e_request_latency_seconds{worker}            histogram
    k3serve:num_requests_running{worker}                   gauge
    k3serve:num_requests_waiting{worker}                   gauge

``worker`` is the chosen worker of the figure's stage: the prefill worker for prompt, cached,
predicted tokens, TTFT and waiting requests (sent to prefill, token #1 not back yet); the decode
worker for inter-token latency, end-to-end latency and running requests (streaming from
decode). ``k3serve:cache_hit_rate`` is the cluster-wide figure (the dashboard's first panel);
per-worker rates follow from the counters. Each figure is counted here only, so sums never
double. The hit-rate gauge reads NaN while the window holds no request.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from k3serve.prometheus import render as _render

CACHE_SOURCES = ("local", "store")
HIT_RATE_WINDOW_S = 300.0

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
               0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
               60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)

METRIC_NAMES = (
    "k3serve:request_prompt_tokens_total",
    "k3serve:request_cached_tokens_total",
    "k3serve:router_predicted_cached_tokens_total",
    "k3serve:router_migrations_total",
    "k3serve:cache_hit_rate",
    "k3serve:time_to_first_token_seconds",
    "k3serve:inter_token_latency_seconds",
    "k3serve:e2e_request_latency_seconds",
    "k3serve:num_requests_running",
    "k3serve:num_requests_waiting",
)
"""Exposed sample-family names (histograms add ``_bucket``/``_sum``/``_count``)."""


class HitRateWindow:
    """Token hit rate over a sliding time window.

    Args:
        window_s: Window length in seconds.
        clock: Monotonic time source in seconds (injectable for tests).
    """

    def __init__(self, window_s: float = HIT_RATE_WINDOW_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self._clock = clock
        self._events: deque[tuple[float, int, int]] = deque()
        self._prompt = 0
        self._cached = 0

    def add(self, prompt_tokens: int, cached_tokens: int) -> None:
        """Record one request's prompt and actually reused tokens."""
        self._events.append((self._clock(), prompt_tokens, cached_tokens))
        self._prompt += prompt_tokens
        self._cached += cached_tokens

    def rate(self) -> float:
        """Cached / prompt tokens of the requests recorded in the window; NaN if none."""
        horizon = self._clock() - self.window_s
        ev = self._events
        while ev and ev[0][0] < horizon:
            _, p, c = ev.popleft()
            self._prompt -= p
            self._cached -= c
        return self._cached / self._prompt if self._prompt else math.nan


class RouterMetrics:
    """The router's metrics on their own registry (one per app; tests build many).

    Args:
        registry: Registry to register into; a fresh one by default.
        window_s: Window of the ``k3serve:cache_hit_rate`` gauge in seconds.
        clock: Monotonic time source of that window.
    """

    def __init__(self, registry: CollectorRegistry | None = None,
                 window_s: float = HIT_RATE_WINDOW_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.prompt_tokens = Counter(
            "k3serve:request_prompt_tokens", "Prompt tokens of requests, by prefill worker.",
            ["worker"], registry=r)
        self.cached_tokens = Counter(
            "k3serve:request_cached_tokens",
            "Prompt tokens the prefill worker reused from its cache (local) or the store.",
            ["worker", "source"], registry=r)
        self.predicted_cached_tokens = Counter(
            "k3serve:router_predicted_cached_tokens",
            "Prompt tokens the router predicted the prefill worker would reuse.",
            ["worker"], registry=r)
        self.hit_window = HitRateWindow(window_s, clock)
        self.cache_hit_rate = Gauge(
            "k3serve:cache_hit_rate",
            f"Cached / prompt tokens over the last {window_s:g} s (NaN: no request).",
            registry=r)
        self.cache_hit_rate.set_function(self.hit_window.rate)
        self.ttft = Histogram(
            "k3serve:time_to_first_token_seconds", "Time to first token, by prefill worker.",
            ["worker"], buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram(
            "k3serve:inter_token_latency_seconds", "Time between tokens, by decode worker.",
            ["worker"], buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram(
            "k3serve:e2e_request_latency_seconds", "Request latency, by decode worker.",
            ["worker"], buckets=E2E_BUCKETS, registry=r)
        self.running = Gauge(
            "k3serve:num_requests_running", "Requests streaming from a decode worker.",
            ["worker"], registry=r)
        self.waiting = Gauge(
            "k3serve:num_requests_waiting",
            "Requests sent to a prefill worker whose first token is not back yet.",
            ["worker"], registry=r)
        self.migrations = Counter(
            "k3serve:router_migrations",
            "Choices moved to another decode worker after theirs failed mid-stream.",
            registry=r)

    def add_worker(self, worker: str, role: str) -> None:
        """Create a worker's series at zero so dashboards see it before its first request.

        Args:
            worker: Worker label value.
            role: ``"prefill"`` or ``"decode"`` (anything else: both).
        """
        if role != "decode":
            self.prompt_tokens.labels(worker)
            self.predicted_cached_tokens.labels(worker)
            for s in CACHE_SOURCES:
                self.cached_tokens.labels(worker, s)
            self.ttft.labels(worker)
            self.waiting.labels(worker)
        if role != "prefill":
            self.itl.labels(worker)
            self.e2e.labels(worker)
            self.running.labels(worker)

    def observe_prefill(self, worker: str, prompt_tokens: int,
                        cached_tokens: Mapping[str, int], predicted_tokens: int) -> None:
        """Count one prefill's prompt, actual reuse by source and the router's prediction.

        Args:
            worker: The prefill worker that ran it.
            prompt_tokens: Prompt length in tokens.
            cached_tokens: Reused tokens by source (``"local"``, ``"store"``).
            predicted_tokens: The placement's predicted cached tokens.

        Raises:
            ValueError: a source other than local/store, or a negative count.
        """
        if prompt_tokens < 0 or predicted_tokens < 0 or any(v < 0 for v in cached_tokens.values()):
            raise ValueError("token counts must be >= 0")
        bad = set(cached_tokens) - set(CACHE_SOURCES)
        if bad:
            raise ValueError(f"unknown cache source(s) {sorted(bad)}; expected {CACHE_SOURCES}")
        self.prompt_tokens.labels(worker).inc(prompt_tokens)
        for src, n in cached_tokens.items():
            self.cached_tokens.labels(worker, src).inc(n)
        self.predicted_cached_tokens.labels(worker).inc(predicted_tokens)
        self.hit_window.add(prompt_tokens, sum(cached_tokens.values()))

    def render(self) -> tuple[bytes, str]:
        """Return ``(body, content type)`` of the Prometheus text exposition.

        prometheus-client's ``*_created`` timestamp series are left out, so the body names
        exactly the families of DESIGN.md §6.
        """
        return _render(self.registry)
