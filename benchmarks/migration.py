"""Request migration: kill -9 of a decode worker while 50 streams run.

``python benchmarks/migration.py [--streams 50] [--max-tokens 32] [--json PATH]``

Starts router + 1 prefill + 2 decode workers (k3-tiny, CPU, loopback), streams every request
once without a fault (the reference), then again and ``kill -9`` decode-0 once every stream
has its first text. Half the requests are greedy, half seeded sampling with presence /
frequency / repetition penalties. Prints one table: streams completed, streams whose text and
token count equal the reference, migrations the router made, resumes decode-1 counted, and the
wall time of both runs (median of the fault-free warm runs vs the fault run, as a ratio). The
CI-sized version (16 streams) is ``tests/worker/test_migration.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from k3serve.process import nonnegative_int, output_file, positive_int

KEY = "sk-migration-bench"
AUTH = {"Authorization": f"Bearer {KEY}"}


def body(i: int, max_tokens: int) -> dict:
    b = {"model": "k3-tiny", "prompt": f"request {i}: a long story about a fox number {i}",
         "max_tokens": max_tokens, "stream": True,
         "stream_options": {"include_usage": True}}
    if i % 2:
        b.update(temperature=0.9, top_p=0.95, seed=1000 + i, presence_penalty=0.6,
                 frequency_penalty=0.4, repetition_penalty=1.3)
    else:
        b.update(temperature=0.0)
    return b


async def stream(c: httpx.AsyncClient, url: str, b: dict, started: asyncio.Event):
    text, finish, ntok = "", None, 0
    async with c.stream("POST", url + "/v1/completions", headers=AUTH, json=b) as r:
        if r.status_code != 200:
            return None
        async for line in r.aiter_lines():
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            ev = json.loads(line[5:])
            if "error" in ev:
                return None
            if ev.get("usage"):
                ntok = ev["usage"]["completion_tokens"]
            for ch in ev.get("choices") or ():
                text += ch.get("text") or ""
                finish = ch.get("finish_reason") or finish
                if text:
                    started.set()
    return (text, finish, ntok) if finish else None


def run(url: str, n: int, max_tokens: int, victim_pid: int | None = None):
    async def go():
        async with httpx.AsyncClient(timeout=300) as c:
            started = [asyncio.Event() for _ in range(n)]
            t0 = time.monotonic()
            tasks = [asyncio.create_task(stream(c, url, body(i, max_tokens), started[i]))
                     for i in range(n)]
            if victim_pid is not None:
                await asyncio.wait_for(asyncio.gather(*(s.wait() for s in started)), 120)
                os.kill(victim_pid, signal.SIGKILL)
            out = await asyncio.gather(*tasks)
            return out, time.monotonic() - t0
    return asyncio.run(go())


def metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith((name + "{", name + " ")))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=positive_int, default=50, help="concurrent streams")
    ap.add_argument("--max-tokens", type=positive_int, default=32, help="tokens per stream")
    ap.add_argument("--warmup", type=nonnegative_int, default=3,
                    help="fault-free runs (first discarded)")
    ap.add_argument("--json", type=output_file, default=None, help="write the figures here")
    a = ap.parse_args()
    from deploy.launcher import start_stack

    logs = tempfile.mkdtemp(prefix="k3serve-migration-")
    st = start_stack(model="k3-tiny", num_prefill=1, num_decode=2, api_key=KEY, block_size=16,
                     log_dir=logs, ready_timeout=300)
    try:
        runs = [run(st.url, a.streams, a.max_tokens) for _ in range(max(2, a.warmup))]
        ref = runs[-1][0]
        if any(r is None for r in ref):
            print("the fault-free run lost requests", file=sys.stderr)
            return 1
        t_ref = statistics.median(t for _, t in runs[1:])
        survivor = st.worker_urls[2]
        resumed0 = metric(survivor, "k3serve:requests_resumed_total")
        got, t_fault = run(st.url, a.streams, a.max_tokens, victim_pid=st.procs[2].pid)
        done = sum(g is not None for g in got)
        same = sum(g == r for g, r in zip(got, ref))
        migrated = metric(st.url, "k3serve:router_migrations_total")
        resumed = metric(survivor, "k3serve:requests_resumed_total") - resumed0
        print(f"| streams | completed | equal to the fault-free run | migrations | resumed on "
              f"decode-1 | tokens | wall fault-free (median) | wall with kill -9 | ratio |\n"
              f"|---|---|---|---|---|---|---|---|---|\n"
              f"| {a.streams} | {done} | {same} | {migrated:.0f} | {resumed:.0f} | "
              f"{sum(r[2] for r in ref)} | {t_ref:.2f} s | {t_fault:.2f} s | "
              f"{t_fault / t_ref:.2f} |")
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"streams": a.streams, "completed": done, "equal_to_fault_free": same,
                           "migrations": migrated, "resumed": resumed,
                           "tokens": sum(r[2] for r in ref), "wall_fault_free_s": t_ref,
                           "wall_with_kill_s": t_fault}, f, indent=1)
        return 0 if done == same == a.streams else 1
    finally:
        st.stop()


if __name__ == "__main__":
    raise SystemExit(main())
