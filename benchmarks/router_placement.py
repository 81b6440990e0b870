"""Latency of one placement decision: 64 workers, 1 M indexed blocks.

One decision = ``GlobalIndex.match`` over the prompt's block hashes (every worker in one
pass) + one ``PrefillWorkerState`` per prefill worker + ``place`` (cache-aware prefill choice,
decode choice, ``snapshot_at``). Hashing the prompt's tokens (``block_hashes``) is timed apart:
it is per request, not per worker, and costs the same under every policy.

Index content: 32 prefill + 32 decode workers; conversations that share one of 256 system
prompts (16–64 blocks) and continue with their own blocks, each held by 1–3 workers, with
snapshots at prompt ends and system-prompt boundaries; plus one hot 2 048-block prefix held
by every prefill worker (the worst case of the walk). Prompts of 1 k, 32 k and 128 k tokens
(B = 64) either extend an indexed conversation or share only a system prompt.

Usage: ``python benchmarks/router_placement.py [--blocks 1000000] [--workers 64] [--iters 2000]``
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from k3serve.process import output_file, positive_int
from router.index import GlobalIndex
from router.placement import (
    DecodeWorkerState,
    PlacementRequest,
    PrefillWorkerState,
    place,
)

B = 64


def _h(rng: random.Random) -> str:
    return f"{rng.getrandbits(128):032x}"


def build(num_blocks: int, num_workers: int, seed: int = 0):
    """Fill a ``GlobalIndex`` through ``load_state`` dumps; return it and the chains."""
    rng = random.Random(seed)
    workers = [f"w{i}" for i in range(num_workers)]
    prefill = workers[: num_workers // 2]
    content = {w: (set(), set()) for w in workers}
    systems = [[_h(rng) for _ in range(rng.randint(16, 64))] for _ in range(256)]
    hot = [_h(rng) for _ in range(2048)]
    for w in prefill:
        content[w][0].update(hot)
        content[w][1].update((hot[-1], hot[1023]))
    total = len(hot) + sum(len(s) for s in systems)
    chains = []
    while total < num_blocks or not chains:  # one conversation at least
        sysp = rng.choice(systems)
        tail = [_h(rng) for _ in range(min(rng.randint(8, 200), max(1, num_blocks - total)))]
        total += len(tail)
        chain = sysp + tail
        chains.append((len(sysp), chain))
        for w in rng.sample(workers, rng.randint(1, min(3, num_workers))):
            blocks, snaps = content[w]
            blocks.update(chain)
            snaps.update((sysp[-1], chain[-1]))
    index = GlobalIndex()
    for w in workers:
        index.add_worker(w)
        blocks, snaps = content[w]
        index.load_state(w, {"epoch": "bench", "last_seq": 0, "blocks": list(blocks),
                             "snapshots": list(snaps)})
    return index, prefill, workers[num_workers // 2:], systems, chains, hot


def decide(index: GlobalIndex, hashes: list[str], num_tokens: int, prefill: list[str],
           decode: list[DecodeWorkerState], queued: dict[str, int], seq: int):
    """One placement decision, exactly as router/pipeline.py (``Router.place``) makes it."""
    req = PlacementRequest(num_tokens, B, seq=seq, max_new_tokens=256)
    match = index.match(hashes, req.max_cached_blocks)
    states = []
    for w in prefill:
        m = match.get(w)
        states.append(PrefillWorkerState(w, m.usable_blocks if m else 0,
                                         m.mla_blocks if m else 0, queued[w], 20_000.0))
    return place(req, states, decode)


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(len(s) * q / 100))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--blocks", type=positive_int, default=1_000_000,
                    help="index size (at least the system prompts and the hot chain)")
    ap.add_argument("--workers", type=positive_int, default=64,
                    help="workers (half prefill, half decode; ≥ 2)")
    ap.add_argument("--iters", type=positive_int, default=2000,
                    help="decisions timed per prompt shape")
    ap.add_argument("--json", type=output_file, default=None, help="write the rows here")
    args = ap.parse_args()
    if args.workers < 2:
        ap.error(f"--workers: must be ≥ 2 (half prefill, half decode), got {args.workers}")

    t0 = time.perf_counter()
    index, prefill, decode_ids, systems, chains, hot = build(args.blocks, args.workers)
    print(f"index: {index.num_blocks():,} blocks, {index.num_snapshots():,} snapshots, "
          f"{len(index.workers)} workers ({len(prefill)} prefill) built in "
          f"{time.perf_counter() - t0:.1f} s")
    rng = random.Random(1)
    decode = [DecodeWorkerState(w, free_tokens=rng.randint(0, 1 << 20), running=rng.randint(0, 64))
              for w in decode_ids]
    queued = {w: rng.randint(0, 50_000) for w in prefill}

    def prompt(kind: str, num_tokens: int) -> list[str]:
        n = num_tokens // B
        if kind == "hot":
            base = hot
        elif kind == "conversation":
            base = rng.choice(chains)[1]
        else:
            base = rng.choice(systems)
        shared = base[: min(len(base), n)]
        return shared + [_h(rng) for _ in range(n - len(shared))]

    print("wall = perf_counter (includes preemption on a shared box); "
          "cpu = thread CPU time of the decision")
    print(f"{'prompt':>24s} {'p50 µs':>9s} {'p99 µs':>9s} {'mean µs':>9s} "
          f"{'cpu p50':>9s} {'cpu p99':>9s}")
    out = {"blocks": args.blocks, "workers": args.workers, "iters": args.iters,
           "decisions": [], "hashing": []}
    for kind in ("system", "conversation", "hot"):
        for tokens in (1024, 32_768, 131_072):
            prompts = [prompt(kind, tokens) for _ in range(64)]
            times, cpu = [], []
            for i in range(args.iters):
                hs = prompts[i % len(prompts)]
                c = time.thread_time_ns()
                t = time.perf_counter_ns()
                decide(index, hs, tokens + 17, prefill, decode, queued, i)
                times.append((time.perf_counter_ns() - t) / 1000)
                cpu.append((time.thread_time_ns() - c) / 1000)
            print(f"{kind + ' ' + str(tokens // 1024) + 'k tok':>24s} {_pct(times, 50):9.1f} "
                  f"{_pct(times, 99):9.1f} {statistics.fmean(times):9.1f} "
                  f"{_pct(cpu, 50):9.1f} {_pct(cpu, 99):9.1f}")
            out["decisions"].append({
                "prompt": kind, "tokens": tokens, "wall_p50_us": _pct(times, 50),
                "wall_p99_us": _pct(times, 99), "wall_mean_us": statistics.fmean(times),
                "cpu_p50_us": _pct(cpu, 50), "cpu_p99_us": _pct(cpu, 99)})

    from k3serve.cache.hashing import block_hashes, make_salt

    salt = make_salt("bench")
    for tokens in (1024, 32_768, 131_072):
        ids = [rng.randrange(1 << 17) for _ in range(tokens)]
        t = time.perf_counter()
        reps = max(1, 200_000 // tokens)
        for _ in range(reps):
            block_hashes(ids, B, salt)
        per_prompt = (time.perf_counter() - t) / reps * 1e6
        print(f"{'hashing ' + str(tokens // 1024) + 'k tok':>24s} "
              f"{per_prompt:9.1f} µs (per prompt, not per worker)")
        out["hashing"].append({"tokens": tokens, "us_per_prompt": per_prompt})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
