"""Stop a live ``k3serve serve`` stack while it streams, and check that the stop drained.

Starts ``python -m cli serve`` (k3-tiny on the CPU, 2 prefill + 1 decode workers by default) in
a session of its own, so its process group is the launcher's pid; opens ``--streams`` streaming
completions of ``--tokens`` tokens each (greedy, ``ignore_eos``); once every stream has its
first token, sends the stop signal, then checks:

* every stream ended with all its tokens (``finish_reason: length``) within ``--drain-timeout``
  seconds of the signal;
* the launcher exited 0, and no process it started is left;
* the terminal output (the launcher's and every component's) has no traceback
  (:data:`TRACEBACK_MARKS`) and no restart (``restarting``, ``died``);
* ``ps`` titles: ``k3serve serve``, ``k3serve forkserver`` (deploy/forkserver.py),
  ``k3serve router :PORT``, ``k3serve prefill-worker :PORT``, ``k3serve decode-worker :PORT``.

Modes: ``group-term`` (``kill -TERM -PGID``), ``launcher-term`` (``kill -TERM PID``),
``group-int`` (a terminal's Ctrl-C: SIGINT to the group), ``group-int-twice`` (Ctrl-C twice,
:data:`TWICE_AFTER_S` apart: the stack stops at once instead of draining, so the streams'
tokens are not checked; every stream must end within :data:`AT_ONCE_S` of the first signal,
with the other checks as above). Prints one JSON object per mode and exits 1 when a check
failed::

    python scripts/shutdown_drain.py --tokens 1024 --json drain.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
MODES = {"group-term": (signal.SIGTERM, True), "launcher-term": (signal.SIGTERM, False),
         "group-int": (signal.SIGINT, True), "group-int-twice": (signal.SIGINT, True)}
#: what a traceback, or an error logged in its place, leaves in the output
TRACEBACK_MARKS = ("Traceback", "Exception in ASGI application", "Unhandled exception",
                   "was never awaited")
#: seconds between the two Ctrl-Cs of ``group-int-twice``
TWICE_AFTER_S = 0.3
#: ``group-int-twice``: every stream ends within this many seconds of the first signal (a
#: worker's open streams get at most 3 s after the second SIGINT)
AT_ONCE_S = 15.0


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def descendants(pid: int) -> dict[int, str]:
    """``{pid: title}`` of every process below ``pid`` (from ``/proc``)."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(d))
    out, todo = {}, [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out[c] = title(c)
            todo.append(c)
    return out


def title(pid: int) -> str:
    """What ``ps -o args`` shows for ``pid`` ("" once it is gone)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


async def _stream(c: httpx.AsyncClient, url: str, i: int, tokens: int,
                  started: asyncio.Event) -> dict:
    n, finish, t_end = 0, None, None
    try:
        async with c.stream("POST", url + "/v1/completions", json={
                "model": "k3-tiny", "prompt": f"Stream {i}: once upon a time", "max_tokens": tokens,
                "temperature": 0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}) as r:
            async for line in r.aiter_lines():
                if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                    continue
                ev = json.loads(line[5:])
                if ev.get("usage"):
                    n = ev["usage"]["completion_tokens"]
                for ch in ev.get("choices") or ():
                    finish = ch.get("finish_reason") or finish
                    started.set()
        t_end = time.monotonic()
    except httpx.HTTPError as e:
        return {"tokens": n, "finish": f"error: {e!r}", "t_end": time.monotonic()}
    return {"tokens": n, "finish": finish, "t_end": t_end}


def run_mode(mode: str, tokens: int, streams: int, drain_timeout: float, prefill: int = 2,
             decode: int = 1, ready_timeout: float = 180.0) -> dict:
    """One stop of a fresh stack (module docstring); returns the figures and ``ok``."""
    sig, group = MODES[mode]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    out: list[str] = []
    p = subprocess.Popen(
        [sys.executable, "-m", "cli", "serve", "--port", str(port), "--prefill", str(prefill),
         "--decode", str(decode), "--block-size", "16", "--drain-timeout", str(drain_timeout)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True)
    ready = threading.Event()

    def read() -> None:
        for line in p.stdout:
            out.append(line)
            if "serving" in line:
                ready.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    res: dict = {"mode": mode, "tokens": tokens, "streams": streams,
                 "drain_timeout_s": drain_timeout}
    try:
        if not ready.wait(ready_timeout):
            raise RuntimeError("stack not ready:\n" + "".join(out[-40:]))
        kids = descendants(p.pid)
        res["titles"] = sorted({" ".join(t.split()[:2]) for t in [title(p.pid), *kids.values()]})

        async def go() -> list[dict]:
            async with httpx.AsyncClient(timeout=drain_timeout + 60) as c:
                started = [asyncio.Event() for _ in range(streams)]
                tasks = [asyncio.create_task(_stream(c, url, i, tokens, s))
                         for i, s in enumerate(started)]
                await asyncio.wait_for(asyncio.gather(*(s.wait() for s in started)), 120)
                res["t_signal"] = time.monotonic()
                os.killpg(p.pid, sig) if group else p.send_signal(sig)
                if mode == "group-int-twice":
                    await asyncio.sleep(TWICE_AFTER_S)
                    os.killpg(p.pid, sig)
                return await asyncio.gather(*tasks)

        got = asyncio.run(go())
        rc = p.wait(drain_timeout + 30)
        reader.join(5)
        t_sig = res.pop("t_signal")
        res["stream_tokens"] = [g["tokens"] for g in got]
        res["finish"] = sorted({str(g["finish"]) for g in got})
        res["last_stream_end_s"] = round(max(g["t_end"] - t_sig for g in got), 2)
        res["launcher_exit"] = rc
        t_end = time.monotonic() + 10
        while any(alive(k) for k in kids) and time.monotonic() < t_end:
            time.sleep(0.1)
        res["left_running"] = [f"{k} {t}" for k, t in kids.items() if alive(k)]
        text = "".join(out)
        res["tracebacks"] = sum(text.count(m) for m in TRACEBACK_MARKS)
        res["restarts"] = sum(text.count(w) for w in ("restarting", " died", "restarted"))
        if mode == "group-int-twice":
            streams_ok = res["last_stream_end_s"] <= AT_ONCE_S
        else:
            streams_ok = (all(g["tokens"] == tokens and g["finish"] == "length" for g in got)
                          and res["last_stream_end_s"] <= drain_timeout)
        res["ok"] = (streams_ok and rc == 0
                     and not res["left_running"] and not res["tracebacks"]
                     and not res["restarts"])
        res["output_tail"] = out[-12:]
        return res
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated: " + ", ".join(MODES))
    ap.add_argument("--tokens", type=int, default=1024, help="tokens per stream")
    ap.add_argument("--streams", type=int, default=8, help="concurrent streams")
    ap.add_argument("--drain-timeout", type=float, default=60.0, help="the workers' drain (s)")
    ap.add_argument("--json", default=None, help="write the results here")
    a = ap.parse_args(argv)
    results = []
    for mode in a.modes.split(","):
        r = run_mode(mode, a.tokens, a.streams, a.drain_timeout)
        results.append(r)
        print(json.dumps({k: v for k, v in r.items() if k != "output_tail"}), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
