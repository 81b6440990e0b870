"""Figures of a finished run (:class:`~cli.bench.client.RunOutcome`) as one flat dict.

* latency: TTFT (send → token #1), ITL (gap between successive chunks; one engine step each),
  TPOT (a request's (e2e − TTFT) / (tokens − 1)), e2e; p50 / p90 / p99 in seconds;
* ``itl_p99_during_prefill_s``: ITL gaps that overlap another request's prefill (sent, no
  token #1 yet) — the interference disaggregation is meant to remove;
* throughput: requests/s and output tokens/s over the run;
* goodput: requests/s that met both SLOs (TTFT ≤ ``slo_ttft`` and TPOT ≤ ``slo_itl``;
  an SLO left ``None`` always holds) and the fraction that did;
* hit rates: actual = Σ cached_tokens / Σ prompt_tokens (usage), predicted = the router's
  ``k3serve:router_predicted_cached_tokens_total`` delta / its prompt-token delta, the
  trace's token oracle and snapshot-rule ceiling (from the workload);
* ``server_*``: the router's counter deltas, for checking the client's figures against.
"""

from __future__ import annotations

import bisect
import itertools

import numpy as np

from cli.bench.client import RunOutcome
from cli.bench.workload import Workload

COUNTERS = {
    "server_prompt_tokens": "k3serve:request_prompt_tokens_total",
    "server_cached_tokens": "k3serve:request_cached_tokens_total",
    "server_predicted_cached_tokens": "k3serve:router_predicted_cached_tokens_total",
    "server_ttft_count": "k3serve:time_to_first_token_seconds_count",
    "server_itl_count": "k3serve:inter_token_latency_seconds_count",
    "server_e2e_count": "k3serve:e2e_request_latency_seconds_count",
}


def _pcts(prefix: str, xs: list[float], out: dict) -> None:
    for q in (50, 90, 99):
        out[f"{prefix}_p{q}_s"] = float(np.percentile(xs, q)) if xs else None
    out[f"{prefix}_mean_s"] = float(np.mean(xs)) if xs else None


def _during_prefill(run: RunOutcome) -> list[float]:
    """ITL gaps (a, b] of one request that overlap another request's [sent, first token)."""
    spans = sorted((r.sent_s, r.first_s if r.first_s is not None else r.done_s, id(r))
                   for r in run.results)
    starts = [s[0] for s in spans]
    out = []
    for r in run.results:
        if not r.ok:
            continue
        ts = [r.first_s, *r.chunk_s]
        for a, b in itertools.pairwise(ts):
            hi = bisect.bisect_left(starts, b)
            if any(e > a and k != id(r) for _, e, k in spans[:hi]):
                out.append(b - a)
    return out


def summarize(run: RunOutcome, work: Workload, *, slo_ttft: float | None = None,
              slo_itl: float | None = None) -> dict:
    """All figures of ``run`` (see the module docstring); times in seconds."""
    ok = [r for r in run.results if r.ok]
    out: dict = {"num_requests": len(ok), "num_failed": len(run.results) - len(ok),
                 "num_skipped": work.num_skipped, "duration_s": run.duration_s}
    _pcts("ttft", [r.ttft for r in ok], out)
    _pcts("itl", [g for r in ok for g in r.itls], out)
    tpot = [(r.done_s - r.first_s) / (r.completion_tokens - 1) for r in ok
            if r.completion_tokens > 1]
    _pcts("tpot", tpot, out)
    _pcts("e2e", [r.done_s - r.sent_s for r in ok], out)
    dur = [r for r in ok]
    in_pf = _during_prefill(run)
    out["itl_p99_during_prefill_s"] = float(np.percentile(in_pf, 99)) if in_pf else None
    out["itl_during_prefill_count"] = len(in_pf)
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    out_tokens = sum(r.completion_tokens for r in ok)
    out.update(
        prompt_tokens=prompt, cached_tokens=cached, output_tokens=out_tokens,
        requested_output_tokens=sum(r.max_tokens for r in ok),
        request_throughput=len(ok) / run.duration_s if run.duration_s else 0.0,
        output_tokens_per_s=out_tokens / run.duration_s if run.duration_s else 0.0,
        input_tokens_per_s=prompt / run.duration_s if run.duration_s else 0.0)

    def good(r) -> bool:
        t = (r.done_s - r.first_s) / (r.completion_tokens - 1) if r.completion_tokens > 1 else 0
        return (slo_ttft is None or r.ttft <= slo_ttft) and (slo_itl is None or t <= slo_itl)

    n_good = sum(1 for r in dur if good(r))
    out.update(slo_ttft_s=slo_ttft, slo_itl_s=slo_itl, num_good=n_good,
               goodput=n_good / run.duration_s if run.duration_s else 0.0,
               goodput_fraction=n_good / len(ok) if ok else 0.0)
    for k, name in COUNTERS.items():
        out[k] = run.metrics_after.get(name, 0.0) - run.metrics_before.get(name, 0.0)
    sp = out["server_prompt_tokens"]
    out["hit_rate"] = cached / prompt if prompt else 0.0
    out["predicted_hit_rate"] = out["server_predicted_cached_tokens"] / sp if sp else 0.0
    out["oracle_hit_rate"] = work.oracle_hit_rate
    out["snapshot_rule_ceiling"] = work.snapshot_ceiling
    out["errors"] = sorted({r.error for r in run.results if r.error})[:5]
    return out


#: The figures ``k3serve bench`` prints, each with its unit (hit rates print as percent).
SUMMARY = (
    ("num_requests", "requests"), ("num_failed", "requests"), ("num_skipped", "trace rows"),
    ("ttft_p50_s", "s"), ("ttft_p99_s", "s"), ("itl_p50_s", "s"), ("itl_p99_s", "s"),
    ("e2e_p50_s", "s"), ("output_tokens_per_s", "tokens/s"), ("goodput", "requests/s"),
    ("hit_rate", "%"), ("predicted_hit_rate", "%"), ("oracle_hit_rate", "%"),
    ("snapshot_rule_ceiling", "%"),
)

#: Why a figure can be missing: the trace ceilings on a random load, latencies with no
#: finished request.
NOT_AVAILABLE = {
    "oracle_hit_rate": "n/a (random load: no trace oracle)",
    "snapshot_rule_ceiling": "n/a (random load: no trace oracle)",
}


def format_summary(rep: dict) -> list[str]:
    """The lines ``k3serve bench`` prints for ``rep`` (:func:`summarize`): one figure per line
    with its unit; a figure that does not exist for this run says ``n/a`` and why."""
    lines = []
    for key, unit in SUMMARY:
        v = rep[key]
        if v is None:
            text = NOT_AVAILABLE.get(key, "n/a (no request finished)")
        elif unit == "%":
            text = f"{100 * v:.2f} %"
        elif isinstance(v, float):
            text = f"{v:.4f} {unit}"
        else:
            text = f"{v} {unit}"
        lines.append(f"{key:24s} {text}")
    return lines


__all__ = ["COUNTERS", "NOT_AVAILABLE", "SUMMARY", "format_summary", "summarize"]
