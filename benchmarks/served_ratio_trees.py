"""Served / offline output tok/s of several source trees, side by side in one run (CPU).

Each tree in ``--src`` is a checkout of any commit (``git worktree add /tmp/base COMMIT``); its
code is imported from it (``PYTHONPATH=TREE``, cwd ``TREE``). On the same machine, with the same
load (``--num`` requests of ``--input-len`` random token ids, ``--output-len`` tokens each,
greedy, ``ignore_eos``, all sent at once):

1. offline — a child process per tree and round: ``k3serve.LLM(model).generate`` of the load;
2. monolithic — every tree's ``deploy.launcher.start_stack(monolithic=1)`` (defaults) is
   started, then the load is sent through each tree's router by that tree's own load generator
   (``bench --rate inf``: streaming ``/v1/completions``), the trees taking turns
   (A, B, B, A, A, B, …) while the other stacks sit idle;
3. prefill + decode — the same with ``start_stack(num_prefill=1, num_decode=1)``.

Every implementation is warmed up the same way: the same load once, untimed, with other random
prompts (so the timed runs get no prefix hit from it; every run has its own prompts). A tree's
ratio is its median served output tok/s ÷ its median offline output tok/s over ``--rounds``.
The figures are printed and, with ``--json``, written with every run.

    git worktree add /tmp/base b2691b0
    python benchmarks/served_ratio_trees.py --src /tmp/base,. --rounds 5 --json out.json

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
import tempfile
import time
from pathlib import Path

OFFLINE = r'''
import json, sys, time
import torch
torch.set_num_threads(1)
model, num, il, ol, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
from k3serve import LLM, SamplingParams
llm = LLM(model)
vocab = llm.engine.model_config.vocab_size
g = torch.Generator().manual_seed(seed)
mk = lambda n: [torch.randint(3, vocab, (il,), generator=g).tolist() for _ in range(n)]
sp = SamplingParams(max_tokens=ol, temperature=0, ignore_eos=True)
llm.generate(mk(num), sp)  # warm-up: the same load once, other prompts
t = time.perf_counter()
llm.generate(mk(num), sp)
print("RESULT " + json.dumps({"tok_s": num * ol / (time.perf_counter() - t)}), flush=True)
'''

STACK = r'''
import sys
from deploy.launcher import start_stack
model, mode, logs = sys.argv[1], sys.argv[2], sys.argv[3]
kw = dict(monolithic=1) if mode == "monolithic" else dict(num_prefill=1, num_decode=1)
st = start_stack(model=model, log_dir=logs, ready_timeout=300, **kw)
print("URL " + st.url, flush=True)
try:
    sys.stdin.read()  # until the parent closes it
finally:
    st.stop()
'''


def env_of(tree: Path) -> dict:
    return {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}


def offline(tree: Path, a: argparse.Namespace, seed: int) -> float:
    r = subprocess.run([sys.executable, "-c", OFFLINE, a.model, str(a.num), str(a.input_len),
                        str(a.output_len), str(seed)], cwd=tree, env=env_of(tree),
                       capture_output=True, text=True, timeout=a.timeout, check=False)
    line = next((l for l in r.stdout.splitlines() if l.startswith("RESULT ")), None)
    if r.returncode != 0 or line is None:
        raise SystemExit(f"{tree}: offline exit {r.returncode}\n{r.stderr[-3000:]}")
    return json.loads(line[len("RESULT "):])["tok_s"]


def start(tree: Path, mode: str, a: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    logs = tempfile.mkdtemp(prefix=f"ratio-{mode}-")
    p = subprocess.Popen([sys.executable, "-c", STACK, a.model, mode, logs], cwd=tree,
                         env=env_of(tree), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True)
    for line in p.stdout:
        if line.startswith("URL "):
            return p, line.split()[1]
    raise SystemExit(f"{tree}: the {mode} stack did not start (exit {p.wait()}; logs {logs})")


def bench(tree: Path, url: str, a: argparse.Namespace, seed: int) -> dict:
    mod = "cli" if (tree / "cli").is_dir() else "k3serve.cli"
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        r = subprocess.run([sys.executable, "-m", mod, "bench", "--url", url, "--model", a.model,
                            "--rate", "inf", "--num", str(a.num), "--input-len",
                            str(a.input_len), "--output-len", str(a.output_len), "--seed",
                            str(seed), "--no-progress", "--json", f.name],
                           cwd=tree, env=env_of(tree), capture_output=True, text=True,
                           timeout=a.timeout, check=False)
        if r.returncode != 0:
            raise SystemExit(f"{tree}: bench exit {r.returncode}\n{r.stderr[-2000:]}")
        s = json.loads(Path(f.name).read_text())
    s = s.get("summary", s)
    return {k: s[k] for k in ("output_tokens_per_s", "ttft_p50_s", "itl_p50_s")}


def turns(trees: list[Path], k: int) -> list[Path]:
    """Round ``k``'s order: forward on even rounds, backward on odd ones."""
    return trees if k % 2 == 0 else trees[::-1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--src", default=".", help="source trees, comma-separated (default: .)")
    ap.add_argument("--rounds", type=int, default=5, help="timed runs per tree and mode")
    ap.add_argument("--model", default="k3-tiny", help="preset or checkpoint folder")
    ap.add_argument("--num", type=int, default=8, help="requests, all sent at once")
    ap.add_argument("--input-len", type=int, default=256, help="prompt tokens")
    ap.add_argument("--output-len", type=int, default=32, help="output tokens per request")
    ap.add_argument("--modes", default="monolithic,pd", help="served stacks to run")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per child process")
    ap.add_argument("--json", default=None, help="write the runs and the summary here")
    a = ap.parse_args(argv)
    trees = [Path(s).resolve() for s in a.src.split(",") if s]
    for t in trees:
        if not (t / "k3serve").is_dir():
            ap.error(f"--src: {t} has no k3serve/ package")
    modes = [m for m in a.modes.split(",") if m]
    for m in modes:
        if m not in ("monolithic", "pd"):
            ap.error(f"--modes: {m!r} is not monolithic or pd")
    runs: list[dict] = []
    seed = 1000
    for k in range(a.rounds):
        for t in turns(trees, k):
            seed += 1
            runs.append({"mode": "offline", "round": k, "src": str(t),
                         "output_tokens_per_s": offline(t, a, seed)})
            print(f"offline round {k} {t}: {runs[-1]['output_tokens_per_s']:.1f} tok/s",
                  flush=True)
    for mode in modes:
        stacks = {t: start(t, mode, a) for t in trees}
        try:
            for t in trees:  # warm-up: the same load once
                seed += 1
                bench(t, stacks[t][1], a, seed)
            for k in range(a.rounds):
                for t in turns(trees, k):
                    seed += 1
                    runs.append({"mode": mode, "round": k, "src": str(t),
                                 **bench(t, stacks[t][1], a, seed)})
                    print(f"{mode} round {k} {t}: {runs[-1]['output_tokens_per_s']:.1f} tok/s",
                          flush=True)
        finally:
            for p, _ in stacks.values():
                p.stdin.close()
            for p, _ in stacks.values():
                p.wait(120)
    summary: dict[str, dict] = {}
    for t in trees:
        med = {m: statistics.median(r["output_tokens_per_s"] for r in runs
                                    if r["src"] == str(t) and r["mode"] == m)
               for m in ["offline", *modes]}
        summary[str(t)] = {**{f"{m}_tok_s": v for m, v in med.items()},
                           **{f"ratio_{m}": med[m] / med["offline"] for m in modes}}
        print(f"median {t}: offline {med['offline']:.1f} tok/s; " + ", ".join(
            f"{m} {med[m]:.1f} ({med[m] / med['offline']:.2f})" for m in modes))
    if a.json:
        Path(a.json).write_text(json.dumps({
            "date": time.strftime("%Y-%m-%d"), "machine": f"{os.cpu_count()} CPUs",
            "load_average": os.getloadavg(), "args": vars(a), "runs": runs,
            "summary": summary}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
