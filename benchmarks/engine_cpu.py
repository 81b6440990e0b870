"""Replay a scaled-down slice of the Mooncake trace through the offline engine, with and
without prefix caching; print tokens/s, the prefix-cache hit rate and the speed ratio.

The trace (``traces/mooncake_synthetic_trace.jsonl`` in this repo) gives per request the prompt's
512-token block hash ids (equal ids = equal content). Scaling:

* hash id ``h`` → ``--tokens-per-hash`` deterministic tokens (``random.Random(h)``), so
  prefix sharing in the trace becomes real prefix sharing in the prompts;
* prompt length ``⌈input_length · tokens_per_hash / 512⌉`` (the trace's last block is partial);
* output length ``min(output_length, --max-output)``;
* a slice of whole sessions: requests whose first hash id ``% --sessions-mod == 0`` (keeps the
  trace's reuse structure: its exact-prefix oracle stays near the full trace's 65 %).

Requests are replayed in trace order, ``--concurrency`` at a time (one ``generate`` call each),
greedy. Usage::

    .venv/bin/python benchmarks/engine_cpu.py                 # micro model, ~1 min
    .venv/bin/python benchmarks/engine_cpu.py --model k3-tiny --sessions-mod 400
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from k3serve.config import PRESETS, ModelConfig
from k3serve.engine.llm import LLM
from k3serve.process import flag_message, input_file, nonnegative_int, output_file, positive_int
from k3serve.sampling import SamplingParams

TRACE = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    "traces",
    "mooncake_synthetic_trace.jsonl",
)
TRACE_BLOCK = 512

MICRO = PRESETS["k3-tiny"].replace(
    name="micro",
    hidden_size=64,
    num_layers=4,
    mla_layers=(1, 3),
    kda_num_heads=2,
    kda_head_dim=32,
    kda_gate_rank=16,
    mla_num_heads=2,
    q_lora_rank=32,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=16,
    v_head_dim=16,
    dense_intermediate_size=128,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    moe_latent_size=32,
    attn_res_block_layers=2,
)


def load_slice(
    path: str,
    sessions_mod: int,
    tokens_per_hash: int,
    max_output: int,
    vocab: int,
    limit: int | None,
) -> list[tuple[list[int], int]]:
    """``[(prompt token ids, output tokens)]`` in trace order."""
    out = []
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            if r["hash_ids"][0] % sessions_mod:
                continue
            toks: list[int] = []
            for h in r["hash_ids"]:
                rng = random.Random(h)
                toks.extend(rng.randrange(vocab) for _ in range(tokens_per_hash))
            n = max(1, min(len(toks), math.ceil(r["input_length"] * tokens_per_hash / TRACE_BLOCK)))
            out.append((toks[:n], max(1, min(r["output_length"], max_output))))
            if limit and len(out) >= limit:
                break
    return out


def oracle_hit_rate(reqs: list[tuple[list[int], int]], block: int) -> float:
    """Infinite-cache exact-prefix token hit rate of the slice (full blocks, ≥ 1 token computed)."""
    seen: set[tuple[int, ...]] = set()
    hit = tot = 0
    for p, _ in reqs:
        tot += len(p)
        cap = (len(p) - 1) // block
        n = 0
        while n < cap and tuple(p[: (n + 1) * block]) in seen:
            n += 1
        hit += n * block
        for i in range(1, len(p) // block + 1):
            seen.add(tuple(p[: i * block]))
    return hit / max(1, tot)


def run(
    cfg: ModelConfig | str, reqs, caching: bool, args
) -> tuple[float, int, int, int, list[list[int]]]:
    llm = LLM(
        cfg,
        enable_prefix_caching=caching,
        block_size=args.block_size,
        num_pages=args.num_pages,
        num_slots=args.concurrency * 2,
        num_snapshots=args.num_snapshots,
        max_num_batched_tokens=args.budget,
    )
    sp = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for _, m in reqs]
    # warm-up, not timed (shorter than a block: caches nothing)
    llm.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=2))
    t0 = time.perf_counter()
    outs = []
    for i in range(0, len(reqs), args.concurrency):
        outs += llm.generate(
            [p for p, _ in reqs[i : i + args.concurrency]], sp[i : i + args.concurrency]
        )
    dt = time.perf_counter() - t0
    prompt = sum(len(p) for p, _ in reqs)
    gen = sum(len(o.token_ids) for o in outs)
    cached = sum(o.num_cached_tokens for o in outs)
    return dt, prompt, gen, cached, [o.token_ids for o in outs]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", type=input_file, default=TRACE)
    ap.add_argument("--model", default="micro", help="'micro' (default, fast) or a preset / folder")
    ap.add_argument("--sessions-mod", type=positive_int, default=80)
    ap.add_argument("--limit", type=positive_int, default=None, help="at most this many requests")
    ap.add_argument("--tokens-per-hash", type=positive_int, default=8)
    ap.add_argument("--max-output", type=positive_int, default=8)
    ap.add_argument("--block-size", type=positive_int, default=8)
    ap.add_argument("--num-pages", type=positive_int, default=4096)
    ap.add_argument("--num-snapshots", type=nonnegative_int, default=256)
    ap.add_argument("--budget", type=positive_int, default=256, help="max_num_batched_tokens")
    ap.add_argument("--concurrency", type=positive_int, default=8)
    ap.add_argument("--threads", type=positive_int, default=1)
    ap.add_argument("--json", type=output_file, default=None, help="write the result here")
    args = ap.parse_args()
    if args.model != "micro":
        from k3serve.config import load_config

        try:
            load_config(args.model)
        except ValueError as e:
            ap.error(flag_message(str(e), args))
    torch.set_num_threads(args.threads)
    cfg: ModelConfig | str = MICRO if args.model == "micro" else args.model
    vocab = MICRO.vocab_size if args.model == "micro" else None
    if vocab is None:
        from k3serve.config import load_config

        vocab = min(256, load_config(args.model).vocab_size)
    reqs = load_slice(
        args.trace,
        args.sessions_mod,
        args.tokens_per_hash,
        args.max_output,
        min(vocab, 256),
        args.limit,
    )
    print(
        f"slice: {len(reqs)} requests, {sum(len(p) for p, _ in reqs)} prompt tokens, "
        f"{sum(m for _, m in reqs)} output tokens max; model {args.model}; block {args.block_size}"
    )
    print(
        f"oracle hit rate of the slice (infinite cache, exact prefix): "
        f"{oracle_hit_rate(reqs, args.block_size):.1%}"
    )
    rows = {}
    out = {"model": args.model, "requests": len(reqs), "block_size": args.block_size,
           "oracle_hit_rate": oracle_hit_rate(reqs, args.block_size), "runs": []}
    for caching in (False, True):
        dt, prompt, gen, cached, toks = run(cfg, reqs, caching, args)
        rows[caching] = (dt, toks)
        out["runs"].append({"prefix_caching": caching, "seconds": dt, "prompt_tokens": prompt,
                            "output_tokens": gen, "cached_tokens": cached,
                            "tokens_per_s": (prompt + gen) / dt, "hit_rate": cached / prompt})
        print(
            f"prefix caching {'on ' if caching else 'off'}: {dt:7.2f} s  "
            f"{(prompt + gen) / dt:9.1f} tokens/s (prompt + output)  "
            f"{gen / dt:7.1f} output tokens/s  "
            f"hit rate {cached / prompt:6.1%}"
        )
    print(
        f"ratio (cache on / off throughput): {rows[False][0] / rows[True][0]:.2f}x; "
        f"greedy outputs identical: {rows[False][1] == rows[True][1]}"
    )
    out["speedup"] = rows[False][0] / rows[True][0]
    out["greedy_outputs_identical"] = rows[False][1] == rows[True][1]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
