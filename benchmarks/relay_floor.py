"""The floor of the router's relay stack: what a minimal SSE relay on the same
libraries costs per stream, to set beside ``benchmarks/router_relay.py``'s router figures.

Processes: an SSE source (``--tokens`` one-token events per ``POST``, written by sse-starlette
with one loop turn between events, as the fake decode workers of deploy/fake_workers.py do; its
own process, uvicorn h11 on asyncio's loop); a relay (uvicorn httptools on uvloop, the router's
settings: router/config.py) that, per client ``POST /v1/completions``, opens the source's stream
with aiohttp, splits the SSE body, decodes each event with msgspec and writes one client chunk
per network read, then a usage chunk and ``[DONE]``; this process is the client
(``router_relay.load``: ``--requests`` streams at ``--concurrency``). No reservation, prefill,
detokenizer, placement or metrics: the HTTP, event-loop and parsing work of a relay only.

Relays (``--relays``):

* ``raw``: a plain ASGI app, the relay loop in the response's task;
* ``fastapi``: the same loop in a FastAPI route's response (FastAPI's middleware and routing
  around it, as the router's ``SSEResponse``);
* ``queue``: ``raw`` with the stream read in a task of its own that queues the chunks for the
  response's task (the router's reader / writer split).

Relay CPU = user + system seconds of the relay process over the load (psutil), medians of
``--rounds``. Usage::

    python benchmarks/relay_floor.py [--relays raw,fastapi,queue] [--requests 200] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from starlette.requests import Request  # module level: FastAPI resolves the route's annotation

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from k3serve.process import positive_int


# ---------------------------------------------------------------- source (child process)
def serve_source(port: int, tokens: int) -> None:
    import uvicorn
    from fastapi import FastAPI
    from sse_starlette import EventSourceResponse

    app = FastAPI()
    event = json.dumps({"token_ids": [97], "text": "a"})

    @app.post("/stream")
    async def stream() -> EventSourceResponse:
        async def gen():
            for _ in range(tokens):
                yield event
                await asyncio.sleep(0)
            yield "[DONE]"

        return EventSourceResponse(gen(), sep="\n")

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="error", http="h11", loop="asyncio")


# ---------------------------------------------------------------- relay (child process)
def serve_relay(port: int, source: str, kind: str) -> None:
    import aiohttp
    import msgspec
    import uvicorn

    from router.config import ROUTER_HTTP, ROUTER_LOOP

    decode = msgspec.json.Decoder().decode
    state: dict = {}

    def session() -> aiohttp.ClientSession:
        if "s" not in state:
            state["s"] = aiohttp.ClientSession(cookie_jar=aiohttp.DummyCookieJar(),
                                               connector=aiohttp.TCPConnector(limit=0))
        return state["s"]

    async def relay(emit) -> int:
        """Read the source's stream; ``emit(bytes)`` one client chunk per network read;
        returns the tokens relayed."""
        n, buf = 0, b""
        async with session().post(source, data=b"{}") as r:
            async for chunk in r.content.iter_any():
                buf = (buf + chunk).replace(b"\r\n", b"\n")
                *events, buf = buf.split(b"\n\n")
                out = []
                for ev in events:
                    data = ev[6:]
                    if data == b"[DONE]":
                        continue
                    e = decode(data)
                    n += len(e["token_ids"])
                    out.append(b'data: {"object":"text_completion","choices":[{"index":0,'
                               b'"text":' + json.dumps(e["text"]).encode() + b'}]}\n\n')
                if out:
                    await emit(b"".join(out))
        return n

    async def respond(send) -> None:
        async def emit(body: bytes) -> None:
            await send({"type": "http.response.body", "body": body, "more_body": True})

        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        if kind == "queue":
            q: asyncio.Queue = asyncio.Queue()

            async def reader() -> None:
                q.put_nowait(await relay(q.put))

            task = asyncio.create_task(reader())
            while not isinstance(item := await q.get(), int):
                await emit(item)
            await task
            n = item
        else:
            n = await relay(emit)
        tail = {"object": "text_completion", "choices": [], "usage": {"completion_tokens": n}}
        await send({"type": "http.response.body", "more_body": False,
                    "body": b"data: " + json.dumps(tail).encode() + b"\n\ndata: [DONE]\n\n"})

    async def raw(scope, receive, send) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        while (await receive()).get("more_body"):
            pass
        await respond(send)

    app = raw
    if kind == "fastapi":
        from fastapi import FastAPI
        from starlette.responses import Response

        app = FastAPI()

        class Relayed(Response):
            def __init__(self) -> None:
                self.status_code, self.background = 200, None
                self.init_headers({"content-type": "text/event-stream"})

            async def __call__(self, scope, receive, send) -> None:
                await respond(send)

        @app.post("/v1/completions")
        async def completions(request: Request) -> Response:
            await request.body()
            return Relayed()

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="error", http=ROUTER_HTTP,
                loop=ROUTER_LOOP)


# ---------------------------------------------------------------- driver
def _start(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(Path(__file__).resolve()), *args], cwd=ROOT)


async def _wait_up(url: str) -> None:
    import httpx

    deadline = time.monotonic() + 30
    async with httpx.AsyncClient() as c:
        while True:
            try:
                await c.get(url)
                return
            except httpx.HTTPError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{url} did not start") from None
                await asyncio.sleep(0.1)


async def main_async(args) -> list[dict]:
    import router_relay as rr

    sport = rr._free_port()
    source = _start("--serve-source", str(sport), str(args.tokens))
    rows = []
    try:
        await _wait_up(f"http://127.0.0.1:{sport}/")
        for kind in args.relays:
            rport = rr._free_port()
            relay = _start("--serve-relay", str(rport), f"http://127.0.0.1:{sport}/stream", kind)
            url = f"http://127.0.0.1:{rport}"
            try:
                await _wait_up(url + "/")
                await rr.load(url, args.concurrency, args.concurrency, True, args.tokens, 0)
                res = []
                for _ in range(args.rounds):
                    c0 = rr.cpu_seconds(relay.pid)
                    toks, chunks, _ = await rr.load(url, args.requests, args.concurrency, True,
                                                    args.tokens, 0)
                    cpu = rr.cpu_seconds(relay.pid) - c0
                    if not toks:
                        raise RuntimeError(f"relay {kind}: every stream failed")
                    res.append((1e3 * cpu / args.requests, 1e6 * cpu / toks,
                                chunks / args.requests))
                rows.append({"relay": kind, "ms_per_stream": statistics.median(r[0] for r in res),
                             "us_per_token": statistics.median(r[1] for r in res),
                             "chunks": statistics.median(r[2] for r in res)})
                print(json.dumps(rows[-1]), flush=True)
            finally:
                relay.terminate()
                relay.wait(15)
    finally:
        source.terminate()
        source.wait(15)
    return rows


def result(args: argparse.Namespace, rows: list[dict]) -> dict:
    """The JSON of ``--json``: the settings and one row per relay (``ms_per_stream``: relay
    CPU ms per stream; ``us_per_token``: relay CPU µs per relayed token; ``chunks``: client
    chunks per stream; medians over ``rounds``)."""
    return {"benchmark": "relay_floor", "requests": args.requests,
            "concurrency": args.concurrency, "tokens": args.tokens, "rounds": args.rounds,
            "units": {"ms_per_stream": "ms CPU / stream", "us_per_token": "µs CPU / token",
                      "chunks": "chunks / stream"},
            "relays": rows}


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--serve-source":
        serve_source(int(sys.argv[2]), int(sys.argv[3]))
        return 0
    if len(sys.argv) > 1 and sys.argv[1] == "--serve-relay":
        serve_relay(int(sys.argv[2]), sys.argv[3], sys.argv[4])
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--relays", default="raw,fastapi,queue", type=lambda s: s.split(","),
                    help="relays to measure, comma-separated: raw, fastapi, queue")
    ap.add_argument("--requests", type=positive_int, default=200, help="streams per round")
    ap.add_argument("--concurrency", type=positive_int, default=32, help="streams open at once")
    ap.add_argument("--tokens", type=positive_int, default=128, help="one-token events per stream")
    ap.add_argument("--rounds", type=positive_int, default=3, help="rounds per relay (medians)")
    ap.add_argument("--json", default=None, metavar="PATH",
                    help="write the settings and every relay's figures to PATH as JSON")
    args = ap.parse_args()
    rows = asyncio.run(main_async(args))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result(args, rows), indent=1) + "\n")
    print(f"\n{args.requests} streams of {args.tokens} tokens at concurrency {args.concurrency}; "
          "relay CPU (psutil), medians\n")
    print("| relay | CPU / stream | CPU / relayed token | chunks per stream |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['relay']} | {r['ms_per_stream']:.2f} ms | {r['us_per_token']:.1f} µs | "
              f"{r['chunks']:.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
