"""SIGSTOP one decode worker while streams run and probes arrive: does the router keep the
healthy workers' latency, and how soon do the stopped worker's streams move?

Scenario (:func:`scenario`, against any router URL):

1. three probes (``max_tokens`` 8, not streamed) before the fault: their median is the
   fault-free time;
2. ``--streams`` streams (``max_tokens`` ``--stream-tokens``) start; once every stream has
   sent a token, the victim is stopped (``SIGSTOP``);
3. a probe every ``--probe-every`` seconds for ``--duration`` seconds, each timed; the router's
   ``/health?detail=1`` is read every 0.1 s to find when the victim left placement;
4. the victim is continued (``SIGCONT``) and every stream read to its end.

Per stream: the longest gap between two chunks, and for the streams that had a gap of more
than a second while the victim was stopped (the victim's), when their tokens came again
relative to the victim leaving placement. Per probe: its latency minus the fault-free time.

Run against fake workers (started here: a prefill worker and two decode workers in this
process, the victim decode worker in a child process; the decode workers resume a migrated request as
a real one does)::

    python scripts/fault_sigstop.py --duration 110 --out sigstop.json

or against a running stack (``k3serve serve --prefill 2 --decode 2 ...``)::

    python scripts/fault_sigstop.py --router-url http://127.0.0.1:8000 --victim-pid PID \\
        --victim-url http://127.0.0.1:PORT --api-key KEY --duration 110 --out sigstop.json

The JSON result holds the figures above and ``ok`` (every probe within 2 s of the fault-free
time, every victim stream moved within 5 s of the victim leaving placement, every stream
finished).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from k3serve.messages import ResumeRequest, ResumeResponse

TOKEN = "sigstop-secret"
#: max_tokens of a stream: within the fake workers' model length (4,096 tokens with the
#: prompt); the fake workers' token delay stretches it past the stop
STREAM_TOKENS = 3000


def resumable_decode(token: str, token_delay_s: float):
    """A fake decode worker (deploy.fake_workers) that also answers ``/internal/resume``:
    the migrated request's prompt and outputs become its context, its last output token #1
    of the stream, its ``max_tokens`` what is left. Returns ``(state, server)``."""
    from deploy.fake_workers import FakeState, ServerThread, make_worker_app

    state = FakeState("decode", cluster_token=token)
    state.token_delay_s = token_delay_s
    app = make_worker_app(state)

    @app.post("/internal/resume")
    async def resume(b: ResumeRequest) -> ResumeResponse:
        import asyncio
        import uuid

        sp = b.sampling
        left = sp.max_tokens - len(b.output_token_ids) + 1
        r = {"prompt": list(b.prompt_token_ids) + list(b.output_token_ids[:-1]),
             "sampling": sp.replace(max_tokens=max(1, left)),
             "ticket": uuid.uuid4().hex, "ready": asyncio.Event(),
             "first": b.output_token_ids[-1], "aborted": False, "abort_ev": asyncio.Event()}
        r["ready"].set()
        state.reservations[b.request_id] = r
        return ResumeResponse(request_id=b.request_id,
                              position=len(b.prompt_token_ids) + len(b.output_token_ids))

    srv = ServerThread(app)
    state.url = srv.url
    return state, srv.start()


class FakeSetup:
    """A router with a prefill and a decode worker in this process and the victim decode
    worker in a child process (so that it can be stopped)."""

    def __init__(self, token_delay_s: float) -> None:
        from deploy.fake_workers import MODEL, ServerThread, start_worker
        from router.app import RouterConfig, create_app
        from router.config import ROUTER_HTTP, ROUTER_LOOP

        self.model = MODEL
        self.app = create_app(RouterConfig(model=MODEL, cluster_token=TOKEN,
                                           poll_interval_s=0.05, policy="cache_aware"))
        self.srv = ServerThread(self.app, http=ROUTER_HTTP, loop=ROUTER_LOOP).start()
        self.url = self.srv.url
        # two healthy decode workers: the victim's streams fit on them beside the probes
        self.local = [start_worker("prefill", TOKEN), resumable_decode(TOKEN, token_delay_s),
                      resumable_decode(TOKEN, token_delay_s)]
        self.child = subprocess.Popen(
            [sys.executable, __file__, "--serve-victim", str(token_delay_s)],
            stdout=subprocess.PIPE, text=True, cwd=ROOT)
        self.victim_url = self.child.stdout.readline().strip()
        self.victim_pid = self.child.pid
        for url in [st.url for st, _ in self.local] + [self.victim_url]:
            r = httpx.post(self.url + "/internal/register", json={"url": url},
                           headers={"X-K3serve-Cluster-Token": TOKEN}, timeout=10)
            r.raise_for_status()

    def on_healthy(self, rid: str) -> bool:
        """Whether request ``rid``'s first choice was reserved on a healthy decode worker
        (not on the victim, not migrated)."""
        return any(f"{rid}-0" in st.reservations for st, _ in self.local[1:])

    def close(self) -> None:
        with_pid = self.child.pid
        for sig in (signal.SIGCONT, signal.SIGKILL):
            try:
                os.kill(with_pid, sig)
            except ProcessLookupError:
                break
        self.child.wait(10)
        for _, srv in self.local:
            srv.stop()
        self.srv.stop()


def _probe(url: str, model: str, headers: dict[str, str], i: int) -> dict[str, Any]:
    t0 = time.monotonic()
    r = httpx.post(url + "/v1/completions", headers=headers, timeout=120, json={
        "model": model, "prompt": f"probe {i} " * 4, "max_tokens": 8, "temperature": 0})
    return {"sent": t0, "latency_s": time.monotonic() - t0, "status": r.status_code,
            "id": r.json().get("id") if r.status_code == 200 else None}


def _stream(url: str, model: str, headers: dict[str, str], i: int, tokens: int,
            out: dict[str, Any]) -> None:
    times: list[float] = []
    finish = None
    body = {"model": model, "prompt": f"stream {i} " * 6, "max_tokens": tokens,
            "temperature": 0, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, headers=headers,
                      timeout=300) as r:
        out["status"] = r.status_code
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if "error" in ev:
                out["error"] = ev["error"]
                break
            times.append(time.monotonic())
            finish = ev["choices"][0].get("finish_reason") or finish
    out["times"], out["finish_reason"] = times, finish


def scenario(url: str, model: str, victim_pid: int, victim_url: str, duration_s: float,
             api_key: str | None = None, streams: int = 8, stream_tokens: int = 400,
             probe_every_s: float = 2.0,
             on_healthy: Any = None) -> dict[str, Any]:
    """Run the scenario of the module docstring against the router at ``url``; returns the
    result (JSON-ready). ``on_healthy(id)``: whether the probe of response ``id`` was served
    by a healthy decode worker; ``None`` (unknown): the probes sent once the victim left
    placement are taken as served by healthy workers."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    base = statistics.median(_probe(url, model, headers, -k)["latency_s"] for k in range(3))
    outs: list[dict[str, Any]] = [{} for _ in range(streams)]
    threads = [threading.Thread(target=_stream, args=(url, model, headers, i, stream_tokens,
                                                      outs[i]), daemon=True)
               for i in range(streams)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while not all(o.get("status") for o in outs) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)  # every stream has sent tokens
    left_at: list[float] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            try:
                ws = httpx.get(url + "/health", params={"detail": 1}, headers=headers,
                               timeout=5).json()["workers"]
                if any(w["url"] == victim_url and not w["healthy"] for w in ws):
                    left_at.append(time.monotonic())
                    return
            except (httpx.HTTPError, KeyError, ValueError):
                pass
            time.sleep(0.1)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    os.kill(victim_pid, signal.SIGSTOP)
    stopped_at = time.monotonic()
    probes: list[dict[str, Any]] = []
    probe_threads = []
    k = 0
    while time.monotonic() - stopped_at < duration_s:
        def one(i: int = k) -> None:
            probes.append(_probe(url, model, headers, i))
        probe_threads.append(threading.Thread(target=one, daemon=True))
        probe_threads[-1].start()
        k += 1
        time.sleep(probe_every_s)
    for t in probe_threads:
        t.join(120)
    os.kill(victim_pid, signal.SIGCONT)
    stop.set()
    watcher.join(10)
    for t in threads:
        t.join(300)
    left = left_at[0] if left_at else None
    per_stream = []
    for o in outs:
        ts = o.get("times", [])
        gaps = [(b - a, a, b) for a, b in itertools.pairwise(ts) if a >= stopped_at - 1.0]
        gap = max(gaps, default=(0.0, 0.0, 0.0))
        victim = gap[0] > 1.0 and gap[1] < (left or stopped_at) + 1.0
        per_stream.append({
            "status": o.get("status"), "finish_reason": o.get("finish_reason"),
            "error": o.get("error"), "chunks": len(ts), "longest_gap_s": round(gap[0], 3),
            "gap_after_stop_s": [round(gap[1] - stopped_at, 3), round(gap[2] - stopped_at, 3)],
            "on_victim": victim,
            "moved_after_leaving_s": (round(gap[2] - left, 3) if victim and left else None)})
    def healthy(p: dict[str, Any]) -> bool:
        if on_healthy is not None:
            return bool(p["id"]) and on_healthy(p["id"])
        return left is not None and p["sent"] >= left

    probe_out = [{"sent_after_stop_s": round(p["sent"] - stopped_at, 3),
                  "latency_s": round(p["latency_s"], 3),
                  "over_fault_free_s": round(p["latency_s"] - base, 3),
                  "status": p["status"], "on_healthy": healthy(p)}
                 for p in sorted(probes, key=lambda p: p["sent"])]
    moved = [s["moved_after_leaving_s"] for s in per_stream if s["on_victim"]]
    ok = (left is not None
          and all(p["status"] == 200 for p in probe_out)
          and all(p["over_fault_free_s"] <= 2.0 for p in probe_out if p["on_healthy"])
          and all(m is not None and m <= 5.0 for m in moved)
          and all(s["finish_reason"] == "length" and not s["error"] for s in per_stream))
    return {"duration_s": duration_s, "fault_free_probe_s": round(base, 3),
            "left_placement_after_stop_s": round(left - stopped_at, 3) if left else None,
            "victim_streams": len(moved), "moved_after_leaving_s": moved,
            "max_healthy_probe_over_fault_free_s": max(
                (p["over_fault_free_s"] for p in probe_out if p["on_healthy"]), default=None),
            "healthy_probes": sum(p["on_healthy"] for p in probe_out),
            "probes": probe_out, "streams": per_stream, "ok": ok}


