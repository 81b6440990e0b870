"""``k3serve simulate`` of a live stack: the slice ``k3serve bench`` sends, on the stack's shape.

``k3serve bench --trace T --limit N --length-scale S --max-model-len M --time-scale X``
against ``k3serve serve`` (P prefill + D decode workers, or ``--monolithic N``) and

    k3serve simulate --trace T --limit N --length-scale S --max-model-len M --time-scale X \\
        --workers P:D --num-pages … --num-snapshots … --calibration FILE --policy POLICY

replay the same requests: :func:`simulate.traces.replay_slice` maps the rows for both (ONE
block-id → tokens mapping; ``512 · S`` tokens per block, the server's ``--block-size``), the
arrivals are the bench's (relative to the first kept row, times ``X``), and every simulated
prefill worker holds exactly the live worker's cache (:class:`StackShape`: pages, state slots,
snapshot budget, the same dense-snapshot rule the engine resolves) — the simulator's own
``CacheManager`` is the engine's. What is left to the model is time: the
:class:`~simulate.calibration.Calibration` (``simulate/calibration_cpu_k3-tiny_live.json``:
measured against a live k3-tiny stack on this 2-core machine by
``benchmarks/calibrate_live.py``).

A monolithic stack (``--workers N:0``) is N workers that each prefill (and decode) with the
same cache: the router places over them with the same policy and no decode choice.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from k3serve.cache.specs import (
    CacheConfig,
    CacheDtypes,
    KDAStateSpec,
    MLALatentSpec,
    auto_dense_snapshot_blocks,
)
from k3serve.process import nonnegative_int, positive_float, positive_int
from router.config import RouterConfig
from simulate.calibration import Calibration
from simulate.config import PolicyResult, SimConfig, trace_facts
from simulate.engine import replay
from simulate.traces import TraceRequest, replay_slice

LIVE_CALIBRATION = Path(__file__).with_name("calibration_cpu_k3-tiny_live.json")
"""k3-tiny on this machine's CPU, measured against a live stack (``benchmarks/calibrate_live.py``)."""


@dataclass(frozen=True)
class StackShape:
    """What of a live stack decides its hit rate. Defaults: ``k3serve serve``'s workers
    (``worker.config.WorkerConfig``; a test keeps them equal).

    Attributes:
        prefill: prefill workers (monolithic: the number of workers).
        decode: decode workers (0: monolithic — every worker prefills and decodes).
        model: model preset (its layout decides the automatic dense-snapshot rule).
        block_size: tokens per cache block (``--block-size``).
        num_pages, num_slots, num_snapshots: each worker's ``--num-pages``,
            ``--num-slots``, ``--num-snapshots``.
        dense_snapshot_blocks: ``--dense-snapshot-blocks`` (-1: the engine's automatic rule).
        dtype: cache dtype name (``float32`` on CPU, ``bfloat16`` on CUDA).
        router_prefill_rate: the tokens/s the router assumes per worker (its
            ``--prefill-rate``; workers report none today), in its placement costs.
        poll_interval_s: the router's ``--poll-interval`` between cache-event pulls, s.

    Raises:
        ValueError: a count out of range (named).
    """

    prefill: int = 2
    decode: int = 1
    model: str = "k3-tiny"
    block_size: int = 64
    num_pages: int = 1024
    num_slots: int = 32
    num_snapshots: int = 32
    dense_snapshot_blocks: int = -1
    dtype: str = "float32"
    router_prefill_rate: float = RouterConfig.prefill_rate
    poll_interval_s: float = RouterConfig.poll_interval_s

    def __post_init__(self) -> None:
        for f, lo in (("prefill", 1), ("decode", 0), ("block_size", 1), ("num_pages", 1),
                      ("num_slots", 1), ("num_snapshots", 0), ("dense_snapshot_blocks", -1)):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < lo:
                raise ValueError(f"{f}: must be an int >= {lo}, got {v!r}")

    @property
    def monolithic(self) -> bool:
        return self.decode == 0

    def cache_config(self) -> CacheConfig:
        """One worker's :class:`CacheConfig`, the dense-snapshot rule resolved as the engine
        resolves it (``k3serve.engine.memory.dense_snapshot_blocks``)."""
        from k3serve.config import load_config

        dense = self.dense_snapshot_blocks
        if dense < 0:
            cfg = load_config(self.model)
            dense = auto_dense_snapshot_blocks(
                MLALatentSpec.from_config(cfg, self.block_size, self.dtype),
                KDAStateSpec.from_config(cfg, CacheDtypes(self.dtype, self.dtype, "float32")))
        return CacheConfig(self.num_pages, self.num_slots, self.num_snapshots, self.block_size,
                           dense_snapshot_blocks=dense)

    def sim_config(self, calibration: Calibration, **kw) -> SimConfig:
        """The :class:`SimConfig` of this stack (arrivals kept as given: ``load=None``);
        ``kw``: more ``SimConfig`` fields (``params``, ``poll_s``, …)."""
        kw = {"poll_s": self.poll_interval_s, "router_prefill_rate": self.router_prefill_rate,
              **kw}
        return SimConfig(prefill_workers=self.prefill, decode_workers=self.decode, load=None,
                         calibration=calibration, cache=self.cache_config(), **kw)


