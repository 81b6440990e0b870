"""Router CPU per relayed token in ``router.stream.relay_batch``: a tree whose router
detokenizes the decode stream (stop strings, held-back text) against one that relays the text
the decode worker's detokenizer released.

The decode worker's events for 1,024 tokens of English bytes (k3serve's byte tokenizer) are
built once per case (1 or 4 tokens per event; logprobs asked for or not; one stop string that
never matches or none), then relayed event by event, 5 times; the figure is process CPU time
per token, the best of 7 repeats (the box is shared: the minimum is the least disturbed).
Each tree runs in its own interpreter (``PYTHONPATH=TREE``); a tree's ``relay_batch`` that
takes a detokenizer is fed one, as its router does.

Usage::

    python benchmarks/relay_detok.py --src /tmp/base,. [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import inspect, json, time
from k3serve.messages import StreamEvent, TokenLogprob
from k3serve.sampling import SamplingParams
from k3serve.tokenizer import ByteTokenizer
from k3serve.tokenizer.detok import IncrementalDetokenizer
from router.stream import relay_batch
tok = ByteTokenizer()
ids = tok.encode("The quick brown fox jumps over the lazy dog. " * 40)[:1024]
router_detok = "detok" in inspect.signature(relay_batch).parameters
out = {}
for per in (1, 4):
    for lp in (False, True):
        for stop in ((), ("zzz end",)):
            sp = SamplingParams(max_tokens=5000, stop=stop, logprobs=0 if lp else None)
            d = IncrementalDetokenizer(tok, sp, eos_token_id=tok.eos_token_id)
            evs = []
            for i in range(0, len(ids), per):
                chunk = ids[i:i + per]
                pieces = [d.step(t).new_text for t in chunk]
                evs.append(StreamEvent(token_ids=chunk, text="".join(pieces),
                                       texts=pieces if lp else None,
                                       logprobs=[TokenLogprob(logprob=-0.5) for _ in chunk]))
            best = float("inf")
            for _ in range(7):
                t0 = time.process_time()
                for _ in range(5):
                    if router_detok:
                        det = IncrementalDetokenizer(tok, sp, eos_token_id=tok.eos_token_id)
                        for e in evs:
                            relay_batch(0, [e], det, lp)
                    else:
                        for e in evs:
                            relay_batch(0, [e], lp)
                best = min(best, (time.process_time() - t0) / 5 / len(ids) * 1e6)
            out[f"{per} tok/event, logprobs {'on' if lp else 'off'}, "
                f"stop {'on' if stop else 'off'}"] = round(best, 2)
print(json.dumps({"router_detokenizes": router_detok, "us_per_token": out}))
"""


def measure(tree: Path) -> dict:
    """One tree's figures (a child interpreter importing from ``tree``)."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    res = subprocess.run([sys.executable, "-c", CHILD], cwd=tree, env=env, check=True,
                         capture_output=True, text=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--src", default=".", help="source trees, comma-separated")
    ap.add_argument("--json", default=None, help="write the figures here")
    args = ap.parse_args()
    trees = [Path(t).resolve() for t in args.src.split(",")]
    results = {str(t): measure(t) for t in trees}
    cases = next(iter(results.values()))["us_per_token"]
    print("case".ljust(42) + "".join(Path(t).name[:16].rjust(18) for t in results))
    for case in cases:
        print(case.ljust(42) + "".join(f"{r['us_per_token'][case]:>15.2f} µs"
                                       for r in results.values()))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
