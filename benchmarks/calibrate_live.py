"""Measure a live stack's prefill cost and write the simulator's calibration file for it.

Starts ``k3serve serve`` (2 prefill + 1 decode workers, k3-tiny on the CPU, ``--block-size``
as the CI slice's), sends prompts of several lengths one at a time (fresh random tokens: no
cache hit), and fits the client-measured TTFT to ``overhead + L / rate`` (least squares over
the medians per length); one long answer gives the decode rate (1 / median ITL). The result is
``simulate/calibration_cpu_k3-tiny_live.json`` (schema docs/calibration.md), the file
``simulate.live`` and ``k3serve simulate --length-scale`` read by default.

    python benchmarks/calibrate_live.py [--block-size 4] [--reps 3] [--out FILE]

TTFT here includes everything a live request pays before token #1 (router, reservation on the
decode worker, the prefill, the transfer of token #1), so ``prefill_overhead_s`` absorbs the
serving overhead. On a shared 2-core box the figures move with the load: the date and the load
average are written into ``source``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> int:
    from cli.bench.client import run_load
    from cli.bench.workload import BenchRequest
    from deploy.launcher import start_stack
    from k3serve.process import output_file, positive_int
    from simulate.calibration import SCHEMA, Calibration
    from simulate.live import LIVE_CALIBRATION

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--block-size", type=positive_int, default=4)
    ap.add_argument("--lengths", type=positive_int, nargs="+", default=[16, 64, 160, 256])
    ap.add_argument("--reps", type=positive_int, default=3)
    ap.add_argument("--out", type=output_file, default=str(LIVE_CALIBRATION))
    args = ap.parse_args()
    if len(set(args.lengths)) < 2:  # the fit's slope needs two prompt lengths
        ap.error(f"--lengths: give two different lengths at least, got {args.lengths}")

    rng = random.Random(0)
    st = start_stack(model="k3-tiny", num_prefill=2, num_decode=1, block_size=args.block_size)
    ttft: dict[int, list[float]] = {n: [] for n in args.lengths}
    try:
        warm = BenchRequest(0.0, [rng.randrange(256) for _ in range(32)], 2)
        run_load(st.url, [warm], progress=False)
        for _ in range(args.reps):
            for n in args.lengths:
                req = BenchRequest(0.0, [rng.randrange(256) for _ in range(n)], 1)
                r = run_load(st.url, [req], progress=False).results[0]
                assert r.ok, r.error
                ttft[n].append(r.ttft)
        long = BenchRequest(0.0, [rng.randrange(256) for _ in range(16)], 32)
        itls = run_load(st.url, [long], progress=False).results[0].itls
    finally:
        st.stop()
    xs = list(args.lengths)
    ys = [statistics.median(ttft[n]) for n in xs]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    slope = max(slope, 1e-6)
    overhead = max(0.0, my - slope * mx)
    decode = 1.0 / statistics.median(itls)
    base = Calibration()
    cal = Calibration(
        model="k3-tiny", device="cpu", prefill_tokens_per_s=round(1.0 / slope, 1),
        prefill_overhead_s=round(overhead, 4), decode_tokens_per_s=round(decode, 2),
        mla_bytes_per_token=base.mla_bytes_per_token, snapshot_bytes=base.snapshot_bytes,
        store_gb_per_s=base.store_gb_per_s, store_latency_s=base.store_latency_s,
        source=(f"benchmarks/calibrate_live.py {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
                f": live 2P+1D k3-tiny stack on this {os.cpu_count()}-core CPU box, block "
                f"{args.block_size}, load average {os.getloadavg()[0]:.1f}; TTFT medians "
                + ", ".join(f"{n} tok {y * 1e3:.0f} ms" for n, y in zip(xs, ys))
                + f"; decode ITL median {statistics.median(itls) * 1e3:.0f} ms; bytes and "
                  "store as the default CPU calibration"))
    Path(args.out).write_text(json.dumps({**cal.to_json(), "schema": SCHEMA}, indent=2) + "\n")
    print(json.dumps(cal.to_json(), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