def _serve_victim(token_delay_s: float) -> None:
    _, _ = state_srv = resumable_decode(TOKEN, token_delay_s)
    print(state_srv[0].url, flush=True)
    threading.Event().wait()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=110.0, help="seconds stopped")
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--stream-tokens", type=int, default=STREAM_TOKENS,
                    help="max_tokens of a stream (within the fake workers' model length)")
    ap.add_argument("--probe-every", type=float, default=2.0, help="seconds")
    ap.add_argument("--token-delay", type=float, default=None,
                    help="fake workers: seconds per token (default: slow enough for a "
                         "stream to outlast the stop by 10 s, at least 0.02)")
    ap.add_argument("--router-url", default=None, help="a running stack (else fakes)")
    ap.add_argument("--model", default="k3-tiny")
    ap.add_argument("--victim-pid", type=int, default=None)
    ap.add_argument("--victim-url", default=None)
    ap.add_argument("--api-key", default=os.environ.get("K3SERVE_API_KEY"))
    ap.add_argument("--out", default=None, help="JSON result file (default: stdout)")
    ap.add_argument("--serve-victim", type=float, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve_victim is not None:
        _serve_victim(args.serve_victim)
        return 0
    tokens = args.stream_tokens
    delay = (args.token_delay if args.token_delay is not None
             else max(0.02, (args.duration + 10) / tokens))
    setup = None
    if args.router_url:
        if args.victim_pid is None or args.victim_url is None:
            ap.error("--router-url needs --victim-pid and --victim-url")
        url, model, pid, vurl = args.router_url, args.model, args.victim_pid, args.victim_url
    else:
        setup = FakeSetup(delay)
        url, model, pid, vurl = setup.url, setup.model, setup.victim_pid, setup.victim_url
    try:
        res = scenario(url, model, pid, vurl, args.duration, args.api_key, args.streams,
                       tokens, args.probe_every, setup.on_healthy if setup else None)
    finally:
        if setup is not None:
            setup.close()
    res["command"] = " ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])])
    text = json.dumps(res, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(json.dumps({k: v for k, v in res.items() if k not in ("probes", "streams")}))
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
