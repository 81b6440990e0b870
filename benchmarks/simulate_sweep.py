"""Sweep placement policies / knobs through the simulator.

Usage: ``python benchmarks/simulate_sweep.py TRACE [--workers 32] [--store 0] [--policy P ...]
[--set dup_weight=1.0 ...] [--json PATH]``. Prints one line per run: hit / oracle, load
max/mean, TTFT; ``--json`` writes the same rows.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from k3serve.process import (
    input_file,
    nonnegative_float,
    nonnegative_int,
    output_file,
    positive_float,
    positive_int,
)
from router.policies.home import HomeParams
from simulate.config import SimConfig, trace_facts
from simulate.engine import replay
from simulate.traces import load_trace


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace", type=input_file, help="JSONL trace (Mooncake format)")
    ap.add_argument("--workers", type=positive_int, default=32)
    ap.add_argument("--store", type=nonnegative_float, default=0.0)
    ap.add_argument("--fraction", type=positive_float, default=1 / 16)
    ap.add_argument("--policy", nargs="*", default=["cache_aware", "prefix_home"])
    ap.add_argument("--set", nargs="*", default=[], help="HomeParams field=value")
    ap.add_argument("--interval", type=nonnegative_int, default=None)
    ap.add_argument("--json", type=output_file, default=None, help="write the rows here")
    a = ap.parse_args()
    try:
        kw = {k: float(v) for k, v in (s.split("=") for s in a.set)}
        params = HomeParams(**kw)
    except (ValueError, TypeError) as e:
        ap.error(f"--set: expected HomeParams field=number pairs, got {' '.join(a.set)} ({e})")
    reqs = load_trace(a.trace)
    facts = trace_facts(reqs)
    cfg = SimConfig(prefill_workers=a.workers, decode_workers=a.workers,
                    cache_fraction=a.fraction, store_fraction=a.store,
                    store_snapshot_interval=a.interval, params=params)
    print(f"oracle {facts.oracle_hit_rate:.4f} ceiling/oracle "
          f"{facts.snapshot_ceiling / facts.oracle_hit_rate:.4f} {kw}")
    out = {"trace": a.trace, "workers": a.workers, "store": a.store, "fraction": a.fraction,
           "params": kw, "oracle_hit_rate": facts.oracle_hit_rate,
           "snapshot_ceiling": facts.snapshot_ceiling, "rows": []}
    for pol in a.policy:
        t = time.time()
        r = replay(reqs, pol, cfg, facts)
        print(f"  {pol:13s} of-oracle {r.of_oracle:.4f} (store {r.store_hit_rate:.3f}) "
              f"load {r.load_max_over_mean:.3f} ttft p50 {r.ttft_p50_s*1e3:.2f}ms "
              f"p99 {r.ttft_p99_s*1e3:.0f}ms agree {r.agreement:.3f} [{time.time() - t:.1f}s]",
              flush=True)
        out["rows"].append({"policy": pol, "of_oracle": r.of_oracle,
                            "store_hit_rate": r.store_hit_rate,
                            "load_max_over_mean": r.load_max_over_mean,
                            "ttft_p50_s": r.ttft_p50_s, "ttft_p99_s": r.ttft_p99_s,
                            "agreement": r.agreement, "seconds": time.time() - t})
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
