"""Router metrics: exposed names exactly as DESIGN.md §6, values and the rolling hit rate."""

from __future__ import annotations

import math

import pytest
from prometheus_client.parser import text_string_to_metric_families

from router.metrics import METRIC_NAMES, HitRateWindow, RouterMetrics


def scrape(m: RouterMetrics) -> dict[str, float]:
    body, ctype = m.render()
    assert ctype.startswith("text/plain")
    out = {}
    for fam in text_string_to_metric_families(body.decode()):
        for s in fam.samples:
            key = s.name + "{" + ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())) + "}"
            out[key] = s.value
    return out


def test_exposed_names_exactly_design_section_6():
    m = RouterMetrics()
    m.add_worker("p0", "prefill")
    m.add_worker("d0", "decode")
    body = m.render()[0].decode()
    names = {line.split("{")[0].split(" ")[0] for line in body.splitlines()
             if line and not line.startswith("#")}
    want = {
        "k3serve:request_prompt_tokens_total",
        "k3serve:request_cached_tokens_total",
        "k3serve:router_predicted_cached_tokens_total",
        "k3serve:router_migrations_total",
        "k3serve:cache_hit_rate",
        "k3serve:num_requests_running",
        "k3serve:num_requests_waiting",
    } | {f"{h}_{sfx}" for h in ("k3serve:time_to_first_token_seconds",
                                "k3serve:inter_token_latency_seconds",
                                "k3serve:e2e_request_latency_seconds")
         for sfx in ("bucket", "sum", "count")}
    assert names == want  # no *_created series either
    assert not any("_total_total" in n for n in names)
    # every documented name is exposed (histograms under their base name's samples)
    for n in METRIC_NAMES:
        assert any(x == n or x.startswith(n + "_") for x in names), n
    types = {line.split()[2]: line.split()[3] for line in body.splitlines()
             if line.startswith("# TYPE")}
    assert types["k3serve:request_prompt_tokens_total"] == "counter"
    assert types["k3serve:cache_hit_rate"] == "gauge"
    assert types["k3serve:time_to_first_token_seconds"] == "histogram"


def test_counts_by_worker_and_source_and_hit_rate():
    now = [1000.0]
    m = RouterMetrics(clock=lambda: now[0])
    m.add_worker("p0", "prefill")
    assert math.isnan(scrape(m)["k3serve:cache_hit_rate{}"])
    m.observe_prefill("p0", 1000, {"local": 896}, predicted_tokens=896)
    now[0] += 200
    # prompts of different lengths: the cluster rate is a ratio of token sums (960 / 4000 =
    # 0.24), not a mean of per-request ratios ((0.896 + 0.021) / 2 ≈ 0.46)
    m.observe_prefill("p1", 3000, {"store": 64, "local": 0}, predicted_tokens=0)
    m.ttft.labels("p0").observe(0.05)
    m.itl.labels("d0").observe(0.01)
    m.e2e.labels("d0").observe(1.2)
    m.waiting.labels("p0").inc()
    m.running.labels("d0").inc(2)
    s = scrape(m)
    assert s["k3serve:request_prompt_tokens_total{worker=p0}"] == 1000
    assert s["k3serve:request_prompt_tokens_total{worker=p1}"] == 3000
    assert s["k3serve:request_cached_tokens_total{source=local,worker=p0}"] == 896
    assert s["k3serve:request_cached_tokens_total{source=store,worker=p0}"] == 0
    assert s["k3serve:request_cached_tokens_total{source=store,worker=p1}"] == 64
    assert s["k3serve:router_predicted_cached_tokens_total{worker=p0}"] == 896
    assert s["k3serve:cache_hit_rate{}"] == pytest.approx(960 / 4000)
    assert s["k3serve:time_to_first_token_seconds_count{worker=p0}"] == 1
    assert s["k3serve:inter_token_latency_seconds_sum{worker=d0}"] == pytest.approx(0.01)
    assert s["k3serve:e2e_request_latency_seconds_count{worker=d0}"] == 1
    assert s["k3serve:num_requests_waiting{worker=p0}"] == 1
    assert s["k3serve:num_requests_running{worker=d0}"] == 2
    now[0] += 150  # the first request leaves the 5-minute window
    assert scrape(m)["k3serve:cache_hit_rate{}"] == pytest.approx(64 / 3000)
    now[0] += 300
    assert math.isnan(scrape(m)["k3serve:cache_hit_rate{}"])
    with pytest.raises(ValueError):
        m.observe_prefill("p0", 10, {"disk": 1}, 0)
    with pytest.raises(ValueError):
        m.observe_prefill("p0", 10, {"local": -1}, 0)


def test_registries_are_independent():
    a, b = RouterMetrics(), RouterMetrics()
    a.observe_prefill("w", 10, {"local": 5}, 5)
    assert "k3serve:request_prompt_tokens_total{worker=w}" not in scrape(b)
    w = HitRateWindow(window_s=10, clock=lambda: 0.0)
    w.add(4, 1)
    assert w.rate() == 0.25
    w.add(96, 0)  # sums of tokens: 1 / 100, not the mean of 1/4 and 0/96
    assert w.rate() == pytest.approx(0.01)
    assert w.totals() == (100, 1)


def test_histogram_buffer_adds_what_direct_observations_would():
    """``HistogramBuffer``: the same buckets, sum and count as observing each value, added
    at the 64th call, a second after the first unadded one, or at ``flush``; nothing
    before."""
    import random

    from prometheus_client import CollectorRegistry

    from router.metrics import ITL_BUCKETS, HistogramBuffer
    from router.metrics import BulkHistogram as Histogram

    reg = CollectorRegistry()
    h = Histogram("t_buf_seconds", "x", ["w"], buckets=ITL_BUCKETS, registry=reg)
    direct, buffered = h.labels("direct"), h.labels("buffered")
    buf = HistogramBuffer(buffered)
    rng = random.Random(3)

    def samples(name: str) -> dict:
        return {(s.name, s.labels.get("le")): s.value for s in next(iter(reg.collect())).samples
                if s.labels.get("w") == name and not s.name.endswith("_created")}

    def both(v: float, n: int, now: float) -> None:
        for _ in range(n):
            direct.observe(v)
        buf.observe_many(v, n, now)

    def same() -> bool:
        got, want = samples("buffered"), samples("direct")
        return got.keys() == want.keys() and all(abs(got[k] - want[k]) < 1e-9 for k in want)

    values = [0.0, 10.0, *ITL_BUCKETS[:-1]]  # the bounds themselves: le is inclusive
    for _ in range(63):
        both(rng.choice([rng.random() * 0.2, *values]), rng.randrange(1, 4), 0.5)
    assert samples("buffered")[("t_buf_seconds_count", None)] == 0  # nothing added yet
    both(0.01, 2, 0.5)  # the 64th call
    assert same()
    both(0.3, 1, 10.0)
    assert not same()
    both(0.3, 1, 11.5)  # a second after the first unadded observation
    assert same()
    both(0.07, 3, 11.6)
    buf.observe_many(0.5, 0, 11.6)  # nothing to note
    buf.flush()
    assert same()
    with pytest.raises(ValueError, match="n"):
        buf.observe_many(0.1, -1, 12.0)
