"""Served stack vs its own offline engine, one machine, one command.

The same prompts and the same engine flags three ways, in one run:

1. offline — a child process builds the engine exactly as a worker does
   (:func:`worker.loop.build_engine`: same flag parsing, same device defaults, same warm-up) and
   drives ``engine.step()`` itself, adding each request at its arrival time; times from the
   arrival to the first token (TTFT) and between tokens (ITL) are read at each step;
2. monolithic — ``deploy.launcher.start_stack(monolithic=1)``, the load sent through the
   router by ``cli.bench`` (streaming ``/v1/completions``);
3. prefill + decode — ``start_stack(num_prefill=1, num_decode=1)``, the same load.

Per shape (``--shapes IN:OUT,…``; default ``1024:128,128:1024``; ``--input-len`` /
``--output-len`` give one shape) and per concurrency (``--concurrency``, default 1,16,64: that
many requests sent at once) plus one Poisson run (``--rate`` req/s, ``--rate-num`` requests):
output tok/s, TTFT / ITL p50 / p90 / p99, the served/offline ratio. Before the loads, ten
single requests in a row on each stack give the first request's TTFT beside the tenth's.

The KV hand-off of the prefill + decode stack: the prefill worker's
``k3serve:kv_transfer_write_bytes_total`` / ``k3serve:kv_transfer_write_seconds_total``
(bytes ÷ seconds from each request's last layer ready to its last write confirmed) beside raw
Mooncake TE writes of one request's runs of the same length (``benchmarks/transfer.py``'s
``bench_preset``, ``--te-preset``: the preset whose layout the served model has).

Writes ``docs/results/served_vs_offline-<date>-<card>.json`` (``--out`` to change): top level
``device``, ``date``, ``flags`` (``"default"`` without ``--engine-flags``), the headline run's
figures (the first shape at the largest concurrency: ``concurrency``, ``input_len``,
``output_len``, ``offline_tok_s``, ``monolithic_tok_s``, ``pd_tok_s``, ``ratio_monolithic``,
``ratio_pd``, ``transfer_gb_s``, ``raw_te_gb_s``), and every run under ``runs``. The file is
rewritten after each phase, so a run cut short keeps what it measured.

CPU (k3-tiny, small sizes)::

    python benchmarks/served_vs_offline.py --device cpu --input-len 256 --output-len 32 \\
        --concurrency 1,8 --rate 2 --rate-num 8

CUDA (the k3-mini folder of ``benchmarks/gpu_serve.py``'s ``write_checkpoint``, written to
``--folder`` when ``--model`` is not given)::

    python benchmarks/served_vs_offline.py
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

PCTS = (50, 90, 99)


# ---------------------------------------------------------------------------- workloads
def workload(input_len: int, output_len: int, num: int, rate: float, vocab: int,
             seed: int) -> list:
    """The requests of one run (``cli.bench.workload.random_load``): the offline child
    and the load generator build the same list from the same arguments."""
    from cli.bench.workload import random_load

    return random_load(rate=rate, input_len=input_len, output_len=output_len, num=num,
                       vocab_size=vocab, seed=seed).requests


def run_list(shapes: list[tuple[int, int]], conc: list[int], rate: float,
             rate_num: int) -> list[dict]:
    """Every run: ``{input_len, output_len, concurrency, rate, num, seed}``; each run has
    its own seed, so no run's prompts are a prefix hit of another's."""
    out = []
    for i, (il, ol) in enumerate(shapes):
        for c in conc:
            out.append({"input_len": il, "output_len": ol, "concurrency": c, "rate": math.inf, "num": c})
        if rate > 0:
            out.append({"input_len": il, "output_len": ol, "concurrency": None, "rate": rate,
                            "num": rate_num})
    for j, r in enumerate(out):
        r["seed"] = 1000 + j
    return out


def pcts(prefix: str, xs: list[float]) -> dict:
    import numpy as np

    return {f"{prefix}_p{q}_s": (float(np.percentile(xs, q)) if xs else None) for q in PCTS}


# ---------------------------------------------------------------------------- offline
def offline_run(engine, reqs: list, params_of) -> dict:
    """Drive ``engine`` over ``reqs`` (added at their arrival times); the figures of one run."""
    t0 = time.perf_counter()
    pending = list(enumerate(reqs))
    sent, first, last, itl = {}, {}, {}, []
    ntok: dict[str, int] = {}
    done = 0
    while done < len(reqs):
        now = time.perf_counter() - t0
        while pending and pending[0][1].arrival_s <= now:
            i, r = pending.pop(0)
            rid = f"off-{id(reqs)}-{i}"
            engine.add_request(rid, r.prompt, params_of(r))
            sent[rid] = now
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, pending[0][1].arrival_s - now) if pending else 0)
            continue
        outs = engine.step()
        now = time.perf_counter() - t0
        for o in outs:
            n = len(o.token_ids)
            if n and o.request_id not in first:
                first[o.request_id] = now
            elif n > ntok.get(o.request_id, 0):
                itl.append(now - last[o.request_id])
            if n > ntok.get(o.request_id, 0):
                last[o.request_id], ntok[o.request_id] = now, n
            if o.finished:
                done += 1
    wall = time.perf_counter() - t0
    out_tokens = sum(ntok.values())
    ttft = [first[r] - sent[r] for r in first]
    return {"tok_s": out_tokens / wall, "wall_s": wall, "output_tokens": out_tokens,
            "last_first_token_s": max(first.values()) if first else None,
            **pcts("ttft", ttft), **pcts("itl", itl)}


def offline_child(args: argparse.Namespace) -> None:
    """``--offline-child OUT``: build the engine as a worker would, run every run, write
    ``{device, card, vocab, runs: [...]}`` to OUT."""
    from k3serve.sampling import SamplingParams
    from worker.config import parse_config
    from worker.loop import build_engine

    cfg = parse_config("decode", [*device_flags(args), "--model", args.model,
                                  *shlex.split(args.engine_flags)])
    engine = build_engine(cfg)
    card = "cpu"
    if cfg.device.startswith("cuda"):
        import torch

        card = torch.cuda.get_device_name(torch.device(cfg.device))
    vocab = engine.model_config.vocab_size
    info = {"device": cfg.device, "card": card, "vocab": vocab,
            "engine": {"max_num_batched_tokens": cfg.max_num_batched_tokens,
                       "max_num_seqs": cfg.max_num_seqs, "num_slots": engine.config.num_slots,
                       "num_pages": engine.config.num_pages,
                       "gpu_memory_utilization": cfg.gpu_memory_utilization}}
    params = lambda q: SamplingParams(
        temperature=0.0, max_tokens=q.max_tokens, ignore_eos=True)
    first = json.loads(args.runs)[0]
    for i in range(10):  # as the stacks get ten single requests before their runs
        offline_run(engine, workload(first["input_len"], min(first["output_len"], 8), 1,
                                     math.inf, vocab, 10 + i), params)
    runs = []
    for r in json.loads(args.runs):
        reqs = workload(r["input_len"], r["output_len"], r["num"], r["rate"], vocab, r["seed"])
        res = offline_run(engine, reqs, params)
        runs.append({**r, **res})
        print(f"offline {r['input_len']}->{r['output_len']} c={r['concurrency']} "
              f"rate={r['rate']}: {res['tok_s']:.1f} tok/s", flush=True)
    Path(args.offline_child).write_text(json.dumps({**info, "runs": runs}, default=str))


def device_flags(args: argparse.Namespace) -> list[str]:
    return ["--device", args.device] if args.device else []


# ---------------------------------------------------------------------------- served
def worker_metrics(url: str, token: str) -> dict[str, float]:
    import httpx

    from cli.bench.client import parse_prometheus
    from k3serve.protocol import CLUSTER_TOKEN_HEADER

    r = httpx.get(f"{url}/metrics", headers={CLUSTER_TOKEN_HEADER: token}, timeout=10)
    r.raise_for_status()
    return parse_prometheus(r.text)


WRITE_BYTES = "k3serve:kv_transfer_write_bytes_total"
WRITE_SECONDS = "k3serve:kv_transfer_write_seconds_total"


def served_runs(args: argparse.Namespace, mode: str, runs: list[dict], vocab: int) -> dict:
    """Start the ``mode`` stack (``mono`` / ``pd``), send ten single requests then every run;
    returns ``{first_ttft_s, tenth_ttft_s, startup_s, runs: [...]}``."""
    from deploy.launcher import start_stack
    from cli.bench.client import run_load
    from cli.bench.report import summarize
    from cli.bench.workload import Workload

    t = time.perf_counter()
    stack = start_stack(
        model=args.model, num_prefill=1, num_decode=1, monolithic=1 if mode == "mono" else 0,
        device=args.device, ready_timeout=args.ready_timeout,
        log_dir=os.path.join(args.log_dir, mode), extra_worker_args=shlex.split(args.engine_flags))
    out: dict = {"startup_s": time.perf_counter() - t, "runs": []}
    print(f"== {mode}: stack up in {out['startup_s']:.0f} s", flush=True)
    prefill_url = None if mode == "mono" else stack.worker_urls[0]
    try:
        il, ol = runs[0]["input_len"], runs[0]["output_len"]
        ttfts = []
        for i in range(10):
            reqs = workload(il, min(ol, 8), 1, math.inf, vocab, 10 + i)
            s = summarize(run_load(stack.url, reqs, model=args.model, progress=False),
                          Workload(reqs))
            ttfts.append(s["ttft_p50_s"])
        out["first_ttft_s"], out["tenth_ttft_s"] = ttfts[0], ttfts[-1]
        print(f"{mode}: TTFT of request 1 {ttfts[0]:.3f} s, of request 10 {ttfts[-1]:.3f} s",
              flush=True)
        for r in runs:
            reqs = workload(r["input_len"], r["output_len"], r["num"], r["rate"], vocab,
                            r["seed"])
            m0 = worker_metrics(prefill_url, stack.cluster_token) if prefill_url else {}
            s = summarize(run_load(stack.url, reqs, model=args.model, progress=False),
                          Workload(reqs))
            m1 = worker_metrics(prefill_url, stack.cluster_token) if prefill_url else {}
            row = {**r, "tok_s": s["output_tokens_per_s"], "num_failed": s["num_failed"],
                   "errors": s["errors"],
                   **{k: s[k] for k in s if k.startswith(("ttft_p", "itl_p"))}}
            if prefill_url:
                db = m1.get(WRITE_BYTES, 0) - m0.get(WRITE_BYTES, 0)
                ds = m1.get(WRITE_SECONDS, 0) - m0.get(WRITE_SECONDS, 0)
                n = max(1, r["num"])
                row.update(transfer_bytes_per_request=db / n,
                           transfer_gb_s=(db / ds / 1e9) if ds > 0 else None)
            out["runs"].append(row)
            print(f"{mode} {r['input_len']}->{r['output_len']} c={r['concurrency']} "
                  f"rate={r['rate']}: {row['tok_s']:.1f} tok/s, TTFT p99 "
                  f"{row.get('ttft_p99_s') or float('nan'):.3f} s, failed {row['num_failed']}",
                  flush=True)
    finally:
        stack.stop()
    return out


def raw_te(preset: str, tokens: int, device: str, reps: int) -> dict:
    """Raw Mooncake TE writes of one request's runs (``tokens`` tokens of ``preset``'s
    layout; ``benchmarks/transfer.py``); ``{payload_bytes, raw_te_gb_s, kvstore_gb_s}``."""
    import transfer

    transfer.TOKENS[preset] = tokens
    row = transfer.bench_preset(preset, reps, device="cuda" if device.startswith("cuda")
                                else "cpu")
    return {"payload_bytes": row["payload"], "raw_te_gb_s": row["payload"] / row["raw"] / 1e9,
            "kvstore_gb_s": row["payload"] / row["stack"] / 1e9, "runs_per_request": row["runs"]}


# ---------------------------------------------------------------------------- report
def combine(off: dict, served: dict, te: dict) -> list[dict]:
    rows = []
    for i, o in enumerate(off["runs"]):
        row = {k: o[k] for k in ("input_len", "output_len", "concurrency", "rate", "num")}
        row["rate"] = None if row["rate"] == math.inf else row["rate"]
        row["offline_tok_s"] = o["tok_s"]
        row["offline_last_first_token_s"] = o["last_first_token_s"]
        row.update({f"offline_{k}": v for k, v in o.items() if k.startswith(("ttft", "itl"))})
        for mode, name in (("mono", "monolithic"), ("pd", "pd")):
            s = served.get(mode, {}).get("runs", [])
            if i < len(s):
                row[f"{name}_tok_s"] = s[i]["tok_s"]
                row[f"ratio_{'monolithic' if mode == 'mono' else 'pd'}"] = (
                    s[i]["tok_s"] / o["tok_s"] if o["tok_s"] else None)
                row.update({f"{name}_{k}": v for k, v in s[i].items()
                            if k.startswith(("ttft", "itl", "num_failed"))})
                if mode == "pd":
                    row["transfer_gb_s"] = s[i].get("transfer_gb_s")
                    row["transfer_bytes_per_request"] = s[i].get("transfer_bytes_per_request")
        t = te.get(str(row["input_len"]))
        if t:
            row["raw_te_gb_s"] = t["raw_te_gb_s"]
            row["raw_te_payload_bytes"] = t["payload_bytes"]
        rows.append(row)
    return rows


def write(path: Path, args: argparse.Namespace, off: dict, served: dict, te: dict) -> dict:
    rows = combine(off, served, te)
    fixed = [r for r in rows if r["concurrency"] is not None]
    head = max((r for r in fixed if r["input_len"] == fixed[0]["input_len"]),
               key=lambda r: r["concurrency"]) if fixed else {}
    keys = ("concurrency", "input_len", "output_len", "offline_tok_s", "monolithic_tok_s",
            "pd_tok_s", "ratio_monolithic", "ratio_pd", "transfer_gb_s", "raw_te_gb_s")
    doc = {"device": off.get("card", off.get("device")), "date": dt.date.today().isoformat(),
           "flags": args.engine_flags or "default",
           "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
           **{k: head.get(k) for k in keys},
           "engine": off.get("engine"),
           "first_request_ttft_s": {m: served[m].get("first_ttft_s") for m in served},
           "tenth_request_ttft_s": {m: served[m].get("tenth_ttft_s") for m in served},
           "startup_s": {m: served[m].get("startup_s") for m in served},
           "raw_te": te, "runs": rows}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    return doc


def table(doc: dict) -> str:
    def f(x, nd=2):
        return "–" if x is None else f"{x:.{nd}f}"

    lines = [("| shape | load | offline tok/s | mono tok/s | ratio | PD tok/s | ratio | "
             "TTFT p50/p99 mono (s) | TTFT p50/p99 PD (s) | ITL p99 mono/PD (ms) | "
             "transfer GB/s | raw TE GB/s |"), "|" + "---|" * 12]
    for r in doc["runs"]:
        load = f"{r['concurrency']} at once" if r["concurrency"] else f"Poisson {r['rate']}/s"
        lines.append(
            f"| {r['input_len']}→{r['output_len']} | {load} | {f(r['offline_tok_s'], 0)} | "
            f"{f(r.get('monolithic_tok_s'), 0)} | {f(r.get('ratio_monolithic'))} | "
            f"{f(r.get('pd_tok_s'), 0)} | {f(r.get('ratio_pd'))} | "
            f"{f(r.get('monolithic_ttft_p50_s'), 3)}/{f(r.get('monolithic_ttft_p99_s'), 3)} | "
            f"{f(r.get('pd_ttft_p50_s'), 3)}/{f(r.get('pd_ttft_p99_s'), 3)} | "
            f"{f((r.get('monolithic_itl_p99_s') or math.nan) * 1e3, 1)}/"
            f"{f((r.get('pd_itl_p99_s') or math.nan) * 1e3, 1)} | "
            f"{f(r.get('transfer_gb_s'), 3)} | {f(r.get('raw_te_gb_s'), 3)} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None,
                    help="preset or folder (default: k3-tiny on CPU; on CUDA the k3-mini folder "
                         "of gpu_serve.write_checkpoint, written to --folder)")
    ap.add_argument("--folder", default="/tmp/k3m", help="where the k3-mini folder is written")
    ap.add_argument("--device", default=None, help="cpu / cuda (default: what a worker picks)")
    ap.add_argument("--engine-flags", default="",
                    help="worker flags for offline and served alike (default: none)")
    ap.add_argument("--shapes", default="1024:128,128:1024", help="IN:OUT,…")
    ap.add_argument("--input-len", type=int, default=None, help="one shape: prompt tokens")
    ap.add_argument("--output-len", type=int, default=None, help="one shape: output tokens")
    ap.add_argument("--concurrency", default="1,16,64", help="requests sent at once, per run")
    ap.add_argument("--rate", type=float, default=8.0, help="Poisson run, req/s (0: none)")
    ap.add_argument("--rate-num", type=int, default=64, help="requests of the Poisson run")
    ap.add_argument("--modes", default="mono,pd", help="served stacks to run")
    ap.add_argument("--te-preset", default=None,
                    help="layout of the raw TE run (default: k3-tiny on CPU, k3-mini on CUDA)")
    ap.add_argument("--te-reps", type=int, default=3)
    ap.add_argument("--ready-timeout", type=float, default=300.0)
    ap.add_argument("--log-dir", default="/tmp/served_vs_offline_logs")
    ap.add_argument("--out", default=None,
                    help="JSON path (default OUT_DIR/served_vs_offline-<date>-<card>.json)")
    ap.add_argument("--out-dir", default=str(ROOT / "docs" / "results"),
                    help="folder of the default JSON path")
    ap.add_argument("--offline-child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--runs", default="[]", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def shapes_of(args: argparse.Namespace) -> list[tuple[int, int]]:
    """``--input-len`` / ``--output-len`` (one shape) or ``--shapes``.

    Raises:
        SystemExit: a malformed ``--shapes`` or only one of the two lengths given.
    """
    if (args.input_len is None) != (args.output_len is None):
        raise SystemExit("--input-len and --output-len go together")
    if args.input_len is not None:
        return [(args.input_len, args.output_len)]
    try:
        return [(int(a), int(b)) for a, b in (s.split(":") for s in args.shapes.split(","))]
    except ValueError:
        raise SystemExit(f"--shapes: want IN:OUT,…, got {args.shapes!r}") from None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.offline_child:
        offline_child(args)
        return 0
    runs = run_list(shapes_of(args), [int(c) for c in args.concurrency.split(",")],
                    args.rate, args.rate_num)
    if args.model is None:
        args.model = model_for(args)
    tmp = Path(args.log_dir) / "offline.json"
    tmp.parent.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    cmd = [sys.executable, __file__, "--offline-child", str(tmp), "--model", args.model,
           "--engine-flags", args.engine_flags, "--runs", json.dumps(runs),
           *device_flags(args)]
    subprocess.run(cmd, check=True)
    off = json.loads(tmp.read_text())
    print(f"offline: {time.perf_counter() - t:.0f} s on {off['card']} ({off['engine']})",
          flush=True)
    date = dt.date.today().isoformat()
    card = off["card"].replace("NVIDIA ", "").split()[0].lower() if off["card"] != "cpu" \
        else "cpu"
    out = Path(args.out or Path(args.out_dir) / f"served_vs_offline-{date}-{card}.json")
    served: dict = {}
    te: dict = {}
    write(out, args, off, served, te)
    for mode in args.modes.split(","):
        served[mode] = served_runs(args, mode, runs, off["vocab"])
        write(out, args, off, served, te)
    if "pd" in served:
        preset = args.te_preset or ("k3-tiny" if off["device"] == "cpu" else "k3-mini")
        for il in sorted({r["input_len"] for r in runs}):
            te[str(il)] = {"preset": preset, **raw_te(preset, il, off["device"], args.te_reps)}
    doc = write(out, args, off, served, te)
    print(table(doc))
    print(f"wrote {out}")
    return 0


def model_for(args: argparse.Namespace) -> str:
    """k3-tiny on a CPU run; on CUDA the k3-mini folder (written by a child process so that
    this one holds no GPU memory)."""
    if args.device == "cpu":
        return "k3-tiny"
    probe = subprocess.run([sys.executable, "-c", "import torch;print(torch.cuda.is_available())"],
                           capture_output=True, text=True, check=True)
    if probe.stdout.strip() != "True":
        if args.device:
            raise SystemExit(f"--device {args.device}: torch sees no CUDA device")
        return "k3-tiny"
    folder = Path(args.folder)
    if not (folder / "tokenizer.json").exists():
        subprocess.run([sys.executable, "-c", ("import sys; from pathlib import Path; "
                        f"sys.path.insert(0, {str(ROOT / 'benchmarks')!r}); "
                        f"sys.path.insert(0, {str(ROOT)!r}); "
                        "from gpu_serve import write_checkpoint; "
                        f"write_checkpoint(Path({str(folder)!r}))")], check=True)
    return str(folder)


if __name__ == "__main__":
    sys.exit(main())
