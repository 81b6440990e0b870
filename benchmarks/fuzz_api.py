"""The API fuzz, long form: ``schemathesis`` cases (default 1 000) drawn from
the router's own OpenAPI schema (``/v1/*``, ``/health``; positive and negative, ``max_tokens``
capped small) against a live router with fake workers (deploy/fake_workers.py). Prints the
statuses per operation and mode, the 4xx answers to schema-valid cases, and every answer
≥ 500 (there must be none). The CI version (300 cases): tests/router/test_fuzz_api.py.

Run: ``python benchmarks/fuzz_api.py [--cases 1000] [--seed 15] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # router_fuzz
from router_fuzz import fuzz

from deploy.fake_stack import Stack
from k3serve.process import output_file, positive_int


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=positive_int, default=1000, help="requests generated")
    ap.add_argument("--seed", type=int, default=15, help="hypothesis seed")
    ap.add_argument("--json", type=output_file, default=None, help="write the result here")
    args = ap.parse_args()
    s = Stack(num_prefill=1, num_decode=1, api_key=None)
    try:
        t0 = time.monotonic()
        st = fuzz(s.url, s.app.openapi(), cases=args.cases, seed=args.seed)
        wall = time.monotonic() - t0
        print(f"fuzz_api: {st.cases} cases in {wall:.0f} s (HTTP calls {st.call_s:.0f} s)")
        print(st.table())
        pos = st.count("positive")
        ok = st.count("positive", 200)
        print(f"schema-valid cases answered 200: {ok} / {pos}")
        print("4xx answers to schema-valid cases:")
        for why, n in st.rejected_valid.most_common(10):
            print(f"  {n:4d}  {why[:150]}")
        print(f"answers >= 500: {len(st.server_errors)}")
        for e in st.server_errors[:20]:
            print("  " + e[:300])
        healthy = s.health()["num_workers_healthy"]
        print(f"workers healthy after: {healthy} / 2")
        good = not st.server_errors and healthy == 2 and st.cases >= args.cases * 0.9
        print("fuzz_api: OK" if good else "fuzz_api: FAILED")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"cases": st.cases, "seconds": wall, "schema_valid": pos,
                           "schema_valid_200": ok, "server_errors": len(st.server_errors),
                           "workers_healthy_after": healthy, "ok": good}, f, indent=1)
        return 0 if good else 1
    finally:
        s.close()


if __name__ == "__main__":
    raise SystemExit(main())