def live_requests(kept: Sequence[TraceRequest], time_scale: float = 1.0) -> list[TraceRequest]:
    """``kept`` with the bench's arrivals: seconds after the first, times ``time_scale``.

    Raises:
        ValueError: ``time_scale`` ≤ 0 or no request.
    """
    if not time_scale > 0:
        raise ValueError(f"time_scale: must be > 0, got {time_scale}")
    if not kept:
        raise ValueError("trace: no row fits max_model_len")
    t0 = kept[0].arrival
    return [replace(r, arrival=(r.arrival - t0) * time_scale) for r in kept]


def simulate_slice(path: str | Path, shape: StackShape, policy: str,
                   calibration: Calibration, *, limit: int | None = None,
                   length_scale: float = 0.125, max_model_len: int | None = None,
                   time_scale: float = 1.0, output_scale: float | None = None,
                   **kw) -> tuple[PolicyResult, int]:
    """Replay the slice ``k3serve bench`` would send to a stack of ``shape``.

    Args:
        path, limit, length_scale, max_model_len, time_scale, output_scale: as
            ``k3serve bench``'s flags.
        shape: the stack (its ``block_size`` must be ``512 · length_scale``).
        policy: the router's ``--policy``.
        calibration: the cost model.
        kw: more ``SimConfig`` fields.

    Returns:
        ``(the policy's result, rows skipped)``.

    Raises:
        ValueError: a block size other than the slice's, or a bad argument (named).
    """
    reqs, skipped = slice_requests(path, limit=limit, length_scale=length_scale,
                                   max_model_len=max_model_len, time_scale=time_scale,
                                   output_scale=output_scale)
    cfg = shape.sim_config(calibration, **kw)
    return replay(reqs, policy, cfg, trace_facts(reqs)), skipped


def slice_requests(path: str | Path, *, limit: int | None = None, length_scale: float = 0.125,
                   max_model_len: int | None = None, time_scale: float = 1.0,
                   output_scale: float | None = None) -> tuple[list[TraceRequest], int]:
    """The kept requests of the slice with the bench's arrivals, and the rows skipped."""
    kept, skipped = replay_slice(path, limit=limit, length_scale=length_scale,
                                 max_model_len=max_model_len, output_scale=output_scale)
    return live_requests(kept, time_scale), skipped


