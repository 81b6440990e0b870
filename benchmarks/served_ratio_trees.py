"""Served / offline output tok/s of several source trees, side by side in one run (CPU).

For each tree in ``--src`` (a checkout of any commit: ``git worktree add /tmp/base COMMIT``)
and each round, a child process imported from that tree (``PYTHONPATH=TREE``, cwd ``TREE``)
measures, on the same machine and with the same arguments:

1. offline — ``k3serve.LLM(model).generate`` of ``--num`` prompts of ``--input-len`` random
   token ids (of the model's vocabulary), ``--output-len`` tokens each (greedy, ``ignore_eos``), all submitted at once;
2. monolithic — ``deploy.launcher.start_stack(monolithic=1)`` with its defaults, the same load
   sent through the router by the tree's own load generator (``bench --rate inf --num N``:
   every request at once, streaming ``/v1/completions``, ``ignore_eos``);
3. prefill + decode — ``start_stack(num_prefill=1, num_decode=1)``, the same load.

Each implementation is warmed up the same way: the same load once, untimed, with other random
prompts (``bench --seed``), so that the timed run gets no prefix hit from it. A tree's ratio is
served output tok/s ÷ its own offline output tok/s; the rounds alternate the trees (A, B, A, B,
…) so that load on a shared machine hits both, and the summary gives each tree's median ratio
over the rounds. The figures are printed and, with
``--json``, written with every round.

    git worktree add /tmp/base b2691b0
    python benchmarks/served_ratio_trees.py --src /tmp/base,. --rounds 3 --json out.json

The load generator is the tree's ``bench`` command: ``python -m cli bench`` where the tree has
``cli/``, else ``python -m k3serve.cli bench``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

CHILD = r'''
import json, os, subprocess, sys, tempfile, time
import torch
torch.set_num_threads(1)
model, num, il, ol = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
bench_mod = "cli" if os.path.isdir("cli") else "k3serve.cli"
from k3serve import LLM, SamplingParams
llm = LLM(model)
g = torch.Generator().manual_seed(1)
vocab = llm.engine.model_config.vocab_size
mk = lambda n: [torch.randint(3, vocab, (il,), generator=g).tolist() for _ in range(n)]
sp = SamplingParams(max_tokens=ol, temperature=0, ignore_eos=True)
llm.generate(mk(num), sp)  # warm-up: the same load once
t = time.perf_counter()
llm.generate(mk(num), sp)
wall = time.perf_counter() - t
res = {"offline_tok_s": num * ol / wall}
del llm
from deploy.launcher import start_stack
for mode, kw in (("monolithic", dict(monolithic=1)), ("pd", dict(num_prefill=1, num_decode=1))):
    logs = tempfile.mkdtemp(prefix=f"ratio-{mode}-")
    stack = start_stack(model=model, log_dir=logs, ready_timeout=300, **kw)
    try:
        def bench(n, out_len, path, seed):
            r = subprocess.run([sys.executable, "-m", bench_mod, "bench", "--url", stack.url,
                                "--model", model, "--rate", "inf", "--num", str(n),
                                "--input-len", str(il), "--output-len", str(out_len),
                                "--seed", str(seed), "--no-progress", "--json", path],
                               capture_output=True, text=True, timeout=1800)
            if r.returncode != 0:
                raise SystemExit(f"bench failed: {r.stderr[-2000:]}")
            s = json.load(open(path))
            return s.get("summary", s)
        # warm-up: the same load once, other prompts (no prefix hit for the timed run)
        bench(num, ol, os.path.join(logs, "warm.json"), 1)
        s = bench(num, ol, os.path.join(logs, "load.json"), 2)
        res[f"{mode}_tok_s"] = s["output_tokens_per_s"]
    finally:
        stack.stop()
print("RESULT " + json.dumps(res), flush=True)
'''


def run_tree(tree: Path, a: argparse.Namespace) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-c", CHILD, a.model, str(a.num), str(a.input_len),
                        str(a.output_len)], cwd=tree, env=env, capture_output=True, text=True,
                       timeout=a.timeout, check=False)
    line = next((l for l in r.stdout.splitlines() if l.startswith("RESULT ")), None)
    if r.returncode != 0 or line is None:
        raise SystemExit(f"{tree}: exit {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
    res = json.loads(line[len("RESULT "):])
    res["ratio_monolithic"] = res["monolithic_tok_s"] / res["offline_tok_s"]
    res["ratio_pd"] = res["pd_tok_s"] / res["offline_tok_s"]
    res["seconds"] = round(time.monotonic() - t0, 1)
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--src", default=".", help="source trees, comma-separated (default: .)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds over every tree")
    ap.add_argument("--model", default="k3-tiny", help="preset or checkpoint folder")
    ap.add_argument("--num", type=int, default=8, help="requests, all sent at once")
    ap.add_argument("--input-len", type=int, default=256, help="prompt tokens")
    ap.add_argument("--output-len", type=int, default=32, help="output tokens per request")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per tree and round")
    ap.add_argument("--json", default=None, help="write the rounds and the summary here")
    a = ap.parse_args(argv)
    trees = [Path(s).resolve() for s in a.src.split(",") if s]
    for t in trees:
        if not (t / "k3serve").is_dir():
            ap.error(f"--src: {t} has no k3serve/ package")
    rounds: list[dict] = []
    for k in range(a.rounds):
        for t in trees:
            res = run_tree(t, a)
            rounds.append({"round": k, "src": str(t), **res})
            print(f"round {k} {t}: offline {res['offline_tok_s']:.1f} tok/s, monolithic "
                  f"{res['monolithic_tok_s']:.1f} ({res['ratio_monolithic']:.2f}), 1P+1D "
                  f"{res['pd_tok_s']:.1f} ({res['ratio_pd']:.2f})", flush=True)
    summary = {}
    for t in trees:
        mine = [r for r in rounds if r["src"] == str(t)]
        summary[str(t)] = {k: statistics.median(r[k] for r in mine)
                           for k in ("offline_tok_s", "monolithic_tok_s", "pd_tok_s",
                                     "ratio_monolithic", "ratio_pd")}
        s = summary[str(t)]
        print(f"median {t}: monolithic {s['ratio_monolithic']:.2f}, 1P+1D {s['ratio_pd']:.2f} "
              f"of offline {s['offline_tok_s']:.1f} tok/s")
    if a.json:
        Path(a.json).write_text(json.dumps({
            "date": time.strftime("%Y-%m-%d"), "machine": f"{os.cpu_count()} CPUs",
            "load_average": os.getloadavg(), "args": vars(a), "rounds": rounds,
            "summary": summary}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
