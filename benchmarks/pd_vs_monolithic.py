"""PD vs monolithic on one machine, one run: the same trace slice against
(a) 2 prefill + 1 decode and (b) 3 monolithic workers (``k3serve serve --monolithic 3``).

Prints a dated markdown table (ITL p99 during prefill bursts, TTFT p50/p99, goodput, hit
rate) and writes ``--out`` JSON (and, with ``--plots``, the CDFs of both runs side by side).
The stacks run one after the other (2 CPU cores cannot host both at once fairly).

    PYTHONPATH=. python benchmarks/pd_vs_monolithic.py            # the README's table

Defaults: the CI slice (traces/mooncake_ci_slice_3940_3963.jsonl, 24 rows) at 4 tokens per
trace block, answers at 1/4 of the trace's lengths (1–36 tokens, so decodes overlap other
requests' prefills), rows up to 512 tokens, the trace's own arrival times ×3.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import tempfile
from pathlib import Path

from cli.bench.client import run_load
from cli.bench.report import summarize
from cli.bench.workload import trace_load
from deploy.launcher import start_stack
from k3serve.config import load_config
from k3serve.process import input_file, output_file, positive_float, positive_int

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", type=input_file,
                    default=str(ROOT / "traces/mooncake_ci_slice_3940_3963.jsonl"))
    ap.add_argument("--limit", type=positive_int, default=None)
    ap.add_argument("--time-scale", type=positive_float, default=3.0)
    ap.add_argument("--block-size", type=positive_int, default=4)
    ap.add_argument("--output-scale", type=positive_float, default=0.25)
    ap.add_argument("--max-model-len", type=positive_int, default=512)
    ap.add_argument("--slo-ttft", type=positive_float, default=5.0)
    ap.add_argument("--slo-itl", type=positive_float, default=0.3)
    ap.add_argument("--out", type=output_file, default=None)
    ap.add_argument("--plots", default=None)
    a = ap.parse_args()
    cfg = load_config("k3-tiny")
    work = trace_load(a.trace, limit=a.limit, time_scale=a.time_scale,
                      length_scale=a.block_size / 512, vocab_size=cfg.vocab_size,
                      max_model_len=a.max_model_len, output_scale=a.output_scale)
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
    f = lambda v, s=1.0: "—" if v is None else f"{v * s:.3g}"
    import os

    rows = f"rows 1–{a.limit}" if a.limit else "all rows"
    print(f"{dt.date.today()} · k3-tiny on this machine ({os.cpu_count()} CPU cores, load "
          f"average {os.getloadavg()[0]:.1f} at the end) · {Path(a.trace).name} {rows} "
          f"({len(work.requests)} sent, {work.num_skipped} skipped, "
          f"{sum(len(r.prompt) for r in work.requests):,} prompt tokens, "
          f"{sum(r.max_tokens for r in work.requests)} output tokens) · time ×{a.time_scale} · "
          f"B={a.block_size} · SLO TTFT ≤ {a.slo_ttft} s, TPOT ≤ {a.slo_itl} s\n")
    print("| stack | ITL p99 in prefill bursts (ms) | ITL p50 (ms) | TTFT p50 (s) | "
          "TTFT p99 (s) | output tok/s | goodput (req/s) | good % | hit rate |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, r in reps.items():
        print(f"| {name} | {f(r['itl_p99_during_prefill_s'], 1e3)} | {f(r['itl_p50_s'], 1e3)} "
              f"| {f(r['ttft_p50_s'])} | {f(r['ttft_p99_s'])} | {f(r['output_tokens_per_s'])} "
              f"| {f(r['goodput'])} | "
              f"{f(r['goodput_fraction'], 100)} | {f(r['hit_rate'], 100)} % |")
    if a.out:
        Path(a.out).write_text(json.dumps(reps, indent=2) + "\n")
    if a.plots:
        from cli.bench.plots import write_plots

        first, second = list(runs)
        write_plots(runs[first], a.plots, title=f"{first} vs {second}",
                    others={second: runs[second]}, label=first)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
