"""Snapshot policy trade-off: hit rate vs snapshot interval and size.

For each model's snapshot size (k3-tiny ≈ 1,315 tokens of latents, k3-mini ≈ 2,827, K3 ≈
16,000) and each store-only snapshot interval k, replay the trace under the default policy
with a store of ``--store`` × the working set, and report the hit rate / token oracle, the
store's hit share, its evictions, and the infinite-memory ceiling of the same interval.
``auto`` is the interval the byte arithmetic picks (``auto_store_interval``).

Usage: ``python benchmarks/simulate_snapshots.py TRACE [--store 1] [--intervals 0 4 16 64]``
"""

from __future__ import annotations

import argparse
import json
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from k3serve.process import (
    input_file,
    nonnegative_float,
    nonnegative_int,
    output_file,
    positive_int,
)
from router.policies.home import HomeParams
from router.policies.table import DEFAULT_POLICY
from simulate.calibration import Calibration
from simulate.config import SimConfig, auto_store_interval, trace_facts
from simulate.engine import replay
from simulate.traces import load_trace, snapshot_rule_ceiling

MODELS = {"k3-tiny": (320, 420_864), "k3-mini": (6_912, 19_537_920),
          "k3": (27_648, 16_000 * 27_648)}
_T: dict = {}


def _interval(value: str) -> str:
    """``--intervals``' argparse type: ``auto`` or an integer ≥ 0 (kept as given)."""
    if value != "auto":
        nonnegative_int(value)
    return value


def _job(a):
    trace, model, store, k = a
    if trace not in _T:
        reqs = load_trace(trace)
        _T[trace] = (reqs, trace_facts(reqs))
    reqs, facts = _T[trace]
    bpt, snap = MODELS[model]
    cal = replace(Calibration(), model=model, mla_bytes_per_token=bpt, snapshot_bytes=snap)
    cfg = SimConfig(store_fraction=store, calibration=cal, params=HomeParams())
    auto = auto_store_interval(facts, cfg)
    kk = auto if k == "auto" else int(k)
    r = replay(reqs, DEFAULT_POLICY, replace(cfg, store_snapshot_interval=kk), facts)
    ceil = snapshot_rule_ceiling(reqs, kk) / facts.oracle_hit_rate
    row = {"model": model, "interval": k, "auto_interval": auto, "of_oracle": r.of_oracle,
           "store_share": r.store_hit_rate / r.hit_rate if r.hit_rate else 0.0,
           "store_evictions": r.store_stats.get("evictions", 0), "ceiling_of_oracle": ceil,
           "load_max_over_mean": r.load_max_over_mean}
    return row, (f"| {model} | {k if k != 'auto' else f'auto ({auto})'} | {r.of_oracle:.3f} | "
            f"{r.store_hit_rate / r.hit_rate:.2f} | {r.store_stats.get('evictions', 0)} | "
            f"{ceil:.3f} | {r.load_max_over_mean:.3f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace", type=input_file, help="JSONL trace (Mooncake format)")
    ap.add_argument("--store", type=nonnegative_float, default=1.0)
    ap.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    ap.add_argument("--intervals", nargs="+", type=_interval,
                    default=["0", "auto", "4", "16", "64"],
                    help="store-only snapshot intervals (blocks; auto: from the bytes)")
    ap.add_argument("--jobs", type=positive_int, default=None)
    ap.add_argument("--json", type=output_file, default=None, help="write the rows here")
    a = ap.parse_args()
    print(f"store {a.store:g} × working set, policy {DEFAULT_POLICY}")
    print("| snapshot size | store-only interval (blocks) | hit / oracle | store share | "
          "store evictions | infinite-memory ceiling / oracle | max/mean load |")
    print("|---|---|---|---|---|---|---|")
    jobs = [(a.trace, m, a.store, k) for m in a.models for k in a.intervals]
    rows = []
    with ProcessPoolExecutor(a.jobs) as ex:
        for row, line in ex.map(_job, jobs):
            print(line, flush=True)
            rows.append(row)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"store": a.store, "policy": DEFAULT_POLICY, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
