"""Router admission under overload: ~10× capacity for 30 s against a router with fake
workers (deploy/fake_workers.py; the model is a toy, so the router's admission control is
what is measured).

Capacity = what the decode slots serve: 2 fake decode workers × 8 slots, each request 8
tokens of ``--token-delay`` s; requests arrive open-loop at 10 × that rate (the router
admits slots + ``max_queued`` at once and refuses the rest). Prints: requests admitted / refused (by status), whether
every refusal had ``Retry-After``, whether every admitted one completed with the right text,
p50 / p99 latency of the admitted ones next to an unloaded baseline, and the router
process's RSS before, at peak and after: "before" is taken after a warm-up burst of the same
shape (``--warm-seconds``) and a ``gc.collect()``, "after" 2 s after the overload and another
``gc.collect()`` (``--tracemalloc``: the allocation sites that grew in between).

Run: ``python benchmarks/overload.py [--seconds 30] [--factor 10] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import resource
import statistics
import sys
import time
import tracemalloc
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from deploy.fake_stack import Stack
from deploy.fake_workers import MODEL, TOKENIZER, toy_generate
from k3serve.process import (
    nonnegative_float,
    nonnegative_int,
    output_file,
    positive_float,
    positive_int,
)
from k3serve.sampling import SamplingParams


def rss_mib() -> float:
    """Resident set size of this process (router + fakes run in it), MiB."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def want(prompt: str, max_tokens: int) -> str:
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0,
                        stop_token_ids=TOKENIZER.stop_token_ids)
    return toy_generate(TOKENIZER.encode(prompt, add_bos=True), sp)[1]


