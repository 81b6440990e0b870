"""``k3serve bench``: the command (flags in :func:`add_arguments`, run in :func:`main`)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from k3serve.process import positive_float, positive_int
from k3serve.protocol import API_KEY_ENV


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``k3serve bench``."""
    p.add_argument("--url", required=True, help="router base URL (http://host:port)")
    p.add_argument("--model", default="k3-tiny",
                   help="served model (its vocabulary and context length are read from it)")
    p.add_argument("--api-key", default=None,
                   help=f"bearer token of the public API (default: ${API_KEY_ENV} when set)")
    p.add_argument("--trace", default=None, help="Mooncake-style JSONL trace to replay")
    p.add_argument("--limit", type=positive_int, default=None, help="first N trace rows only")
    p.add_argument("--time-scale", type=positive_float, default=1.0,
                   help="multiply trace arrival times by this (0.1 = 10x faster)")
    p.add_argument("--length-scale", type=positive_float, default=0.125,
                   help="tokens per trace token; 512 x this = tokens per trace block "
                        "(match the server's --block-size)")
    p.add_argument("--output-scale", type=positive_float, default=None,
                   help="answer tokens per trace answer token (default: --length-scale)")
    p.add_argument("--max-model-len", type=positive_int, default=None,
                   help="skip rows longer than this (default: the model's context)")
    p.add_argument("--rate", type=float, default=None,
                   help="random load: Poisson arrivals at R req/s (inf: all at once)")
    p.add_argument("--input-len", type=positive_int, default=256, help="random load: prompt tokens")
    p.add_argument("--output-len", type=positive_int, default=32, help="random load: output tokens")
    p.add_argument("--num", type=positive_int, default=32, help="random load: number of requests")
    p.add_argument("--seed", type=int, default=0, help="random load: seed")
    p.add_argument("--slo-ttft", type=positive_float, default=None, help="TTFT SLO for goodput (s)")
    p.add_argument("--slo-itl", type=positive_float, default=None,
                   help="per-request TPOT SLO for goodput (s)")
    p.add_argument("--json", default=None, help="write every figure to this JSON file")
    p.add_argument("--plots", default=None, help="write the PNGs into this folder")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def build_workload(args: argparse.Namespace):
    """The workload of ``args``: a trace replay or a random load.

    Raises:
        ValueError: neither or both of ``--trace`` / ``--rate``, or a bad value (named).
    """
    from cli.bench.workload import random_load, trace_load
    from k3serve.config import load_config

    if (args.trace is None) == (args.rate is None):
        raise ValueError("--trace or --rate: give exactly one")
    cfg = load_config(args.model)
    if args.trace:
        return trace_load(args.trace, limit=args.limit, time_scale=args.time_scale,
                          length_scale=args.length_scale, vocab_size=cfg.vocab_size,
                          max_model_len=args.max_model_len or cfg.max_position_embeddings,
                          output_scale=args.output_scale)
    return random_load(rate=args.rate, input_len=args.input_len, output_len=args.output_len,
                       num=args.num, vocab_size=cfg.vocab_size, seed=args.seed)


def served_block_size(url: str, model: str, key: str | None) -> int | None:
    """Tokens per cache block of the served model (the router's ``/v1/models/{model}``
    ``block_size``); ``None`` when the router does not say (not reachable, no worker yet:
    the run reports its own errors)."""
    import httpx

    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        r = httpx.get(f"{url.rstrip('/')}/v1/models/{model}", headers=headers, timeout=10.0)
        size = r.json().get("block_size") if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError, AttributeError):
        return None
    return size if isinstance(size, int) else None


def block_size_warning(length_scale: float, served: int | None) -> str | None:
    """One line when the trace's blocks (512 trace tokens × ``length_scale``, the hashing
    granularity of its ``hash_ids``) are not the served model's cache blocks of ``served``
    tokens: a replayed prefix then shares blocks with the server's cache at other boundaries,
    and the hit rates and the oracle do not compare. ``None``: they match (or unknown)."""
    from simulate.traces import TRACE_BLOCK, block_size_of

    trace_block = block_size_of(length_scale)
    if served is None or served == trace_block:
        return None
    return (f"the trace's blocks are {trace_block} tokens ({TRACE_BLOCK} x --length-scale "
            f"{length_scale:g}) but the served model's cache blocks are {served} tokens: the "
            f"hit rates will not compare with the oracle (use --length-scale "
            f"{served / TRACE_BLOCK:g}, or serve with --block-size {trace_block})")


def api_key(args: argparse.Namespace) -> str | None:
    """The bearer key: ``--api-key``, else ``$K3SERVE_API_KEY`` (as the openai client reads
    ``$OPENAI_API_KEY``), else none."""
    return args.api_key or os.environ.get(API_KEY_ENV) or None


def main(args: argparse.Namespace) -> int:
    """Run the bench of ``args``; print a summary (:func:`~cli.bench.report.format_summary`),
    write JSON / PNGs. Exit status 0, or 1 when a request failed (each distinct error is
    printed on stderr, at most 5).

    Raises:
        httpx.HTTPError: the router's ``/metrics`` answered an error or did not answer
            (``k3serve bench`` prints it as one line, :func:`cli.bench.client.describe_error`).
    """
    from cli.bench.client import run_load
    from cli.bench.report import format_summary, summarize
    from k3serve.process import writing

    work = build_workload(args)
    if args.trace:
        warning = block_size_warning(args.length_scale,
                                     served_block_size(args.url, args.model, api_key(args)))
        if warning:
            print(f"k3serve bench: warning: {warning}", file=sys.stderr, flush=True)
    run = run_load(args.url, work.requests, model=args.model, api_key=api_key(args),
                   progress=not args.no_progress)
    rep = summarize(run, work, slo_ttft=args.slo_ttft, slo_itl=args.slo_itl)
    print("\n".join(format_summary(rep)))
    for err in rep["errors"]:
        print(f"k3serve bench: failed request: {err}", file=sys.stderr)
    if args.json:
        with writing("--json", args.json):
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(rep, indent=2) + "\n")
    if args.plots:
        from cli.bench.plots import write_plots

        with writing("--plots", args.plots):
            written = write_plots(run, args.plots, oracle=work.oracle_hit_rate is not None)
        for f in written:
            print(f"wrote {f}", file=sys.stderr)
    return 1 if rep["num_failed"] else 0


__all__ = ["add_arguments", "api_key", "block_size_warning", "build_workload", "main",
           "served_block_size"]
