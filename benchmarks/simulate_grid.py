"""Run a grid of (trace, store fraction, policy, prefix_home knobs) through the simulator in
parallel processes; one line per run (for choosing the default policy's knobs).

Usage: ``python benchmarks/simulate_grid.py --traces A B --store 0 1 --policy P ...
[--grid "dup_weight=1,3;ext_weight=0,1"] [--jobs N]``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from k3serve.process import input_file, nonnegative_float, output_file, positive_int
from router.policies.home import HomeParams
from simulate.config import SimConfig, trace_facts
from simulate.engine import replay
from simulate.traces import load_trace

_T: dict = {}


def _job(args):
    trace, store, policy, kw = args
    if trace not in _T:
        reqs = load_trace(trace)
        _T[trace] = (reqs, trace_facts(reqs))
    reqs, facts = _T[trace]
    t = time.time()
    r = replay(reqs, policy, SimConfig(store_fraction=store, params=HomeParams(**kw)), facts)
    row = {"trace": trace, "store": store, "policy": policy, "params": kw,
           "of_oracle": r.of_oracle, "load_max_over_mean": r.load_max_over_mean,
           "ttft_p50_s": r.ttft_p50_s, "ttft_p99_s": r.ttft_p99_s, "ttft_mean_s": r.ttft_mean_s,
           "seconds": time.time() - t}
    return row, (f"{Path(trace).stem[:12]:12s} S={store:g} {policy:12s} {kw} of-oracle "
                 f"{r.of_oracle:.4f} load {r.load_max_over_mean:.3f} "
                 f"p50 {r.ttft_p50_s * 1e3:.2f}ms p99 {r.ttft_p99_s * 1e3:.0f}ms "
                 f"mean {r.ttft_mean_s * 1e3:.1f}ms [{row['seconds']:.0f}s]")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", nargs="+", type=input_file, required=True,
                    help="JSONL traces (Mooncake format)")
    ap.add_argument("--store", nargs="+", type=nonnegative_float, default=[0.0])
    ap.add_argument("--policy", nargs="+", default=["prefix_home"])
    ap.add_argument("--grid", default="", help='"field=v1,v2;field2=v3"')
    ap.add_argument("--jobs", type=positive_int, default=None)
    ap.add_argument("--json", type=output_file, default=None, help="write the rows here")
    a = ap.parse_args()
    try:
        axes = [(k, [float(x) for x in v.split(",")])
                for k, v in (g.split("=") for g in a.grid.split(";") if g)]
        kws = [dict(zip([k for k, _ in axes], vals, strict=True))
               for vals in itertools.product(*[v for _, v in axes])] or [{}]
        for kw in kws:
            HomeParams(**kw)
    except (ValueError, TypeError) as e:
        ap.error(f"--grid: expected \"field=v1,v2;field2=v3\" of HomeParams fields, got "
                 f"{a.grid!r} ({e})")
    jobs = []
    for tr, s, p in itertools.product(a.traces, a.store, a.policy):
        for kw in (kws if p == "prefix_home" else [{}]):
            jobs.append((tr, s, p, kw))
    rows = []
    with ProcessPoolExecutor(a.jobs) as ex:
        for row, line in ex.map(_job, jobs):
            print(line, flush=True)
            rows.append(row)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
