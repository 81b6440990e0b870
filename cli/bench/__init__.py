"""``k3serve bench``: replay a Mooncake-style trace (or a random load) against a live stack
through its OpenAI API and report latency, throughput, goodput and cache hit rates.

::

    workload.py   trace rows → requests (simulate.traces' ONE block-id → tokens mapping), the
                  oracle and snapshot-rule ceilings; or a random prompt-length/rate load
    client.py     send each request at its arrival time (streaming /v1/completions over
                  httpx), time token #1 and every chunk; poll the router's /metrics
    report.py     figures (p50/p90/p99, throughput, goodput, hit rates) → JSON
    plots.py      TTFT / ITL CDFs, hit rate over time vs the oracle, queue depth (PNGs)

Client only: it imports no server package (httpx, tqdm, matplotlib, numpy).
"""

from __future__ import annotations

from cli.bench.client import RequestResult, run_load
from cli.bench.report import summarize
from cli.bench.workload import BenchRequest, random_load, trace_load

__all__ = ["BenchRequest", "RequestResult", "random_load", "run_load", "summarize",
           "trace_load"]
