"""Prefill and decode throughput of ``k3-tiny`` on the CPU (float32), model forward only.

Prints one table: prefill tokens/s for a few prompt lengths (one sequence, one forward) and
decode tokens/s for a few batch sizes (one token per sequence per step). Speed is reported,
never asserted. Run: ``python benchmarks/model_cpu.py [--model k3-tiny] [--threads N]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from k3serve.cache.pools import KVPools
from k3serve.config import load_config
from k3serve.engine.llm import load_model
from k3serve.model.batch import make_batch
from k3serve.process import flag_message, nonnegative_int, output_file, positive_int


def _median_time(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="k3-tiny", help="preset name or checkpoint folder")
    ap.add_argument("--threads", type=nonnegative_int, default=0,
                    help="torch threads (0 = torch default)")
    ap.add_argument("--repeats", type=positive_int, default=3,
                    help="timed runs per shape (decode: 3 x this); the median is shown")
    ap.add_argument("--json", type=output_file, default=None, help="write the rows here")
    args = ap.parse_args()
    try:
        load_config(args.model)
    except ValueError as e:
        ap.error(flag_message(str(e), args))
    if args.threads:
        torch.set_num_threads(args.threads)
    model, cfg, folder = load_model(args.model, dtype=torch.float32)
    block = 64
    prompt_lens = (128, 512, 2048)
    batch_sizes = (1, 8, 32)
    num_pages = max(prompt_lens) // block * max(batch_sizes) + 64
    pools = KVPools(cfg, num_slots=max(batch_sizes), num_pages=num_pages, block_size=block)
    gen = torch.Generator().manual_seed(0)
    rows = []
    with torch.inference_mode():
        for L in prompt_lens:
            ids = torch.randint(0, cfg.vocab_size, (L,), generator=gen)
            pages = list(range(-(-L // block)))
            batch = make_batch([L], [0], [0], [pages], block)

            def run_prefill(ids=ids, batch=batch):
                pools.zero_slot(0)
                model(ids, batch, pools)

            t = _median_time(run_prefill, args.repeats)
            rows.append(("prefill", f"1 × {L}", L / t))
        ctx = 512
        for n in batch_sizes:
            per_seq = -(-(ctx + 1) // block)
            tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(n)]
            ids = torch.randint(0, cfg.vocab_size, (n,), generator=gen)
            batch = make_batch([1] * n, [ctx] * n, list(range(n)), tables, block)

            def run_decode(ids=ids, batch=batch):
                model(ids, batch, pools)

            t = _median_time(run_decode, args.repeats * 3)
            rows.append(("decode", f"{n} seqs @ {ctx} ctx", n / t))
    print(f"model {cfg.name} ({'trained' if folder else 'random'} weights), float32, "
          f"{torch.get_num_threads()} threads")
    print(f"{'phase':8} {'shape':>18} {'tokens/s':>12}")
    for phase, shape, tps in rows:
        print(f"{phase:8} {shape:>18} {tps:12.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": cfg.name, "weights": "trained" if folder else "random",
                       "dtype": "float32", "threads": torch.get_num_threads(),
                       "rows": [{"phase": p, "shape": s, "tokens_per_s": t} for p, s, t in rows]},
                      f, indent=1)


if __name__ == "__main__":
    main()
