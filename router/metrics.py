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
    k3serve:spec_*_total                                   counters  the decode workers'
                                                                     speculative-decoding totals
                                                                     (router/spec_metrics.py)

``worker`` is the chosen worker of the figure's stage: the prefill worker for prompt, cached,
predicted tokens, TTFT and waiting requests (sent to prefill, token #1 not back yet); the decode
worker for inter-token latency, end-to-end latency and running requests (streaming from
decode). ``k3serve:cache_hit_rate`` is the cluster-wide figure (the dashboard's first panel);
per-worker rates follow from the counters. Each figure is counted here only, so sums never
double. The hit-rate gauge reads NaN while the window holds no request.

Router replicas (``--replicas N``, :mod:`router.replicas`) run prometheus-client's
multiprocess mode (``multiprocess_dir``): every replica writes its samples to files in one
folder and ``GET /metrics`` of ANY replica answers the sum over all of them (counters and
histograms summed, the two gauges summed over live replicas), so one scrape of the router's
address is the whole router. The hit-rate gauge is then Σ cached / Σ prompt tokens of every
replica's window (each replica publishes its window sums, refreshed every second).
"""

from __future__ import annotations

import bisect
import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric

from k3serve.prometheus import render as _render
from router.spec_metrics import ReportingWorker, SpecTotals

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

    def totals(self) -> tuple[int, int]:
        """(prompt, cached) tokens of the requests recorded in the window."""
        horizon = self._clock() - self.window_s
        ev = self._events
        while ev and ev[0][0] < horizon:
            _, p, c = ev.popleft()
            self._prompt -= p
            self._cached -= c
        return self._prompt, self._cached

    def rate(self) -> float:
        """Cached / prompt tokens of the requests recorded in the window; NaN if none."""
        prompt, cached = self.totals()
        return cached / prompt if prompt else math.nan


class BulkHistogram(Histogram):
    """prometheus-client's ``Histogram`` whose series also take observations in bulk
    (:meth:`add`): one update of the buckets and the sum instead of one per observation.
    ``labels(...)`` gives series of this class too."""

    @property
    def upper_bounds(self) -> list[float]:
        """The buckets' upper bounds (``le``), ascending, ``+Inf`` last."""
        return self._upper_bounds

    def add(self, total: float, counts: Sequence[int]) -> None:
        """Add ``counts[i]`` observations to bucket ``i`` (as :attr:`upper_bounds`) and
        ``total`` to the sum (a series, ``labels(...)``)."""
        self._sum.inc(total)
        for bucket, c in zip(self._buckets, counts, strict=True):
            if c:
                bucket.inc(c)


def observe_many(child, value: float, n: int) -> None:
    """``n`` observations of ``value`` in a labelled histogram (``Histogram.labels(...)``):
    one update of the bucket, count and sum instead of ``n`` for a :class:`BulkHistogram`
    series (the relay observes every token of an event at once).

    Raises:
        ValueError: ``n`` < 0.
    """
    if n < 0:
        raise ValueError("n: must be >= 0")
    if n == 1:
        child.observe(value)
        return
    if not n:
        return
    if not isinstance(child, BulkHistogram):  # a plain series: the plain way
        for _ in range(n):
            child.observe(value)
        return
    bounds = child.upper_bounds
    counts = [0] * len(bounds)
    counts[bisect.bisect_left(bounds, value)] = n
    child.add(value * n, counts)


class HistogramBuffer:
    """Observations of one labelled histogram series (``Histogram.labels(...)``) counted
    here, per bucket, and added to the series in one update every ``every`` calls of
    :meth:`observe_many` or ``every_s`` seconds, and at :meth:`flush`: the relay observes the
    inter-token latency of every network read of every stream, and each prometheus-client
    update takes a lock and scans the buckets. A series that is not a :class:`BulkHistogram`'s
    is observed directly.

    Args:
        child: the labelled series.
        every / every_s: flush after this many calls, or this many seconds since the last
            flush (``now`` as :meth:`observe_many` is given it: ``time.monotonic()``).
    """

    def __init__(self, child, every: int = 64, every_s: float = 1.0) -> None:
        self.child = child
        self._every, self._every_s = every, every_s
        self._bounds = child.upper_bounds if isinstance(child, BulkHistogram) else None
        self._counts = [0] * len(self._bounds) if self._bounds is not None else []
        self._sum = 0.0
        self._calls = 0
        self._since: float | None = None

    def observe_many(self, value: float, n: int, now: float) -> None:
        """``n`` observations of ``value`` (seconds), noted at ``now`` (monotonic s).

        Raises:
            ValueError: ``n`` < 0.
        """
        if n <= 0:
            if n < 0:
                raise ValueError("n: must be >= 0")
            return
        if self._bounds is None:
            observe_many(self.child, value, n)
            return
        self._counts[bisect.bisect_left(self._bounds, value)] += n
        self._sum += value * n
        self._calls += 1
        if self._since is None:
            self._since = now
        elif self._calls >= self._every or now - self._since >= self._every_s:
            self.flush()

    def flush(self) -> None:
        """Add what was counted to the series."""
        if not self._calls:
            return
        self.child.add(self._sum, self._counts)
        self._counts = [0] * len(self._counts)
        self._sum, self._calls, self._since = 0.0, 0, None


#: Hidden per-replica gauges (multiprocess mode): one replica's hit-rate window sums.
_WINDOW_PROMPT = "k3serve:router_window_prompt_tokens"
_WINDOW_CACHED = "k3serve:router_window_cached_tokens"


class _ReplicasCollector:
    """Multiprocess mode: every replica's samples, summed, and the cluster hit rate from the
    replicas' window sums (the two hidden gauges are not exposed)."""

    def __init__(self, path: str, window_s: float) -> None:
        from prometheus_client.multiprocess import MultiProcessCollector

        self._mp = MultiProcessCollector(None, path=path)
        self._doc = f"Cached / prompt tokens over the last {window_s:g} s (NaN: no request)."

    def collect(self) -> Iterator[Metric]:
        sums = {_WINDOW_PROMPT: 0.0, _WINDOW_CACHED: 0.0}
        for fam in self._mp.collect():
            if fam.name in sums:
                sums[fam.name] = sum(s.value for s in fam.samples)
                continue
            yield fam
        prompt, cached = sums[_WINDOW_PROMPT], sums[_WINDOW_CACHED]
        yield GaugeMetricFamily("k3serve:cache_hit_rate", self._doc,
                                value=cached / prompt if prompt else math.nan)


class RouterMetrics:
    """The router's metrics on their own registry (one per app; tests build many).

    Args:
        registry: Registry to register into; a fresh one by default.
        window_s: Window of the ``k3serve:cache_hit_rate`` gauge in seconds.
        clock: Monotonic time source of that window.
        multiprocess_dir: prometheus-client's multiprocess folder (router replicas; the
            process must run with ``PROMETHEUS_MULTIPROC_DIR`` set to it from its start):
            :meth:`render` then answers the sum over every replica.
    """

    def __init__(self, registry: CollectorRegistry | None = None,
                 window_s: float = HIT_RATE_WINDOW_S,
                 clock: Callable[[], float] = time.monotonic,
                 multiprocess_dir: str | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.multiprocess_dir = multiprocess_dir
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
        if multiprocess_dir is None:
            self.cache_hit_rate = Gauge(
                "k3serve:cache_hit_rate",
                f"Cached / prompt tokens over the last {window_s:g} s (NaN: no request).",
                registry=r)
            self.cache_hit_rate.set_function(self.hit_window.rate)
        else:
            self._window = (
                Gauge(_WINDOW_PROMPT, "This replica's hit-rate window: prompt tokens.",
                      registry=None, multiprocess_mode="livesum"),
                Gauge(_WINDOW_CACHED, "This replica's hit-rate window: cached tokens.",
                      registry=None, multiprocess_mode="livesum"))
            self._render_registry = CollectorRegistry()
            self._render_registry.register(_ReplicasCollector(multiprocess_dir, window_s))
        self.ttft = BulkHistogram(
            "k3serve:time_to_first_token_seconds", "Time to first token, by prefill worker.",
            ["worker"], buckets=TTFT_BUCKETS, registry=r)
        self.itl = BulkHistogram(
            "k3serve:inter_token_latency_seconds", "Time between tokens, by decode worker.",
            ["worker"], buckets=ITL_BUCKETS, registry=r)
        self.e2e = BulkHistogram(
            "k3serve:e2e_request_latency_seconds", "Request latency, by decode worker.",
            ["worker"], buckets=E2E_BUCKETS, registry=r)
        self.running = Gauge(
            "k3serve:num_requests_running", "Requests streaming from a decode worker.",
            ["worker"], registry=r, multiprocess_mode="livesum")
        self.waiting = Gauge(
            "k3serve:num_requests_waiting",
            "Requests sent to a prefill worker whose first token is not back yet.",
            ["worker"], registry=r, multiprocess_mode="livesum")
        self.migrations = Counter(
            "k3serve:router_migrations",
            "Choices moved to another decode worker after theirs failed mid-stream.",
            registry=r)

    def add_spec_totals(self, workers: Callable[[], Iterable[ReportingWorker]]) -> SpecTotals:
        """Expose the cluster totals of the workers' speculative-decoding counters, read from
        their load reports at every scrape (:mod:`router.spec_metrics`; in multiprocess mode
        this replica's view, not summed over replicas).

        Args:
            workers: the registered workers now.
        """
        totals = SpecTotals(workers)
        self.registry.register(totals)
        if self.multiprocess_dir is not None:
            self._render_registry.register(totals)
        return totals

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
        self.refresh_window()

    def refresh_window(self) -> None:
        """Multiprocess mode: publish this replica's window sums (expired requests dropped);
        a no-op otherwise. The replicas call it every second and on every prefill."""
        if self.multiprocess_dir is None:
            return
        prompt, cached = self.hit_window.totals()
        self._window[0].set(prompt)
        self._window[1].set(cached)

    def render(self) -> tuple[bytes, str]:
        """Return ``(body, content type)`` of the Prometheus text exposition.

        prometheus-client's ``*_created`` timestamp series are left out, so the body names
        exactly the families of DESIGN.md §6. Multiprocess mode: the sum over every replica.
        """
        if self.multiprocess_dir is not None:
            self.refresh_window()
            return _render(self._render_registry)
        return _render(self.registry)
