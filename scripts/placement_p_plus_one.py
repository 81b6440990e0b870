"""P, then P + 1 character, on fresh stacks: does the extension reuse P's prefix?

Each trial starts a fresh stack (k3-tiny on the CPU, no shared store, block size 64), sends a
completion of a prompt P of 3,072 characters, and right after its answer a completion of P
plus one character. The extension should be placed where P was computed and reuse P's whole
prefix there: its ``usage.prompt_tokens_details.cached_tokens`` ≥ 3,008, and the router's
``k3serve:request_cached_tokens_total{source="local"}`` of the chosen worker grown by as
much (a hit in that worker's own cache, not the store).

Two shapes: ``pd`` (2 prefill workers + 1 decode worker) and ``mono`` (2 workers that each
prefill and decode). Writes JSON: every trial's figures and a summary per shape::

    python scripts/placement_p_plus_one.py --stacks 10 --out placement_p_plus_one.json
"""

from __future__ import annotations

import argparse
import json
import random
import string
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MODEL = "k3-tiny"
P_CHARS = 3072
MIN_CACHED = 3008
BLOCK_SIZE = 64


def local_cached(url: str) -> dict[str, float]:
    """The router's ``k3serve:request_cached_tokens_total{source="local"}`` by worker."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=10).text
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "k3serve:request_cached_tokens_total" \
                    and s.labels.get("source") == "local":
                out[s.labels["worker"]] = out.get(s.labels["worker"], 0.0) + s.value
    return out


def prompt(seed: int) -> str:
    """A prompt of :data:`P_CHARS` printable ASCII characters (one token each, byte-level)."""
    rng = random.Random(seed)
    words = []
    n = 0
    while n < P_CHARS:
        w = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(2, 9)))
        words.append(w)
        n += len(w) + 1
    return " ".join(words)[:P_CHARS]


def trial(shape: str, seed: int, log_dir: str | None = None) -> dict:
    """One fresh stack of ``shape`` (``pd`` or ``mono``): P, then P + 1 character.

    Returns:
        ``{"shape", "seed", "p_tokens", "p_cached", "p1_tokens", "p1_cached", "p1_local",
        "p1_worker", "p1_seconds", "p_seconds", "ok"}``: ``p1_local`` is the growth of the
        chosen worker's local cached tokens in the router's metrics; ``ok``: ``p1_cached`` and
        ``p1_local`` both ≥ :data:`MIN_CACHED`.
    """
    from openai import OpenAI

    from deploy.launcher import start_stack

    kw = {"monolithic": 2} if shape == "mono" else {"num_prefill": 2, "num_decode": 1}
    st = start_stack(model=MODEL, block_size=BLOCK_SIZE, log_dir=log_dir, ready_timeout=300,
                     **kw)
    try:
        client = OpenAI(base_url=st.url + "/v1", api_key="none", max_retries=0, timeout=300)
        p = prompt(seed)
        t0 = time.monotonic()
        a = client.completions.create(model=MODEL, prompt=p, max_tokens=2, temperature=0)
        t1 = time.monotonic()
        before = local_cached(st.url)
        b = client.completions.create(model=MODEL, prompt=p + "x", max_tokens=2,
                                      temperature=0)
        t2 = time.monotonic()
        after = local_cached(st.url)
        grown = {w: after.get(w, 0.0) - before.get(w, 0.0) for w in after}
        worker = max(grown, key=grown.get) if grown else None
        local = grown.get(worker, 0.0) if worker else 0.0
        cached = b.usage.prompt_tokens_details.cached_tokens
        return {"shape": shape, "seed": seed, "p_tokens": a.usage.prompt_tokens,
                "p_cached": a.usage.prompt_tokens_details.cached_tokens,
                "p1_tokens": b.usage.prompt_tokens, "p1_cached": cached, "p1_local": local,
                "p1_worker": worker, "p_seconds": round(t1 - t0, 3),
                "p1_seconds": round(t2 - t1, 3),
                "ok": cached >= MIN_CACHED and local >= MIN_CACHED}
    finally:
        st.stop()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--stacks", type=int, default=10, help="fresh stacks per shape")
    ap.add_argument("--shapes", default="pd,mono", help="comma-separated: pd, mono")
    ap.add_argument("--out", default="placement_p_plus_one.json")
    ap.add_argument("--logs", default=None, help="keep the stacks' logs here (default: a "
                    "temporary folder, removed)")
    args = ap.parse_args(argv)
    trials = []
    with tempfile.TemporaryDirectory() as tmp:
        logs = args.logs or tmp
        for shape in args.shapes.split(","):
            for i in range(args.stacks):
                r = trial(shape, seed=i, log_dir=str(Path(logs) / f"{shape}{i}"))
                print(json.dumps(r), flush=True)
                trials.append(r)
    summary = {}
    for shape in args.shapes.split(","):
        rs = [r for r in trials if r["shape"] == shape]
        summary[shape] = {"stacks": len(rs), "ok": sum(r["ok"] for r in rs),
                          "min_p1_cached": min(r["p1_cached"] for r in rs),
                          "min_p1_local": min(r["p1_local"] for r in rs)}
    doc = {"model": MODEL, "p_chars": P_CHARS, "block_size": BLOCK_SIZE,
           "min_cached": MIN_CACHED, "store": False, "summary": summary, "trials": trials}
    Path(args.out).write_text(json.dumps(doc, indent=1))
    print(json.dumps(summary))
    return 0 if all(s["ok"] == s["stacks"] for s in summary.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
