"""Reports of a simulation: the terminal table, the JSON document, the hit-rate plot."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from simulate.config import PolicyResult, SimConfig, TraceFacts
from simulate.traces import TraceRequest

COLUMNS = ("policy", "hit", "/oracle", "store", "oracle", "snap rule", "TTFT p50 ms",
           "TTFT p99 ms", "max/mean load", "agreement")


def table(results: Sequence[PolicyResult], default: str) -> str:
    """One row per policy: hit rate (share of prompt tokens), its ratio to the token oracle,
    the store's share, the token oracle, the snapshot rule's hit rate (``snap rule``: one
    infinite pool with KDA snapshots at prompt ends and branch points only; interval
    snapshots and the store can pass it), TTFT p50/p99, max/mean
    computed tokens over prefill workers, predicted-vs-actual agreement. ``*`` marks the
    default policy."""
    rows = [COLUMNS]
    for r in results:
        rows.append((
            r.policy + (" *" if r.policy == default else ""),
            f"{r.hit_rate:.4f}", f"{r.of_oracle:.3f}", f"{r.store_hit_rate:.4f}",
            f"{r.oracle_hit_rate:.4f}", f"{r.snapshot_ceiling:.4f}",
            f"{r.ttft_p50_s * 1e3:.2f}", f"{r.ttft_p99_s * 1e3:.1f}",
            f"{r.load_max_over_mean:.3f}", f"{r.agreement:.4f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    lines = []
    for k, row in enumerate(rows):
        lines.append("  ".join(c.ljust(widths[i]) if i == 0 else c.rjust(widths[i])
                               for i, c in enumerate(row)))
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def to_json(results: Sequence[PolicyResult], default: str, cfg: SimConfig, facts: TraceFacts,
            trace: str | None = None) -> dict[str, Any]:
    """The ``--json`` document: ``{"trace", "setup", "policies": [...]}``.

    Each policy object has at least ``policy``, ``default`` (true on the default policy
    only), ``hit_rate``, ``oracle_hit_rate``, ``ttft_p50_s``, ``ttft_p99_s``,
    ``load_max_over_mean`` (docs/calibration.md lists every key).
    """
    setup = {
        "prefill_workers": cfg.prefill_workers, "decode_workers": cfg.decode_workers,
        "cache_fraction": cfg.cache_fraction, "load": cfg.load,
        "store_fraction": cfg.store_fraction, "poll_s": cfg.poll_s,
        "block_size": facts.block_size, "requests": facts.num_requests,
        "prompt_tokens": facts.total_tokens, "working_blocks": facts.working_blocks,
        "working_snapshots": facts.working_snapshots,
        "calibration": cfg.calibration.to_json(),
    }
    pols = []
    for r in results:
        pols.append({
            "policy": r.policy, "default": r.policy == default,
            "hit_rate": r.hit_rate, "hit_over_oracle": r.of_oracle,
            "local_hit_rate": r.local_hit_rate, "store_hit_rate": r.store_hit_rate,
            "oracle_hit_rate": r.oracle_hit_rate, "snapshot_ceiling": r.snapshot_ceiling,
            "ttft_p50_s": r.ttft_p50_s, "ttft_p99_s": r.ttft_p99_s,
            "ttft_mean_s": r.ttft_mean_s, "load_max_over_mean": r.load_max_over_mean,
            "load_tokens": list(r.load), "predicted_cached_tokens": r.predicted,
            "actual_cached_tokens": r.actual, "agreement": r.agreement,
            "decode_max_over_mean": r.decode_max_over_mean,
            "store_snapshot_interval_blocks": r.store_interval, "store": r.store_stats,
        })
    return {"trace": trace, "setup": setup, "oracle_hit_rate": facts.oracle_hit_rate,
            "snapshot_ceiling": facts.snapshot_ceiling, "policies": pols}


def write_json(doc: dict[str, Any], path: str | Path) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(doc, indent=2) + "\n")
    return p


def plot(results: Sequence[PolicyResult], reqs: Sequence[TraceRequest], facts: TraceFacts,
         path: str | Path, bins: int = 60, default: str | None = None) -> Path:
    """PNG of the hit rate over (rescaled) time per policy vs the token oracle.

    Each point is reused / prompt tokens over the requests arriving in one of ``bins``
    equal time windows.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arr = results[0].arrivals
    t0, t1 = arr[0], arr[-1]
    width = (t1 - t0) / bins or 1.0
    idx = [min(bins - 1, int((a - t0) / width)) for a in arr]
    tot = [0] * bins
    for i, r in zip(idx, reqs, strict=True):
        tot[i] += r.num_tokens
    xs = [t0 + (b + 0.5) * width for b in range(bins)]

    def series(hits: Sequence[int]) -> list[float]:
        acc = [0] * bins
        for i, h in zip(idx, hits, strict=True):
            acc[i] += h
        return [a / t if t else float("nan") for a, t in zip(acc, tot, strict=True)]

    fig, ax = plt.subplots(figsize=(9, 4.5), dpi=110)
    ax.plot(xs, series(facts.oracle_hits), "k--", lw=1.5, label="token oracle")
    for r in results:
        lw = 2.2 if r.policy == default else 1.0
        ax.plot(xs, series(r.hits), lw=lw, label=r.policy + (" (default)" if r.policy == default
                                                             else ""))
    ax.set_xlabel("simulated time (s)")
    ax.set_ylabel("hit rate (reused / prompt tokens)")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=2, loc="lower right")
    fig.tight_layout()
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(p)
    plt.close(fig)
    return p