async def drive(url: str, rate: float, seconds: float, max_tokens: int) -> list[tuple]:
    """Open-loop arrivals at ``rate`` requests/s for ``seconds``; one record per request:
    (status (0: dropped connection), latency s, Retry-After header, text correct, error)."""
    out: list[tuple] = []
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=4096),
                                 timeout=120) as c:
        async def one(i: int) -> None:
            prompt = f"overload {i} "
            t0 = time.monotonic()
            try:
                r = await c.post(url + "/v1/completions", json={
                    "model": MODEL, "prompt": prompt, "max_tokens": max_tokens,
                    "temperature": 0})
            except httpx.TransportError as e:
                out.append((0, time.monotonic() - t0, None, False, repr(e)))
                return
            dt = time.monotonic() - t0
            ok = r.status_code == 200 and \
                r.json()["choices"][0]["text"] == want(prompt, max_tokens)
            out.append((r.status_code, dt, r.headers.get("retry-after"), ok, ""))

        tasks = []
        start = time.monotonic()
        i = 0
        while (now := time.monotonic()) < start + seconds:
            while i < (now - start) * rate:
                tasks.append(asyncio.create_task(one(i)))
                i += 1
            await asyncio.sleep(0.005)
        await asyncio.gather(*tasks)
    return out


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=output_file, default=None, help="write the figures here")
    ap.add_argument("--seconds", type=positive_float, default=30.0,
                    help="length of the overload, s")
    ap.add_argument("--factor", type=positive_int, default=10,
                    help="offered load as a multiple of what the slots serve")
    ap.add_argument("--max-queued", type=nonnegative_int, default=8,
                    help="the router's --max-queued")
    ap.add_argument("--token-delay", type=positive_float, default=0.5,
                    help="seconds between two tokens of the fake decode workers")
    ap.add_argument("--warm-seconds", type=nonnegative_float, default=10.0,
                    help="a burst of the overload's shape before the RSS baseline")
    ap.add_argument("--tracemalloc", action="store_true",
                    help="also print the allocation sites that grew (slower)")
    args = ap.parse_args()
    s = Stack(num_prefill=1, num_decode=2, api_key=None, max_queued=args.max_queued)
    try:
        for st, _ in s.decode:
            st.token_delay_s = args.token_delay
        service_s = 8 * args.token_delay  # one request on a slot
        capacity = 16 / service_s  # requests/s the slots serve
        warm = asyncio.run(drive(s.url, capacity / 4, 5.0, 8))  # unloaded latency baseline
        base = [r[1] for r in warm if r[0] == 200]
        # RSS baseline after a warm-up burst of the same shape as the overload (the allocator's
        # arenas, httpx / h11 / pydantic caches and the metrics' label children reach their
        # working size), so that "after" compares like with like
        asyncio.run(drive(s.url, args.factor * capacity, args.warm_seconds, 8))
        time.sleep(2.0)
        gc.collect()
        rss0 = rss_mib()
        peak = [rss0]
        if args.tracemalloc:
            tracemalloc.start(16)
            snap0 = tracemalloc.take_snapshot()

        async def watch(stop: asyncio.Event) -> None:
            while not stop.is_set():
                peak.append(rss_mib())
                await asyncio.sleep(0.5)

        async def loaded() -> list[tuple]:
            stop = asyncio.Event()
            w = asyncio.create_task(watch(stop))
            try:
                return await drive(s.url, args.factor * capacity, args.seconds, 8)
            finally:
                stop.set()
                await w

        t0 = time.monotonic()
        rec = asyncio.run(loaded())
        wall = time.monotonic() - t0
        time.sleep(2.0)
        gc.collect()
        rss1 = rss_mib()
        if args.tracemalloc:
            snap1 = tracemalloc.take_snapshot()
            print("tracemalloc: largest growth by allocation site, warm-up → after")
            for st in snap1.compare_to(snap0, "traceback")[:8]:
                print(f"  {st.size_diff / 1024:+9.1f} KiB {st.count_diff:+7d} blocks  "
                      f"{st.traceback.format()[-1].strip()}")
            tracemalloc.stop()
        adm = [r for r in rec if r[0] == 200]
        ref = [r for r in rec if r[0] != 200]
        lat = [r[1] for r in adm]
        codes: dict[int, int] = {}
        for r in ref:
            codes[r[0]] = codes.get(r[0], 0) + 1
        a = s.router.admission
        print(f"overload: {args.factor}x capacity for {wall:.1f} s: arrivals at "
              f"{args.factor * capacity:.0f}/s; capacity {capacity:.0f}/s = 16 decode slots / "
              f"{service_s:.1f} s per request; admitted at once: slots + max_queued "
              f"{args.max_queued}")
        print("| figure | value |")
        print("|---|---|")
        print(f"| requests sent | {len(rec)} |")
        print(f"| admitted (200) | {len(adm)} ({len(adm) / wall:.1f}/s) |")
        print(f"| refused | {len(ref)} " + " ".join(f"[{c}: {n}]" for c, n in sorted(codes.items()))
              + " |")
        print(f"| refusals with Retry-After | {sum(1 for r in ref if r[2])} / "
              f"{sum(1 for r in ref if r[0])} |")
        drops = [r[4] for r in ref if not r[0]]
        if drops:
            print(f"| dropped connections (no answer) | {len(drops)}: {drops[0][:60]} |")
        print(f"| admitted completed with the right text | {sum(1 for r in adm if r[3])} / "
              f"{len(adm)} |")
        print(f"| admitted latency p50 / p99 (s) | {statistics.median(lat):.3f} / "
              f"{pct(lat, 0.99):.3f} |")
        print(f"| unloaded latency p50 / p99 (s) | {statistics.median(base):.3f} / "
              f"{pct(base, 0.99):.3f} |")
        print(f"| RSS before / peak / after (MiB) | {rss0:.0f} / {max(peak):.0f} / "
              f"{rss1:.0f} |")
        print(f"| router after: admitted, seated, waiting | {a.admitted}, {a.seated}, "
              f"{len(a._waiting)} |")
        ok = (all(r[2] for r in ref if r[0]) and all(r[3] for r in adm) and a.admitted == 0
              and set(codes) <= {429, 503})
        print("overload: OK" if ok else "overload: FAILED")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"seconds": wall, "factor": args.factor, "capacity_per_s": capacity,
                           "sent": len(rec), "admitted": len(adm), "refused": codes,
                           "refused_with_retry_after": sum(1 for r in ref if r[2]),
                           "admitted_right_text": sum(1 for r in adm if r[3]),
                           "admitted_latency_p50_s": statistics.median(lat),
                           "admitted_latency_p99_s": pct(lat, 0.99),
                           "unloaded_latency_p50_s": statistics.median(base),
                           "rss_mib": {"before": rss0, "peak": max(peak), "after": rss1},
                           "ok": ok}, f, indent=1)
        return 0 if ok else 1
    finally:
        s.close()


if __name__ == "__main__":
    raise SystemExit(main())
