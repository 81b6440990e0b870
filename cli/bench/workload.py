"""What ``k3serve bench`` sends: trace rows or a random load, as :class:`BenchRequest` s.

Trace rows map to prompts through :mod:`simulate.traces` only (``replay_slice``; ``k3serve
simulate --length-scale`` and the tests use the same functions): trace block ``i`` of 512 tokens becomes ``block_tokens(hash_ids[i])`` of
``512 · length_scale`` tokens (pseudo-random ids below the served vocabulary), so equal hash
ids give equal token blocks and the trace's prefix sharing becomes real prefix sharing. With
``512 · length_scale`` equal to the server's block size, one trace block is one cache block.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from pathlib import Path

from simulate import traces


@dataclass(frozen=True)
class BenchRequest:
    """One request to send.

    Attributes:
        arrival_s: send time, seconds after the start (already time-scaled).
        prompt: ``[L]`` token ids.
        max_tokens: output length (EOS ignored).
        oracle_cached: tokens the trace's token oracle reuses for it (0 for random loads).
    """

    arrival_s: float
    prompt: list[int]
    max_tokens: int
    oracle_cached: int = 0


@dataclass(frozen=True)
class Workload:
    """Requests plus what the trace itself says about them.

    Attributes:
        requests: the requests to send, by arrival.
        num_skipped: rows dropped because prompt + output exceed the served context.
        oracle_hit_rate: token oracle (infinite exact-prefix cache) over the kept rows.
        snapshot_ceiling: one infinite pool under the snapshot rule, kept rows.
    """

    requests: list[BenchRequest]
    num_skipped: int = 0
    oracle_hit_rate: float | None = None
    snapshot_ceiling: float | None = None


def trace_load(path: str | Path, *, limit: int | None = None, time_scale: float = 1.0,
               length_scale: float = 0.125, vocab_size: int, max_model_len: int,
               output_scale: float | None = None) -> Workload:
    """Trace rows → requests.

    Args:
        path: JSONL trace (:func:`simulate.traces.read_rows`).
        limit: first ``limit`` rows only.
        time_scale: arrival times are multiplied by it (0.1: ten times faster).
        length_scale: tokens per trace token; ``512 · length_scale`` tokens per trace block
            (an integer ≥ 1). Output lengths scale the same way (``⌈out · scale⌉``, ≥ 1)
            unless ``output_scale`` is given (``⌈out · output_scale⌉``, ≥ 1).
        vocab_size: the served model's vocabulary (token ids drawn below it).
        max_model_len: rows whose prompt + output exceed it are skipped and counted.

    Raises:
        ValueError: a bad argument (named; ``time_scale`` must be finite and > 0) or a bad
            trace row (see ``read_rows``).
    """
    if not (math.isfinite(time_scale) and time_scale > 0):
        raise ValueError(f"time_scale: must be a finite number > 0, got {time_scale}")
    kept, skipped = traces.replay_slice(path, limit=limit, length_scale=length_scale,
                                        max_model_len=max_model_len, output_scale=output_scale)
    if not kept:
        return Workload([], skipped)
    oracle = traces.oracle_hits(kept)
    t0 = kept[0].arrival
    out = [BenchRequest((r.arrival - t0) * time_scale, r.tokens(vocab_size),
                        max(1, r.output_tokens), o) for r, o in zip(kept, oracle, strict=True)]
    return Workload(out, skipped, traces.token_oracle(kept),
                    traces.snapshot_rule_ceiling(kept))


def random_load(*, rate: float, input_len: int, output_len: int, num: int, vocab_size: int,
                seed: int = 0) -> Workload:
    """``num`` prompts of ``input_len`` random tokens, Poisson arrivals at ``rate`` req/s
    (``rate`` = inf: all at once), ``output_len`` tokens each.

    Raises:
        ValueError: a non-positive ``rate``, ``input_len``, ``output_len`` or ``num``.
    """
    for name, v in (("rate", rate), ("input_len", input_len), ("output_len", output_len),
                    ("num", num)):
        if not v > 0:
            raise ValueError(f"{name}: must be > 0, got {v}")
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(num):
        out.append(BenchRequest(t, [rng.randrange(vocab_size) for _ in range(input_len)],
                                output_len))
        if rate != float("inf"):
            t += rng.expovariate(rate)
    return Workload(out)


__all__ = ["BenchRequest", "Workload", "random_load", "trace_load"]
