"""Router CPU per request and per relayed token, and tokens/s through 1, 2, 4 replicas.

The router runs in its own process (``python -m router``, or ``router.app`` in a tree without
``router/__main__.py``; ``--replicas N`` for N > 1);
the fake workers of ``deploy/fake_workers.py`` (toy model, no delay) run in another; this
process is the client. Router CPU = user + system time of the router process and its children
(the replicas) over one load phase, from psutil, minus the router's idle rate (its cache-event
polls and liveness probes: the mean of 5 s measured before and 5 s after the rounds) times the
phase's wall time.

Loads (``--requests`` at ``--concurrency``, after a warm-up of ``--concurrency`` requests):

* ``non-streaming, 1 token``: fixed cost of a request (tokenize, place, reserve, prefill,
  answer);
* ``streaming, T tokens`` (``--tokens``, ``stream_options.include_usage``): per request, per
  relayed token (``CPU / Σ completion tokens``) and beyond the fixed cost
  (``(stream − non-stream) / (T − 1)``).

``--src DIR[,DIR...]``: measure the router of each source tree (imported from it through
PYTHONPATH; default: this checkout) one after the other in this run, e.g. a checkout of main
beside this branch. The fake workers are always this checkout's; an older tree's router (no
``--replicas``) is measured with one event per token, as its workers sent them;
this checkout's router both ways: one event per token, and coalesced (the decode worker merges
the tokens that are ready together, decode/stream.py). ``--replicas 1,2,4``: tokens/s (wall) and CPU per token of the streaming
load through each replica count (source trees without ``--replicas`` measure 1 only).

Decode streams: a tree whose router reads decode channels (``--no-decode-channels`` exists)
reads them, one channel per decode worker carrying every request's stream (the fake workers
serve them as the real decode worker does); with coalescing workers it is measured once more
with one stream per request (``--no-decode-channels``; ``--no-per-request`` skips that run).
Older trees open one stream per request.

Event loop: each tree's router runs as that tree ships it. A tree whose ``pyproject.toml``
does not declare uvloop (older trees) ran on asyncio's loop: it is measured with
uvloop hidden from it (``loop: asyncio``), and, with ``--baseline-loop both`` (the default),
once more with the uvloop installed here (``loop: uvloop``; uvicorn's ``auto`` picks it), so
the table shows what the loop alone is worth to the old relay.

``--interleave``: for comparing trees on a shared or drifting machine. Every tree's router
runs at once on the same fake workers, and each round sends both loads through every router in
turn, the order rotated by one tree per round; the table gives each tree's medians and the
median (min–max) of its per-round ratio to the first tree. One mode per run (``--events``).

Usage::

    python benchmarks/router_relay.py [--src /tmp/main,.] [--replicas 1,2,4] [--json out.json]
    python benchmarks/router_relay.py --interleave --src /tmp/base,. --rounds 9 [--token-delay 0.004]

The box is shared (2 cores, other users): each figure is the median of ``--rounds`` rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import math
import os
import secrets
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL = "k3-tiny"
TOKEN_HEADER = "x-k3serve-cluster-token"


# ---------------------------------------------------------------- fake workers (child process)
def serve_fakes(num_prefill: int, num_decode: int, token: str, coalesce: bool,
                token_delay_s: float = 0.0) -> None:
    """Child: start the fake workers (this checkout's), print their URLs as one JSON line,
    serve until stdin closes. ``coalesce``: decode streams merge the tokens ready together
    into one event (decode/stream.py); off: one event per token, as older trees do.
    ``token_delay_s``: seconds between two tokens of one decode stream (0: as fast as the
    fakes' loop goes)."""
    from deploy.fake_workers import start_worker

    servers = [start_worker("prefill", token) for _ in range(num_prefill)]
    servers += [start_worker("decode", token) for _ in range(num_decode)]
    for st, _ in servers:
        st.coalesce = coalesce
        st.token_delay_s = token_delay_s
    print(json.dumps([srv.url for _, srv in servers]), flush=True)
    sys.stdin.read()
    for _, srv in servers:
        srv.stop()


# ---------------------------------------------------------------- processes
def declares_uvloop(src: Path) -> bool:
    """Whether the tree's package depends on uvloop (its router then runs on it)."""
    p = src / "pyproject.toml"
    return p.exists() and '"uvloop' in p.read_text()


def _no_uvloop_dir() -> Path:
    """A directory whose ``uvloop`` module fails to import (first on PYTHONPATH: uvicorn's
    ``auto`` loop then is asyncio's, as in an environment without uvloop)."""
    import tempfile

    d = Path(tempfile.gettempdir()) / "k3serve-bench-no-uvloop"
    d.mkdir(exist_ok=True)
    (d / "uvloop.py").write_text('raise ImportError("hidden by benchmarks/router_relay.py")\n')
    return d


def _env(src: Path, token: str, hide_uvloop: bool = False) -> dict[str, str]:
    env = dict(os.environ)
    # the tree first; a PYTHONPATH already set (site folders outside the venv) stays after it
    paths = ([str(_no_uvloop_dir())] if hide_uvloop else []) + [str(src)]
    paths += [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["K3SERVE_CLUSTER_TOKEN"] = token
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    return env


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_fakes(token: str, num_prefill: int, num_decode: int, coalesce: bool,
                token_delay_s: float = 0.0) -> tuple[subprocess.Popen, list[str]]:
    p = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--serve-fakes",
                          str(num_prefill), str(num_decode), str(int(coalesce)),
                          str(token_delay_s)],
                         env=_env(ROOT, token), cwd=ROOT,
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    line = p.stdout.readline()
    if not line:
        raise RuntimeError("the fake workers did not start")
    return p, json.loads(line)


def start_router(src: Path, token: str, replicas: int, port: int, hide_uvloop: bool = False,
                 channels: bool | None = None) -> subprocess.Popen:
    """The router of ``src``; ``channels`` False: with ``--no-decode-channels`` (``None``:
    as the tree reads decode streams)."""
    # cache-event polls once a second (not 10/s): their CPU is not the relay's (the prompts are
    # distinct, the index does not matter here); what is left is measured idle and subtracted
    module = "router" if (src / "router" / "__main__.py").exists() else "router.app"
    args = [sys.executable, "-m", module, "--host", "127.0.0.1", "--port", str(port),
            "--model", MODEL, "--log-level", "warning", "--poll-interval", "1.0"]
    if replicas > 1:
        args += ["--replicas", str(replicas)]
    if channels is False:
        args += ["--no-decode-channels"]
    return subprocess.Popen(args, env=_env(src, token, hide_uvloop), cwd=src)


def start_py_spy(pid: int, out: str) -> subprocess.Popen:
    """py-spy (beside this python) sampling ``pid`` and its children into ``out`` (raw)."""
    return subprocess.Popen([str(Path(sys.executable).with_name("py-spy")), "record", "-p",
                             str(pid), "-r", "250", "-f", "raw", "-o", out, "--subprocesses",
                             "--nonblocking"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def stop_py_spy(spy: subprocess.Popen) -> None:
    """End a py-spy recording (it writes its file on SIGINT)."""
    import signal

    spy.send_signal(signal.SIGINT)
    spy.wait(30)


def supports_replicas(src: Path) -> bool:
    return "--replicas" in (src / "router" / "config.py").read_text()


def supports_channels(src: Path) -> bool:
    """Whether the tree's router reads decode channels (and has ``--no-decode-channels``)."""
    return "--no-decode-channels" in (src / "router" / "config.py").read_text()


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and its live children."""
    import psutil

    p = psutil.Process(pid)
    total = 0.0
    for q in [p, *p.children(recursive=True)]:
        try:
            t = q.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


async def wait_router(url: str, workers: list[str], token: str, replicas: int) -> None:
    import httpx

    async with httpx.AsyncClient(timeout=5.0) as c:
        deadline = time.monotonic() + 60
        while True:
            try:
                r = await c.get(url + "/health")
                if r.status_code in (200, 503):
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("router did not start")
            await asyncio.sleep(0.1)
        for w in workers:
            r = await c.post(url + "/internal/register", json={"url": w},
                             headers={TOKEN_HEADER: token})
            r.raise_for_status()
        # every replica must list every worker (new connections reach every replica)
        while True:
            seen = []
            for _ in range(4 * replicas):
                async with httpx.AsyncClient(timeout=5.0) as c1:
                    h = (await c1.get(url + "/health")).json()
                    seen.append(h.get("num_workers_healthy", 0))
            if min(seen) >= len(workers):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"replicas do not all see the workers: {seen}")
            await asyncio.sleep(0.2)


# ---------------------------------------------------------------- load
async def one(c, url: str, i: int, stream: bool, max_tokens: int) -> tuple[int, int]:
    """One request; returns (completion tokens from usage, SSE chunks received)."""
    body = {"model": MODEL, "prompt": [97 + (i * 7919 + k * k) % 26 for k in range(32)],
            "max_tokens": max_tokens, "temperature": 0}
    if not stream:
        r = await c.post(url + "/v1/completions", json=body)
        r.raise_for_status()
        return r.json()["usage"]["completion_tokens"], 0
    body["stream"] = True
    body["stream_options"] = {"include_usage": True}
    tail, chunks = b"", 0
    async with c.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for chunk in r.aiter_raw():
            chunks += chunk.count(b"data: ")  # payloads are JSON: the text is escaped there
            tail = (tail + chunk)[-4096:]
    if not tail.rstrip().endswith(b"[DONE]"):
        raise RuntimeError(f"stream did not end with [DONE]: {tail[-200:]!r}")
    last = json.loads([ln for ln in tail.split(b"\n") if ln.startswith(b"data: {")][-1][6:])
    if "usage" not in last:
        raise RuntimeError(f"stream failed: {last}")
    return last["usage"]["completion_tokens"], chunks


async def load(url: str, n: int, concurrency: int, stream: bool, max_tokens: int,
               offset: int) -> tuple[int, int, float]:
    """``n`` requests, ``concurrency`` at a time; returns (Σ completion tokens, Σ chunks,
    wall s)."""
    import httpx

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency,
                          keepalive_expiry=2.0)  # below the router's 5 s: no stale reuse
    async with httpx.AsyncClient(timeout=120.0, limits=limits) as c:
        sem = asyncio.Semaphore(concurrency)
        errors: list[str] = []

        async def run(i: int) -> tuple[int, int]:
            async with sem:
                try:
                    return await one(c, url, offset + i, stream, max_tokens)
                except (httpx.HTTPError, RuntimeError) as e:  # counted, reported
                    errors.append(repr(e)[:200])
                    return 0, 0

        t0 = time.perf_counter()
        res = await asyncio.gather(*(run(i) for i in range(n)))
        if errors:
            print(f"{len(errors)} of {n} requests failed, e.g. {errors[0]}", file=sys.stderr)
        return sum(t for t, _ in res), sum(c for _, c in res), time.perf_counter() - t0


async def idle_rate(pid: int, seconds: float = 5.0) -> float:
    """Router CPU seconds per second with no request (its cache-event pollers)."""
    c0, t0 = cpu_seconds(pid), time.perf_counter()
    await asyncio.sleep(seconds)
    return (cpu_seconds(pid) - c0) / (time.perf_counter() - t0)


async def phase(pid: int, url: str, args, stream: bool, max_tokens: int, offset: int,
                idle: float) -> dict[str, float]:
    """One load phase; ``cpu_s`` is net of the idle rate (pollers) over its wall time."""
    c0 = cpu_seconds(pid)
    toks, chunks, wall = await load(url, args.requests, args.concurrency, stream, max_tokens,
                                    offset)
    cpu = cpu_seconds(pid) - c0
    return {"cpu_s": cpu - idle * wall, "raw_cpu_s": cpu, "tokens": toks, "chunks": chunks,
            "wall_s": wall}


async def measure(src: Path, replicas: int, args, token: str, workers: list[str],
                  full: bool, mode: str = "", hide_uvloop: bool = False,
                  channels: bool | None = None) -> dict[str, float]:
    """Rounds of the loads through one router (``replicas`` processes); medians."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    router = start_router(src, token, replicas, port, hide_uvloop, channels)
    try:
        await wait_router(url, workers, token, replicas)
        await load(url, args.concurrency, args.concurrency, True, args.tokens, 10**6)  # warm-up
        idle = await idle_rate(router.pid)  # again after the rounds: the mean is subtracted
        rounds = []
        for r in range(args.rounds):
            res = {"idle_cpu_per_s": idle}
            if full:
                spy = None
                if args.py_spy and r == 0:  # collapsed stacks of the non-streaming load
                    spy = start_py_spy(router.pid,
                                       f"{args.py_spy}.{Path(src).name}.{mode}.nonstream.txt")
                    await asyncio.sleep(1.0)
                ns = await phase(router.pid, url, args, False, 1, r * 10**5, idle)
                if spy is not None:
                    stop_py_spy(spy)
                res["nonstream_ms"] = 1e3 * ns["cpu_s"] / args.requests
                res["nonstream_ms_raw"] = 1e3 * ns["raw_cpu_s"] / args.requests
                res["_ns_wall"] = ns["wall_s"]
            spy = None
            if args.py_spy and r == 0:  # collapsed stacks of the streaming load
                spy = start_py_spy(router.pid, f"{args.py_spy}.{Path(src).name}.{mode}.r{replicas}.txt")
                await asyncio.sleep(1.0)
            st = await phase(router.pid, url, args, True, args.tokens, r * 10**5 + 50_000,
                             idle)
            if spy is not None:
                stop_py_spy(spy)
            res["stream_ms"] = 1e3 * st["cpu_s"] / args.requests
            res["stream_ms_raw"] = 1e3 * st["raw_cpu_s"] / args.requests
            res["_wall"] = st["wall_s"]
            res["us_per_token"] = 1e6 * st["cpu_s"] / st["tokens"]
            res["tokens_per_s"] = st["tokens"] / st["wall_s"]
            res["tokens_per_cpu_s"] = st["tokens"] / st["cpu_s"]
            res["tokens"] = st["tokens"] / args.requests
            res["chunks"] = st["chunks"] / args.requests
            if full:
                res["us_beyond_fixed"] = 1e3 * (res["stream_ms"] - res["nonstream_ms"]) / (
                    args.tokens - 1)
            rounds.append(res)
        idle2 = await idle_rate(router.pid)
        for res in rounds:  # net of the mean idle rate (each round's raw CPU kept)
            fix = (idle - (idle + idle2) / 2) * res.pop("_wall")
            res["stream_ms"] += 1e3 * fix / args.requests
            res["us_per_token"] = 1e3 * res["stream_ms"] / res["tokens"]
            res["tokens_per_cpu_s"] = 1e3 * res["tokens"] / res["stream_ms"]
            if "nonstream_ms" in res:
                res["nonstream_ms"] += 1e3 * (idle - (idle + idle2) / 2) * res.pop(
                    "_ns_wall") / args.requests
                res["us_beyond_fixed"] = 1e3 * (res["stream_ms"] - res["nonstream_ms"]) / (
                    args.tokens - 1)
            res["idle_cpu_per_s"] = (idle + idle2) / 2
        return {k: statistics.median(x[k] for x in rounds) for k in rounds[0]}
    finally:
        router.terminate()
        try:
            router.wait(15)
        except subprocess.TimeoutExpired:
            router.kill()
            router.wait()


async def main_async(args) -> dict:
    token = secrets.token_hex(8)
    out: dict = {"requests": args.requests, "concurrency": args.concurrency,
                 "tokens": args.tokens, "runs": []}
    for src_s in args.src.split(","):
        src = Path(src_s).resolve()
        new = supports_replicas(src)  # a tree with the channel relay and replicas
        if declares_uvloop(src):  # uvicorn's ``auto``: uvloop where it is installed
            loops = ["uvloop" if importlib.util.find_spec("uvloop") else "asyncio"]
        else:  # as shipped (asyncio's loop); and on the uvloop installed here
            loops = {"shipped": ["asyncio"], "uvloop": ["uvloop"],
                     "both": ["asyncio", "uvloop"]}[args.baseline_loop]
        chan = supports_channels(src)
        for coalesce in ([False, True] if new else [False]):
            fakes, workers = start_fakes(token, args.prefill, args.decode, coalesce,
                                         args.token_delay)
            try:
                reps = [r for r in args.replicas if r == 1 or new] if coalesce else [1]
                # a tree with decode channels: per request streams too (coalesced workers),
                # to show what the channels are worth
                transports = ([False, True] if coalesce and args.per_request else [True]
                              ) if chan else [None]
                for loop in loops:
                    for channels in transports:
                        for r in (reps if channels is not False else [1]):
                            res = await measure(src, r, args, token, workers, full=r == 1,
                                                mode="coalesced" if coalesce else "each",
                                                hide_uvloop=loop == "asyncio",
                                                channels=channels)
                            res.update(src=str(src), replicas=r, coalesce=coalesce, loop=loop,
                                       channels=channels)
                            out["runs"].append(res)
                            print(json.dumps(res), flush=True)
            finally:
                fakes.stdin.close()
                fakes.wait(15)
    return out


async def idle_rates(pids: list[int], seconds: float = 5.0) -> list[float]:
    """Each router's CPU seconds per second with no request, measured over the same
    ``seconds``."""
    c0, t0 = [cpu_seconds(p) for p in pids], time.perf_counter()
    await asyncio.sleep(seconds)
    dt = time.perf_counter() - t0
    return [(cpu_seconds(p) - c) / dt for p, c in zip(pids, c0)]


async def interleaved_async(args) -> dict:
    """``--interleave``: the routers of every ``--src`` tree run at once, registered with the
    same fake workers; each round sends the non-streaming and the streaming load through every
    router in turn, the order rotated by one tree each round, so that a drift of the machine's
    speed falls on every tree alike. Every tree's router runs on the same event loop (uvloop
    where it is installed). Per tree: the medians over rounds; per round, the ratio of each
    tree's figure to the first tree's in that round, and the median of those ratios."""
    token = secrets.token_hex(8)
    srcs = [Path(s).resolve() for s in args.src.split(",")]
    fakes, workers = start_fakes(token, args.prefill, args.decode, args.events == "coalesced",
                                 args.token_delay)
    routers: list[tuple[Path, subprocess.Popen, str]] = []
    try:
        for src in srcs:
            port = _free_port()
            routers.append((src, start_router(src, token, 1, port), f"http://127.0.0.1:{port}"))
        for _, _, url in routers:
            await wait_router(url, workers, token, 1)
        for _, _, url in routers:  # warm-up: the same load once through every router
            await load(url, args.concurrency, args.concurrency, True, args.tokens, 10**7)
        pids = [proc.pid for _, proc, _ in routers]
        idle0 = await idle_rates(pids, args.idle_s)
        raw: list[list[dict]] = [[] for _ in routers]
        n = len(routers)
        for r in range(args.rounds):
            for k in range(n):
                i = (r + k) % n
                _, proc, url = routers[i]
                offset = (r * n + i) * 10**5
                ns = await phase(proc.pid, url, args, False, 1, offset, 0.0)
                st = await phase(proc.pid, url, args, True, args.tokens, offset + 50_000, 0.0)
                raw[i].append({"ns": ns, "st": st})
        idle1 = await idle_rates(pids, args.idle_s)
    finally:
        for _, proc, _ in routers:
            proc.terminate()
        for _, proc, _ in routers:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        fakes.stdin.close()
        fakes.wait(15)
    per_tree = []
    for i, (src, _, _) in enumerate(routers):
        idle = (idle0[i] + idle1[i]) / 2
        rounds = []
        for x in raw[i]:
            ns, st = x["ns"], x["st"]
            ns_ms = 1e3 * (ns["raw_cpu_s"] - idle * ns["wall_s"]) / args.requests
            st_cpu = st["raw_cpu_s"] - idle * st["wall_s"]
            rounds.append({"nonstream_ms": ns_ms, "stream_ms": 1e3 * st_cpu / args.requests,
                           "us_per_token": 1e6 * st_cpu / st["tokens"],
                           "us_beyond_fixed": 1e3 * (1e3 * st_cpu / args.requests - ns_ms)
                           / (args.tokens - 1),
                           "tokens_per_s": st["tokens"] / st["wall_s"],
                           "tokens": st["tokens"] / args.requests,
                           "chunks": st["chunks"] / args.requests})
        med = {k: statistics.median(x[k] for x in rounds) for k in rounds[0]}
        per_tree.append({"src": str(src), "idle_cpu_per_s": idle, "rounds": rounds, **med})
    for t in per_tree:
        for k in ("us_per_token", "nonstream_ms", "stream_ms"):
            # None: the first tree's round measured no CPU (below the clock's 10 ms tick)
            ratios = [a[k] / b[k] if b[k] > 0 else None
                      for a, b in zip(t["rounds"], per_tree[0]["rounds"])]
            known = [x for x in ratios if x is not None]
            t[f"ratio_{k}"] = {"median": statistics.median(known) if known else None,
                               "min": min(known, default=None),
                               "max": max(known, default=None), "rounds": ratios}
    return {"requests": args.requests, "concurrency": args.concurrency, "tokens": args.tokens,
            "events": args.events, "token_delay_s": args.token_delay, "rounds": args.rounds,
            "interleaved": per_tree}


def interleaved_table(out: dict) -> str:
    lines = [(f"{out['requests']} requests at concurrency {out['concurrency']}, "
              f"{out['tokens']} tokens, worker events {out['events']}, "
              f"{out['token_delay_s'] * 1e3:g} ms between a stream's tokens; routers "
              f"interleaved, {out['rounds']} rounds; medians, ratios to the first tree "
              "per round (median, min–max)"), "",
             ("| router source | CPU / relayed token | ratio | CPU / streaming request | ratio | "
              "CPU / non-streaming request | ratio | chunks per stream |"),
             "|---|---|---|---|---|---|---|---|"]

    def ratio(d: dict) -> str:
        if d["median"] is None:
            return "n/a (no CPU measured)"
        return f"{d['median']:.3f} ({d['min']:.3f}–{d['max']:.3f})"

    for t in out["interleaved"]:
        lines.append(f"| {Path(t['src']).name} | {t['us_per_token']:.1f} µs | "
                     f"{ratio(t['ratio_us_per_token'])} | {t['stream_ms']:.2f} ms | "
                     f"{ratio(t['ratio_stream_ms'])} | {t['nonstream_ms']:.2f} ms | "
                     f"{ratio(t['ratio_nonstream_ms'])} | {t['chunks']:.0f} |")
    return "\n".join(lines)


def table(out: dict) -> str:
    t = out["tokens"]
    lines = [(f"{out['requests']} requests at concurrency {out['concurrency']}, fake workers; "
              "router CPU (all its processes, net of idle polling), medians"), "",
             ("| router source | event loop | worker events | decode streams | replicas | CPU / "
              f"request, non-streaming 1 token | CPU / request, streaming {t} tokens | CPU / "
              "relayed token | beyond fixed cost | tokens/s (wall) | tokens per router CPU-s | "
              "chunks per stream |"),
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in out["runs"]:
        ns = f"{r['nonstream_ms']:.2f} ms" if "nonstream_ms" in r else "–"
        bf = f"{r['us_beyond_fixed']:.1f} µs" if "us_beyond_fixed" in r else "–"
        ev = "coalesced" if r["coalesce"] else "1 token each"
        tr = "channel per worker" if r.get("channels") else "one per request"
        lines.append(f"| {Path(r['src']).name} | {r.get('loop', '?')} | {ev} | {tr} | "
                     f"{r['replicas']} | {ns} "
                     f"| {r['stream_ms']:.2f} ms"
                     f" | {r['us_per_token']:.1f} µs | {bf} | {r['tokens_per_s']:,.0f} | "
                     f"{r['tokens_per_cpu_s']:,.0f} | {r['chunks']:.0f} |")
    return "\n".join(lines)


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--serve-fakes":
        serve_fakes(int(sys.argv[2]), int(sys.argv[3]), os.environ["K3SERVE_CLUSTER_TOKEN"],
                    sys.argv[4] == "1", float(sys.argv[5]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--src", default=str(ROOT), help="source tree(s), comma-separated")
    ap.add_argument("--replicas", default="1", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--prefill", type=int, default=1)
    ap.add_argument("--decode", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument("--no-per-request", dest="per_request", action="store_false",
                    help="measure a tree with decode channels on its channels only (default: "
                         "also with one decode stream per request, --no-decode-channels)")
    ap.add_argument("--baseline-loop", choices=["shipped", "uvloop", "both"], default="both",
                    help="event loop of a tree that does not declare uvloop: as shipped "
                         "(asyncio's), on the uvloop installed here, or both (default)")
    ap.add_argument("--py-spy", default=None, metavar="PREFIX",
                    help="profile the router during the first round with py-spy (collapsed "
                         "stacks in PREFIX.TREE.MODE.rN.txt, streaming, and "
                         "PREFIX.TREE.MODE.nonstream.txt)")
    ap.add_argument("--interleave", action="store_true",
                    help="run every --src tree's router at once and interleave their rounds "
                         "(ratios to the first tree per round); one mode, set by --events")
    ap.add_argument("--events", choices=["each", "coalesced"], default="each",
                    help="with --interleave: the fake decode workers send one event per token "
                         "(each, what every tree reads) or merge the tokens ready together")
    ap.add_argument("--idle-s", type=float, default=5.0, metavar="S",
                    help="with --interleave: seconds of idle measured before and after the "
                         "rounds (the pollers' CPU rate, subtracted; default 5)")
    ap.add_argument("--token-delay", type=float, default=0.0, metavar="S",
                    help="seconds between two tokens of one decode stream (default 0: as fast "
                         "as the fake workers go)")
    args = ap.parse_args()
    for name in ("rounds", "requests", "concurrency"):
        if getattr(args, name) < 1:
            ap.error(f"--{name}: must be ≥ 1, got {getattr(args, name)}")
    if args.tokens < 2:  # the cost beyond the fixed one divides by tokens − 1
        ap.error(f"--tokens: must be ≥ 2, got {args.tokens}")
    for name in ("token_delay", "idle_s"):
        v = getattr(args, name)
        if not (math.isfinite(v) and v >= 0):
            ap.error(f"--{name.replace('_', '-')}: must be a finite number ≥ 0, got {v}")
    for src in args.src.split(","):
        if not (Path(src) / "router").is_dir():
            ap.error(f"--src: {src!r} is not a k3serve source tree (no router/ folder)")
    if args.interleave:
        out = asyncio.run(interleaved_async(args))
        print(interleaved_table(out))
    else:
        out = asyncio.run(main_async(args))
        print(table(out))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
