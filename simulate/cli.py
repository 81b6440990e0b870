"""``k3serve simulate`` (``python -m simulate``): the command line of the simulator."""

from __future__ import annotations

import argparse
import math
import sys


def _workers(spec: str) -> tuple[int, int]:
    """``P:D`` → (prefill, decode) worker counts; argparse names the flag in its message."""
    parts = spec.split(":")
    try:
        p, d = (int(x) for x in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected P:D, got {spec!r}") from None
    if p < 1 or d < 0:
        raise argparse.ArgumentTypeError(f"expected P:D with P ≥ 1, D ≥ 0, got {spec!r}")
    return p, d


def cmd_simulate(args: argparse.Namespace) -> int:
    if args.rate is not None and not (math.isfinite(args.rate) and args.rate > 0):
        raise ValueError(f"rate: must be a finite number > 0, got {args.rate}")
    if args.length_scale is not None:  # a live stack's slice (simulate/live.py)
        from simulate.live import cmd_live

        return cmd_live(args)
    from k3serve.process import writing
    from router.policies.home import HomeParams
    from router.policies.table import DEFAULT_POLICY, POLICIES
    from simulate import SimConfig, load_calibration, run, trace_facts
    from simulate.report import plot, table, to_json, write_json
    from simulate.traces import load_trace

    cal = load_calibration(args.calibration).with_rate(args.rate)
    p, d = args.workers
    cfg = SimConfig(prefill_workers=p, decode_workers=d, cache_fraction=args.cache_fraction,
                    load=args.load, store_fraction=args.store_fraction,
                    store_snapshot_interval=args.store_snapshot_interval, calibration=cal,
                    params=HomeParams())
    reqs = load_trace(args.trace)
    facts = trace_facts(reqs)
    policies = args.policy or sorted(POLICIES, key=lambda n: (n != DEFAULT_POLICY, n))
    results = run(reqs, policies, cfg, jobs=args.jobs, progress=not args.no_progress,
                  facts=facts)
    print(f"trace {args.trace}: {facts.num_requests} requests, {facts.total_tokens:,} tokens "
          f"(block {facts.block_size}); {p} prefill × cache {args.cache_fraction:g} of the "
          f"working set ({facts.working_blocks} blocks, {facts.working_snapshots} prompt-end "
          f"snapshots); {cal.prefill_tokens_per_s:g} tokens/s; load {args.load:g}; store "
          f"{args.store_fraction:g}" + (f" (snapshot every {results[0].store_interval} blocks)"
                                        if args.store_fraction else ""))
    print(table(results, DEFAULT_POLICY))
    if args.json:
        with writing("--json", args.json):
            write_json(to_json(results, DEFAULT_POLICY, cfg, facts, str(args.trace)), args.json)
    if args.plot:
        with writing("--plot", args.plot):
            plot(results, reqs, facts, args.plot, default=DEFAULT_POLICY)
    return 0


def build_parser(prog: str = "k3serve simulate") -> argparse.ArgumentParser:
    from k3serve.process import CommandParser, nonnegative_int, positive_int

    pm = CommandParser(prog=prog, formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                       description="replay a trace through the router's placement "
                                   "(no model): hit rate, TTFT, load per policy")
    pm.add_argument("--trace", required=True, help="JSONL trace (Mooncake format)")
    pm.add_argument("--workers", type=_workers, default="32:32", metavar="P:D",
                    help="prefill:decode workers")
    pm.add_argument("--cache-fraction", type=float, default=1 / 16,
                    help="each prefill worker's cache as a fraction of the working set")
    pm.add_argument("--rate", type=float, default=None,
                    help="prefill tokens/s per worker (default: the calibration's, 8000)")
    pm.add_argument("--load", type=float, default=0.75,
                    help="pool busy fraction without caching (rescales arrivals)")
    pm.add_argument("--store-fraction", type=float, default=0.0,
                    help="shared store size as a fraction of the working set (0: none)")
    pm.add_argument("--store-snapshot-interval", type=nonnegative_int, default=None,
                    help="store-only KDA snapshots every N blocks (default: from the bytes)")
    pm.add_argument("--policy", nargs="+", default=None,
                    help="policies to compare (default: every registered one)")
    pm.add_argument("--json", default=None, metavar="OUT", help="write the results as JSON")
    pm.add_argument("--plot", default=None, metavar="PNG", help="plot hit rate over time")
    pm.add_argument("--calibration", default=None, metavar="FILE",
                    help="cost-model file (docs/calibration.md; default: CPU k3-tiny)")
    pm.add_argument("--jobs", type=positive_int, default=None,
                    help="parallel processes (default: one per policy, at most one per CPU)")
    pm.add_argument("--no-progress", action="store_true", help="no progress bar")
    from simulate.live import add_live_arguments

    add_live_arguments(pm)
    return pm


def main(argv: list[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))


def run(args: argparse.Namespace) -> int:
    """Run the parsed command; bad input ends in one line on stderr (exit status 2)."""
    from k3serve.cache.allocator import CacheFullError
    from k3serve.process import flag_message

    try:
        return int(cmd_simulate(args) or 0)
    except ValueError as e:  # bad input, a missing or unwritable file
        print(f"k3serve simulate: error: {flag_message(str(e), args)}", file=sys.stderr)
        return 2
    except CacheFullError as e:  # one prompt needs more than a whole worker cache
        print(f"k3serve simulate: error: --cache-fraction: a trace row does not fit one prefill "
              f"worker's cache ({e}); raise --cache-fraction ({args.cache_fraction:g} now), or "
              f"scale the trace down (--length-scale)", file=sys.stderr)
        return 2
