"""PD vs monolithic on one machine, one run: the same trace slice against
(a) 2 prefill + 1 decode and (b) 3 monolithic workers (``k3serve serve --monolithic 3``).

Prints a dated markdown table (ITL p99 during prefill bursts, TTFT p50/p99, goodput, hit
rate) and writes ``--out`` JSON (and, with ``--plots``, the CDFs of both runs side by side).
The stacks run one after the other (2 CPU cores cannot host both at once fairly).

    PYTHONPATH=. python benchmarks/pd_vs_monolithic.py --limit 40 --time-scale 0.05
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import tempfile
from pathlib import Path

from deploy.launcher import start_stack
from k3serve.bench.client import run_load
from k3serve.bench.report import summarize
from k3serve.bench.workload import trace_load
from k3serve.config import load_config

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default=str(ROOT / "tests/data/trace_3000_3399.jsonl"))
    ap.add_argument("--limit", type=int, default=40)
    ap.add_argument("--time-scale", type=float, default=0.05)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=1200)
    ap.add_argument("--slo-ttft", type=float, default=5.0)
    ap.add_argument("--slo-itl", type=float, default=0.3)
    ap.add_argument("--out", default=None)
    ap.add_argument("--plots", default=None)
    a = ap.parse_args()
    cfg = load_config("k3-tiny")
    work = trace_load(a.trace, limit=a.limit, time_scale=a.time_scale,
                      length_scale=a.block_size / 512, vocab_size=cfg.vocab_size,
                      max_model_len=a.max_model_len)
    runs, reps = {}, {}
    for name, kw in (("2P+1D", {"num_prefill": 2, "num_decode": 1}),
                     ("3 monolithic", {"monolithic": 3})):
        st = start_stack(model="k3-tiny", block_size=a.block_size,
                         log_dir=tempfile.mkdtemp(prefix="pdvm-"), **kw)
        try:
            runs[name] = run_load(st.url, work.requests, progress=False)
        finally:
            st.stop()
        reps[name] = summarize(runs[name], work, slo_ttft=a.slo_ttft, slo_itl=a.slo_itl)
    f = lambda v, s=1.0: "—" if v is None else f"{v * s:.3g}"  # noqa: E731
    print(f"{dt.date.today()} · k3-tiny on this machine (CPU) · {a.trace} rows 1–{a.limit} "
          f"({len(work.requests)} sent, {work.num_skipped} skipped) · time ×{a.time_scale} · "
          f"B={a.block_size} · SLO TTFT ≤ {a.slo_ttft} s, TPOT ≤ {a.slo_itl} s\n")
    print("| stack | ITL p99 in prefill bursts (ms) | ITL p50 (ms) | TTFT p50 (s) | "
          "TTFT p99 (s) | goodput (req/s) | good % | hit rate |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in reps.items():
        print(f"| {name} | {f(r['itl_p99_during_prefill_s'], 1e3)} | {f(r['itl_p50_s'], 1e3)} "
              f"| {f(r['ttft_p50_s'])} | {f(r['ttft_p99_s'])} | {f(r['goodput'])} | "
              f"{f(r['goodput_fraction'], 100)} | {f(r['hit_rate'], 100)} % |")
    if a.out:
        Path(a.out).write_text(json.dumps(reps, indent=2) + "\n")
    if a.plots:
        from k3serve.bench.plots import write_plots

        first, second = list(runs)
        write_plots(runs[first], a.plots, title=f"{first} vs {second}",
                    others={second: runs[second]}, label=first)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
