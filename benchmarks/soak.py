"""Soak (not CI): a steady ~4 req/s of mixed lengths against a live
stack for up to 10 minutes; reports RSS growth per process, pages left held, transfer failures.

    python benchmarks/soak.py                       # 10 min, 4 req/s, 1 prefill + 1 decode
    python benchmarks/soak.py --duration 120 --out /tmp/soak.json
    python benchmarks/soak.py --rate 1 --log-dir /tmp/soak --log-level info   # per-transfer lines

It starts its own stack (``deploy.launcher.start_stack``: router + workers, k3-tiny, loopback),
sends requests at fixed intervals (open loop: a slow stack does not lower the offered rate;
prompts of 2–24 words, 1–6 output tokens with ``ignore_eos`` — short enough that 4 req/s
is what 1 prefill + 1 decode k3-tiny worker serve on a 2-core CPU box (4.00 req/s served
there, at its capacity: the queue builds, p50 12.7 s; with 4–48 words and 2–12 tokens it
served 2.9 req/s and shed the rest with 429, with 4–200 words and up to 32 tokens ~0.6) — half of them streamed, 1 in 10 cut by
the client after its first chunk; ``--words`` / ``--tokens`` change the ranges), samples every process' RSS (``/proc/PID/status`` VmRSS) every
``--sample`` seconds, and at the end waits for the workers to go idle and reads their own
counters: pages / slots / snapshots in use, reservations, open tickets
(``/internal/info``, ``/kv/health``) and the transfer outcome counters
(``k3serve:kv_transfers_total{outcome}``, ``k3serve:kv_transfer_expiries_total``,
``k3serve:kv_transfer_fallbacks_total``).

RSS growth is measured from the first sample after a 30 s warm-up (allocators, caches and
compiled kernels settle) to the last; figures are for the run's machine only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from deploy.launcher import Stack, start_stack
from k3serve.process import nonnegative_float, output_file, positive_float, positive_int
from k3serve.protocol import CLUSTER_TOKEN_HEADER

WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "seven", "wizards", "quietly", "judge", "boxing", "matches", "in", "distant", "northern", "valleys"]


def rss_mb(pid: int) -> float:
    """Resident set size of ``pid`` in MiB (0 when it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def metric(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels`` (Prometheus text)."""
    want = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith((name + "{", name + " "))
               and all(w in line.split("}", 1)[0] for w in want))


async def one(c: httpx.AsyncClient, url: str, rng: random.Random, key: str,
              words: tuple[int, int] = (4, 48), tokens: tuple[int, int] = (2, 12)
              ) -> tuple[str, float]:
    """One request of ``words`` prompt words and ``tokens`` output tokens (uniform, inclusive;
    ``ignore_eos``: the output length is the one drawn); ``(outcome, seconds)``."""
    n = rng.randint(*words)
    body = {"model": "k3-tiny", "prompt": " ".join(rng.choice(WORDS) for _ in range(n)),
            "max_tokens": rng.randint(*tokens), "ignore_eos": True,
            "temperature": rng.choice([0.0, 0.8]), "stream": rng.random() < 0.5}
    cut = body["stream"] and rng.random() < 0.2  # 1 in 10 of all requests
    t0 = time.monotonic()
    h = {"Authorization": f"Bearer {key}"}
    try:
        if body["stream"]:
            async with c.stream("POST", url + "/v1/completions", json=body, headers=h) as r:
                if r.status_code != 200:
                    await r.aread()
                    return f"http-{r.status_code}", time.monotonic() - t0
                got_done = False
                async for line in r.aiter_lines():
                    if line.startswith("data:"):
                        if cut:
                            return "cut", time.monotonic() - t0
                        if line[5:].strip() == "[DONE]":
                            got_done = True
                        elif '"error"' in line:
                            return "stream-error", time.monotonic() - t0
                return ("ok" if got_done else "stream-truncated"), time.monotonic() - t0
        r = await c.post(url + "/v1/completions", json=body, headers=h)
        return ("ok" if r.status_code == 200 else f"http-{r.status_code}"), time.monotonic() - t0
    except httpx.HTTPError as e:
        return f"client-{type(e).__name__}", time.monotonic() - t0


def worker_state(stack: Stack) -> list[dict]:
    """Each worker's usage, open tickets (decode) and transfer counters."""
    h = {CLUSTER_TOKEN_HEADER: stack.cluster_token}
    out = []
    with httpx.Client(headers=h, timeout=10, trust_env=False) as c:
        for url in stack.worker_urls:
            try:
                out.append(_one_state(c, url))
            except httpx.HTTPError as e:  # a wedged worker is a finding, not a crash
                out.append({"url": url, "role": "?", "unreachable": repr(e)})
    return out


def _one_state(c: httpx.Client, url: str) -> dict:
    info = c.get(url + "/internal/info").json()
    reqs = c.get(url + "/internal/requests").json()["requests"].values()
    m = c.get(url + "/metrics").text
    return {
        "url": url, "role": info["role"], **info["usage"],
        "live_requests": sum(1 for r in reqs if r["phase"] != "done"),
        "transfers_ok": metric(m, "k3serve:kv_transfers_total", outcome="success"),
        "transfers_failed": metric(m, "k3serve:kv_transfers_total", outcome="failed"),
        "fallbacks": metric(m, "k3serve:kv_transfer_fallbacks_total"),
        "expiries": metric(m, "k3serve:kv_transfer_expiries_total")}


async def drive(stack: Stack, key: str, rate: float, duration: float, sample_s: float,
                seed: int, grace_s: float = 60.0, words: tuple[int, int] = (4, 48),
                tokens: tuple[int, int] = (2, 12)) -> dict:
    """Offer ``rate`` req/s for ``duration`` s, then give what is still running ``grace_s`` s
    (the rest is cancelled and counted ``unfinished``); progress on stderr every sample."""
    rng = random.Random(seed)
    pids = {s.name: p.pid for s, p in zip(stack.specs, stack.procs, strict=True)}
    samples: list[tuple[float, dict[str, float]]] = []
    tasks: list[asyncio.Task] = []
    async with httpx.AsyncClient(timeout=180, trust_env=False,
                                 limits=httpx.Limits(max_connections=256)) as c:
        t0 = time.monotonic()
        next_sample = t0
        i = 0
        while (now := time.monotonic()) < t0 + duration:
            if now >= next_sample:
                samples.append((now - t0, {n: rss_mb(p) for n, p in pids.items()}))
                next_sample += sample_s
                done = [t.result()[0] for t in tasks if t.done()]
                print(f"soak {now - t0:5.0f} s: sent {len(tasks)}, done {len(done)} "
                      f"(ok {done.count('ok')}), RSS MiB {samples[-1][1]}", file=sys.stderr,
                      flush=True)
            tasks.append(asyncio.create_task(one(c, stack.url, random.Random(rng.random()),
                                                 key, words, tokens)))
            i += 1
            await asyncio.sleep(max(0.0, t0 + i / rate - time.monotonic()))
        offered_s = time.monotonic() - t0
        _, pending = await asyncio.wait(tasks, timeout=grace_s) if tasks else ((), ())
        for t in pending:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        results = [t.result() if not t.cancelled() else ("unfinished", 0.0) for t in tasks]
    samples.append((time.monotonic() - t0, {n: rss_mb(p) for n, p in pids.items()}))
    return {"results": results, "samples": samples, "elapsed": time.monotonic() - t0,
            "offered_s": offered_s}


def wait_idle(stack: Stack, timeout: float = 60.0) -> list[dict]:
    deadline = time.monotonic() + timeout
    while True:
        st = worker_state(stack)
        busy = [w for w in st if "unreachable" in w or w["pages_used"] or w["slots_used"]
                or w["live_requests"] or w["num_reserved"] or w["num_engine_requests"]]
        if not busy or time.monotonic() > deadline:
            return st
        time.sleep(0.5)


def report(run: dict, state: list[dict], warmup_s: float, rate: float) -> str:
    res = run["results"]
    outcomes: dict[str, int] = {}
    for o, _ in res:
        outcomes[o] = outcomes.get(o, 0) + 1
    lat = sorted(s for o, s in res if o == "ok")
    q = statistics.quantiles(lat, n=100) if len(lat) >= 2 else [0.0] * 99
    base = next((s for t, s in run["samples"] if t >= warmup_s), run["samples"][0][1])
    last = run["samples"][-1][1]
    span = max(1e-9, run.get("offered_s", run["elapsed"]))
    served = sum(1 for o, _ in res if o in ("ok", "cut")) / span
    lines = [(f"requests: {len(res)} in {run['elapsed']:.0f} s (offered {rate:g} req/s, "
              f"served {served:.2f} req/s over the offered span); "
              f"outcomes: {dict(sorted(outcomes.items()))}"),
             f"latency of completed requests: p50 {q[49]:.2f} s, p99 {q[98]:.2f} s", "",
             "| process | RSS after warm-up (MiB) | RSS at end (MiB) | growth (MiB) |",
             "|---|---:|---:|---:|"]
    for name in base:
        lines.append(f"| {name} | {base[name]:.0f} | {last[name]:.0f} | "
                     f"{last[name] - base[name]:+.1f} |")
    lines += ["", ("| worker | pages used | slots used | snapshots used | reserved | live "
                   "requests | transfers ok | transfers failed | expiries | fallbacks |"),
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for w in state:
        if "unreachable" in w:
            lines.append(f"| {w['url']} | unreachable: {w['unreachable'][:60]} ||||||||")
            continue
        lines.append(f"| {w['role']} {w['url']} | {w['pages_used']} | {w['slots_used']} | "
                     f"{w['snapshots_used']} | {w['num_reserved']} | {w['live_requests']} | "
                     f"{w['transfers_ok']:.0f} | {w['transfers_failed']:.0f} | "
                     f"{w['expiries']:.0f} | {w['fallbacks']:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=positive_float, default=600.0, help="seconds (≤ 600)")
    ap.add_argument("--rate", type=positive_float, default=4.0, help="requests per second")
    ap.add_argument("--prefill", type=positive_int, default=1, help="prefill workers")
    ap.add_argument("--decode", type=positive_int, default=1, help="decode workers")
    ap.add_argument("--sample", type=positive_float, default=5.0,
                    help="RSS sample interval, seconds")
    ap.add_argument("--warmup", type=nonnegative_float, default=30.0,
                    help="RSS baseline after this, s")
    ap.add_argument("--seed", type=int, default=15)
    ap.add_argument("--words", type=positive_int, nargs=2, default=(2, 24), metavar=("MIN", "MAX"),
                    help="prompt words per request (uniform)")
    ap.add_argument("--tokens", type=positive_int, nargs=2, default=(1, 6), metavar=("MIN", "MAX"),
                    help="output tokens per request (uniform; ignore_eos)")
    ap.add_argument("--log-dir", default=None)
    ap.add_argument("--log-level", default=None, help="workers' --log-level (e.g. info)")
    ap.add_argument("--out", type=output_file, default=None,
                    help="also write the raw figures as JSON here")
    a = ap.parse_args(argv)
    for name in ("words", "tokens"):
        lo, hi = getattr(a, name)
        if lo > hi:
            ap.error(f"--{name}: MIN must be ≤ MAX, got {lo} {hi}")
    key = "sk-soak"
    stack = start_stack(model="k3-tiny", num_prefill=a.prefill, num_decode=a.decode,
                        api_key=key, block_size=16, log_dir=a.log_dir, supervise=True,
                        extra_worker_args=["--log-level", a.log_level] if a.log_level else None)
    try:
        run = asyncio.run(drive(stack, key, a.rate, min(a.duration, 600.0), a.sample, a.seed,
                                words=tuple(a.words), tokens=tuple(a.tokens)))
        state = wait_idle(stack)
    finally:
        stack.stop()
    text = report(run, state, a.warmup, a.rate)
    print(text)
    if a.out:
        Path(a.out).write_text(json.dumps({"outcomes": [o for o, _ in run["results"]],
                                           "samples": run["samples"], "workers": state},
                                          indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