# ----------------------------------------------------------------------------- command line
def add_live_arguments(p: argparse.ArgumentParser) -> None:
    """``k3serve simulate``'s live-stack flags (``--length-scale`` switches them on)."""
    g = p.add_argument_group(
        "live stack", "simulate what `k3serve bench` sends to a running stack: give "
        "--length-scale (and the same --limit/--max-model-len/--time-scale/--output-scale "
        "as the bench); --workers P:D is the stack (N:0 = --monolithic N); the cache flags "
        "are the workers'. --cache-fraction, --load and --rate are then ignored")
    g.add_argument("--length-scale", type=positive_float, default=None,
                   help="tokens per trace token (512 x this = the stack's --block-size)")
    g.add_argument("--limit", type=positive_int, default=None, help="first N trace rows only")
    g.add_argument("--max-model-len", type=positive_int, default=None,
                   help="skip rows whose prompt + answer exceed this, as the bench does")
    g.add_argument("--time-scale", type=positive_float, default=1.0,
                   help="multiply arrival times by this, as the bench does")
    g.add_argument("--output-scale", type=positive_float, default=None,
                   help="answer tokens per trace answer token (default: --length-scale)")
    d = StackShape()
    g.add_argument("--model", default=d.model, help="served model (snapshot rule)")
    g.add_argument("--num-pages", type=positive_int, default=d.num_pages, help="pages per worker")
    g.add_argument("--num-slots", type=positive_int, default=d.num_slots, help="state slots per worker")
    g.add_argument("--num-snapshots", type=nonnegative_int, default=d.num_snapshots,
                   help="KDA snapshot budget per worker")
    g.add_argument("--dense-snapshot-blocks", type=int, default=d.dense_snapshot_blocks,
                   help="the workers' flag (-1: the engine's automatic rule)")
    g.add_argument("--router-prefill-rate", type=positive_float, default=d.router_prefill_rate,
                   help="the router's --prefill-rate (tokens/s it assumes per worker)")


def cmd_live(args: argparse.Namespace) -> int:
    """Run the live-stack simulation of ``args`` (:func:`add_live_arguments`): print the table
    (and ``--json`` / ``--plot``), one row per policy."""
    from k3serve.process import writing
    from simulate.calibration import load_calibration
    from simulate.report import plot, table, to_json, write_json
    from simulate.runner import run
    from simulate.traces import block_size_of

    cal = load_calibration(args.calibration or LIVE_CALIBRATION).with_rate(args.rate)
    p, d = args.workers
    shape = StackShape(prefill=p, decode=d, model=args.model,
                       block_size=block_size_of(args.length_scale), num_pages=args.num_pages,
                       num_slots=args.num_slots, num_snapshots=args.num_snapshots,
                       dense_snapshot_blocks=args.dense_snapshot_blocks,
                       router_prefill_rate=args.router_prefill_rate)
    reqs, skipped = slice_requests(args.trace, limit=args.limit,
                                   length_scale=args.length_scale,
                                   max_model_len=args.max_model_len,
                                   time_scale=args.time_scale, output_scale=args.output_scale)
    cfg = shape.sim_config(cal)
    facts = trace_facts(reqs)
    from router.policies.table import POLICIES
    default = RouterConfig.policy  # the live router's default, first (the table's reference)
    policies = args.policy or sorted(POLICIES, key=lambda n: (n != default, n))
    results = run(reqs, policies, cfg, jobs=args.jobs, progress=not args.no_progress, facts=facts)
    kind = f"{p} monolithic" if shape.monolithic else f"{p} prefill + {d} decode"
    print(f"trace {args.trace}: {facts.num_requests} requests sent, {skipped} skipped, "
          f"{facts.total_tokens:,} prompt tokens (block {facts.block_size}); stack {kind}, "
          f"{shape.num_pages} pages / {shape.num_snapshots} snapshots per worker; time x"
          f"{args.time_scale:g}; {cal.prefill_tokens_per_s:g} tokens/s + "
          f"{cal.prefill_overhead_s:g} s per prefill ({cal.device})")
    print(table(results, policies[0]))
    if args.json:
        doc = to_json(results, policies[0], cfg, facts, str(args.trace))
        doc["live"] = {"num_skipped": skipped, "time_scale": args.time_scale,
                       "length_scale": args.length_scale, "output_scale": args.output_scale,
                       "limit": args.limit, "max_model_len": args.max_model_len,
                       "stack": asdict(shape)}
        with writing("--json", args.json):
            write_json(doc, args.json)
    if args.plot:
        with writing("--plot", args.plot):
            plot(results, reqs, facts, args.plot, default=policies[0])
    return 0


__all__ = ["LIVE_CALIBRATION", "StackShape", "add_live_arguments", "cmd_live", "live_requests",
           "simulate_slice", "slice_requests"]
