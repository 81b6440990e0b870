"""Send a workload to a live stack: streaming ``POST /v1/completions`` per request at its
arrival time (httpx, asyncio), a tqdm progress bar, and the router's ``/metrics`` polled for
queue depth and read before / after for its counters.

Times are ``time.monotonic()`` seconds relative to the start of the run.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import time
from dataclasses import dataclass, field

import httpx
from tqdm import tqdm

from cli.bench.workload import BenchRequest


@dataclass
class RequestResult:
    """What one request measured (seconds since the run started).

    Attributes:
        sent_s: when it was sent.
        first_s: when its first text chunk came (token #1); ``None``: never.
        chunk_s: arrival of every later chunk (one engine step each).
        done_s: when the stream ended.
        prompt_tokens / completion_tokens / cached_tokens: from the final ``usage`` chunk.
        error: why it failed (``None``: it did not).
    """

    sent_s: float
    prompt_len: int
    max_tokens: int
    oracle_cached: int = 0
    first_s: float | None = None
    chunk_s: list[float] = field(default_factory=list)
    done_s: float | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.first_s is not None

    @property
    def ttft(self) -> float:
        return self.first_s - self.sent_s

    @property
    def itls(self) -> list[float]:
        """Gaps between successive chunks, s (the first from token #1)."""
        ts = [self.first_s, *self.chunk_s]
        return [b - a for a, b in itertools.pairwise(ts)]


def parse_prometheus(text: str) -> dict[str, float]:
    """Sum every sample of the exposition ``text`` by metric name (labels summed over).

    ``name{a="x"} 3`` and ``name{a="y"} 4`` → ``{"name": 7.0}``; comments are skipped.
    """
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_labels, _, value = line.rpartition(" ")
        name = name_labels.split("{", 1)[0]
        try:
            v = float(value)
        except ValueError:
            continue
        if math.isfinite(v):
            out[name] = out.get(name, 0.0) + v
    return out


def error_message(response: httpx.Response) -> str:
    """The server's error text of ``response``: the ``message`` of an OpenAI-style body
    (``{"error": {"message": ..., "code": ...}}``) or of an internal one (``{"error": CODE,
    "message": ...}``), else the first 200 characters of the body (``""``: none)."""
    try:
        body = response.json()
    except ValueError:
        return response.text.strip()[:200]
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, dict):
        return str(err.get("message") or err.get("code") or "").strip()
    if isinstance(body, dict) and body.get("message"):
        return str(body["message"]).strip()
    return str(err or body).strip()[:200]


def describe_error(e: httpx.HTTPError) -> str:
    """One line for ``e``: ``HTTP 401 Unauthorized from GET URL: MESSAGE`` for an error
    answer (the server's message, :func:`error_message`), ``cannot reach URL: WHY`` when no
    answer came."""
    if isinstance(e, httpx.HTTPStatusError):
        r = e.response
        msg = error_message(r)
        line = f"HTTP {r.status_code} {r.reason_phrase} from {e.request.method} {e.request.url}"
        line += f": {msg}" if msg else ""
        if r.status_code == 401:
            line += " (give the key with --api-key or K3SERVE_API_KEY)"
        return line
    try:
        where = f"{e.request.method} {e.request.url}"
    except RuntimeError:  # an error raised outside a request
        return f"{type(e).__name__}: {e}"
    return f"cannot reach {where}: {e or type(e).__name__}"


async def scrape(client: httpx.AsyncClient, url: str) -> dict[str, float]:
    """The router's ``/metrics`` summed by name (:func:`parse_prometheus`).

    Raises:
        httpx.HTTPStatusError: an error answer (401 without the right API key).
        httpx.RequestError: no answer (the router is not there).
    """
    r = await client.get(url.rstrip("/") + "/metrics", timeout=10.0)
    r.raise_for_status()
    return parse_prometheus(r.text)


async def _one(client: httpx.AsyncClient, url: str, model: str, req: BenchRequest,
               t0: float, res: RequestResult) -> None:
    body = {"model": model, "prompt": req.prompt, "max_tokens": req.max_tokens,
            "temperature": 0.0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    try:
        async with client.stream("POST", url.rstrip("/") + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                res.error = f"HTTP {r.status_code}: {error_message(r)}"[:300]
                return
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now = time.monotonic() - t0
                obj = json.loads(data)
                if "error" in obj:
                    res.error = str(obj["error"])[:300]
                    continue
                if obj.get("usage"):
                    u = obj["usage"]
                    res.prompt_tokens = u.get("prompt_tokens", 0)
                    res.completion_tokens = u.get("completion_tokens", 0)
                    det = u.get("prompt_tokens_details") or {}
                    res.cached_tokens = det.get("cached_tokens") or 0
                if obj.get("choices"):
                    if res.first_s is None:
                        res.first_s = now
                    else:
                        res.chunk_s.append(now)
    except httpx.HTTPError as e:
        res.error = describe_error(e)[:300]
    finally:
        res.done_s = time.monotonic() - t0


async def _poll_queue(client: httpx.AsyncClient, url: str, t0: float,
                      out: list[tuple[float, float, float]], stop: asyncio.Event,
                      every_s: float) -> None:
    """Append (t, waiting, running) from the router's gauges every ``every_s`` seconds."""
    while not stop.is_set():
        try:
            m = await scrape(client, url)
            out.append((time.monotonic() - t0, m.get("k3serve:num_requests_waiting", 0.0),
                        m.get("k3serve:num_requests_running", 0.0)))
        except (httpx.HTTPError, ValueError):
            pass
        try:
            await asyncio.wait_for(stop.wait(), every_s)
        except TimeoutError:
            pass


@dataclass
class RunOutcome:
    """A finished run: per-request results, the queue samples, /metrics before and after."""

    results: list[RequestResult]
    duration_s: float
    queue: list[tuple[float, float, float]]
    metrics_before: dict[str, float]
    metrics_after: dict[str, float]


async def run_load_async(url: str, requests: list[BenchRequest], *, model: str = "k3-tiny",
                         api_key: str | None = None, timeout_s: float = 600.0,
                         poll_s: float = 0.25, progress: bool = True) -> RunOutcome:
    """Send ``requests`` at their arrival times and wait for every stream to end."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(timeout_s),
                                 limits=limits) as client:
        before = await scrape(client, url)
        t0 = time.monotonic()
        queue: list[tuple[float, float, float]] = []
        stop = asyncio.Event()
        poller = asyncio.create_task(_poll_queue(client, url, t0, queue, stop, poll_s))
        bar = tqdm(total=len(requests), desc="k3serve bench", unit="req", disable=not progress)
        results: list[RequestResult] = []

        async def launch(req: BenchRequest) -> None:
            delay = req.arrival_s - (time.monotonic() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            res = RequestResult(time.monotonic() - t0, len(req.prompt), req.max_tokens,
                                req.oracle_cached)
            results.append(res)
            await _one(client, url, model, req, t0, res)
            bar.update(1)

        await asyncio.gather(*(launch(r) for r in requests))
        duration = time.monotonic() - t0
        bar.close()
        stop.set()
        await poller
        await asyncio.sleep(0.3)  # the router counts e2e after the last chunk went out
        after = await scrape(client, url)
    results.sort(key=lambda r: r.sent_s)
    return RunOutcome(results, duration, queue, before, after)


def run_load(url: str, requests: list[BenchRequest], **kw) -> RunOutcome:
    """:func:`run_load_async` from synchronous code."""
    return asyncio.run(run_load_async(url, requests, **kw))


__all__ = ["RequestResult", "RunOutcome", "describe_error", "error_message", "parse_prometheus",
           "run_load", "run_load_async", "scrape"]
