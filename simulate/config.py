"""What one simulation is given and gives back: the deployment, a trace's facts, the result.

:class:`SimConfig` (one simulated deployment), :class:`TraceFacts` (what a trace's oracle and
working set are, computed once per trace), the store sizing from the byte arithmetic, and
:class:`PolicyResult` (one policy's figures). The replay itself: :mod:`simulate.engine`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from k3serve.cache.specs import CacheConfig
from router.placement import PlacementParams
from router.policies.load import UTIL_HORIZON_S
from simulate.calibration import Calibration
from simulate.traces import (
    DEFAULT_FINGERPRINT,
    TRACE_BLOCK,
    TraceRequest,
    oracle_hits,
    snapshot_rule_ceiling,
    token_oracle,
    working_set,
)

STORE_INTERVALS = (1, 2, 4, 8, 16, 32, 64, 128)


@dataclass(frozen=True)
class SimConfig:
    """One simulated deployment (defaults: the setup of docs/results/simulate.md).

    Attributes:
        prefill_workers: prefill workers ``P`` (≥ 1).
        decode_workers: decode workers ``D`` (≥ 0; 0 = no decode choice).
        cache_fraction: each prefill worker's cache holds this fraction ``F`` of the trace's
            working set (distinct blocks, distinct prompt-end snapshots), in ``(0, ∞)``.
        load: arrivals are rescaled so the prefill pool would be this busy without caching
            (``U`` in ``(0, ∞)``; total prompt tokens / (P · rate · span) = U); ``None``
            keeps the trace's own timestamps.
        store_fraction: the store holds ``S`` × the working set's bytes (blocks + prompt-end
            snapshots); 0 = no store.
        store_snapshot_interval: store-only snapshots every k blocks; ``None`` = chosen from
            the byte arithmetic; 0 = none.
        worker_snapshot_interval: the workers' own ``CacheConfig.snapshot_interval_tokens``
            in blocks (0 = off, today's default).
        poll_s: the router pulls cache events this often (seconds of simulated time).
        util_horizon_s: time constant of the router's decayed account of work sent to each
            worker (:class:`router.policies.load.RecentLoad`, the live router's own class;
            ``WorkerView.util`` = decayed predicted compute seconds / horizon).
        calibration: the cost model.
        params: placement knobs passed to every policy.
        fingerprint: the workers' layout fingerprint (must be the traces' hash salt).
        cache: every prefill worker's cache exactly (a live stack's pages, slots, snapshot
            budget and snapshot policy: :mod:`simulate.live`); ``None``: sized from
            ``cache_fraction`` of the working set.
        router_prefill_rate: the static prefill tokens/s the router assumes per worker
            (``RouterConfig.prefill_rate``) where it has no measured rate; ``None``: the
            calibration's true rate.
        measured_rate: whether each worker reports its measured prefill rate (computed tokens
            over busy seconds of its last ``RATE_WINDOW`` prefills) and placement prices it at
            that (``PrefillWorkerState.measured_rate``); the static rate then counts only
            before a worker's first prefill.
        recent_ttl_s: how long the router's record of where it sent a prompt counts
            (:class:`router.recent.RecentPlacements`: pending hits before the events, and the
            prompt's own chain left out of the load bound), seconds.
    """

    prefill_workers: int = 32
    decode_workers: int = 32
    cache_fraction: float = 1 / 16
    load: float | None = 0.75
    store_fraction: float = 0.0
    store_snapshot_interval: int | None = None
    worker_snapshot_interval: int = 0
    poll_s: float = 0.05
    util_horizon_s: float = UTIL_HORIZON_S
    calibration: Calibration = field(default_factory=Calibration)
    params: PlacementParams = field(default_factory=PlacementParams)
    fingerprint: str = DEFAULT_FINGERPRINT
    cache: CacheConfig | None = None
    router_prefill_rate: float | None = None
    measured_rate: bool = True
    recent_ttl_s: float = 30.0

    def __post_init__(self) -> None:
        if not isinstance(self.prefill_workers, int) or self.prefill_workers < 1:
            raise ValueError(f"prefill_workers: must be an int ≥ 1, got {self.prefill_workers!r}")
        if not isinstance(self.decode_workers, int) or self.decode_workers < 0:
            raise ValueError(f"decode_workers: must be an int ≥ 0, got {self.decode_workers!r}")
        for f in ("cache_fraction", "load"):
            v = getattr(self, f)
            if v is None and f == "load":
                continue
            if not v > 0 or not math.isfinite(v):
                raise ValueError(f"{f}: must be a finite number > 0, got {v!r}")
        if not self.store_fraction >= 0 or not math.isfinite(self.store_fraction):
            raise ValueError(f"store_fraction: must be a finite number ≥ 0, "
                             f"got {self.store_fraction!r}")
        if self.store_snapshot_interval is not None and self.store_snapshot_interval < 0:
            raise ValueError("store_snapshot_interval: must be ≥ 0 or None")
        if self.worker_snapshot_interval < 0:
            raise ValueError("worker_snapshot_interval: must be ≥ 0")
        if self.router_prefill_rate is not None and not self.router_prefill_rate > 0:
            raise ValueError(f"router_prefill_rate: must be > 0, got {self.router_prefill_rate!r}")
        if not self.recent_ttl_s > 0:
            raise ValueError(f"recent_ttl_s: must be > 0, got {self.recent_ttl_s!r}")
        if not self.poll_s >= 0:
            raise ValueError(f"poll_s: must be ≥ 0, got {self.poll_s!r}")


@dataclass(frozen=True)
class TraceFacts:
    """What the replay needs to know about a trace once, whatever the policy.

    Attributes:
        num_requests, total_tokens: rows and prompt tokens.
        block_size: tokens per block.
        working_blocks, working_snapshots: distinct full blocks, prompt-end boundaries.
        oracle_hit_rate: :func:`simulate.traces.token_oracle`.
        snapshot_ceiling: :func:`simulate.traces.snapshot_rule_ceiling` (no interval).
        oracle_hits: per-request oracle reuse in tokens (arrival order).
        span_s: the trace's arrival span in seconds before rescaling.
    """

    num_requests: int
    total_tokens: int
    block_size: int
    working_blocks: int
    working_snapshots: int
    oracle_hit_rate: float
    snapshot_ceiling: float
    oracle_hits: tuple[int, ...]
    span_s: float


def trace_facts(reqs: Sequence[TraceRequest]) -> TraceFacts:
    """Compute :class:`TraceFacts` (oracle, ceiling, working set) of a scaled trace.

    Raises:
        ValueError: empty trace or mixed block sizes.
    """
    if not reqs:
        raise ValueError("reqs: empty trace")
    bs = {r.block_size for r in reqs}
    if len(bs) != 1:
        raise ValueError(f"reqs: mixed block sizes {sorted(bs)}")
    nb, ns = working_set(reqs)
    return TraceFacts(len(reqs), sum(r.num_tokens for r in reqs), bs.pop(), nb, ns,
                      token_oracle(reqs), snapshot_rule_ceiling(reqs),
                      tuple(oracle_hits(reqs)), reqs[-1].arrival - reqs[0].arrival)


def snapshot_blocks(cal: Calibration) -> float:
    """One snapshot in simulator blocks: a simulated block stands for one 512-token trace
    block, so a snapshot worth E tokens of latents costs ``E / 512`` blocks (k3-tiny ≈ 2.6,
    k3-mini ≈ 5.5, K3 ≈ 31)."""
    return cal.snapshot_equiv_tokens / TRACE_BLOCK


def store_capacity_blocks(facts: TraceFacts, cfg: SimConfig) -> float:
    """``S × (distinct blocks + prompt-end snapshots × snapshot_blocks)``, block units."""
    return cfg.store_fraction * (facts.working_blocks
                                 + facts.working_snapshots * snapshot_blocks(cfg.calibration))


def auto_store_interval(facts: TraceFacts, cfg: SimConfig, budget_share: float = 0.5) -> int:
    """Densest store-only snapshot interval the store's bytes afford (0: none).

    Interval snapshots every k blocks number about ``distinct blocks / k``; the interval is
    the smallest k in :data:`STORE_INTERVALS` whose snapshots take at most ``budget_share``
    of the store (the rest keeps latents and prompt-end snapshots; the trade-off is measured
    by benchmarks/simulate_snapshots.py).
    """
    cap = store_capacity_blocks(facts, cfg)
    if cap <= 0:
        return 0
    sb = snapshot_blocks(cfg.calibration)
    for k in STORE_INTERVALS:
        if facts.working_blocks / k * sb <= budget_share * cap:
            return k
    return 0


@dataclass(frozen=True)
class PolicyResult:
    """Figures of one policy on one trace.

    Attributes:
        policy: policy name.
        hit_rate: reused tokens (local + store) / prompt tokens.
        local_hit_rate, store_hit_rate: the two sources' shares of prompt tokens.
        oracle_hit_rate: the token oracle; ``hit_rate / oracle_hit_rate`` is "of oracle".
        snapshot_ceiling: one infinite pool under the snapshot rule.
        ttft_p50_s, ttft_p99_s, ttft_mean_s: time to first token (queue + prefill), seconds.
        load: computed prompt tokens per prefill worker.
        load_max_over_mean: ``max(load) / mean(load)``.
        predicted, actual: Σ predicted / actual reused tokens.
        agreement: ``Σ min(predicted, actual) / Σ actual`` (1.0 when nothing was reused).
        decode_max_over_mean: decode requests per decode worker, max / mean (0: no decode).
        hits: per-request reused tokens in arrival order.
        ttft: per-request TTFT in arrival order, seconds.
        arrivals: per-request rescaled arrival, seconds.
        store_interval: store-only snapshot interval used (blocks; 0 = none).
        store_stats: store puts / gets / evictions (empty without a store).
    """

    policy: str
    hit_rate: float
    local_hit_rate: float
    store_hit_rate: float
    oracle_hit_rate: float
    snapshot_ceiling: float
    ttft_p50_s: float
    ttft_p99_s: float
    ttft_mean_s: float
    load: tuple[int, ...]
    load_max_over_mean: float
    predicted: int
    actual: int
    agreement: float
    decode_max_over_mean: float
    hits: tuple[int, ...]
    ttft: tuple[float, ...]
    arrivals: tuple[float, ...]
    store_interval: int
    store_stats: dict

    @property
    def of_oracle(self) -> float:
        return self.hit_rate / self.oracle_hit_rate if self.oracle_hit_rate else 0.0


def pct(xs: Sequence[float], q: float) -> float:
    """Nearest-rank-interpolated percentile (numpy's default 'linear')."""
    s = sorted(xs)
    if not s:
        return 0.0
    pos = (len(s) - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def time_scale(facts: TraceFacts, cfg: SimConfig) -> float:
    """Factor on arrival times so the pool is ``load`` busy without caching (1.0 if span 0)."""
    if facts.span_s <= 0 or cfg.load is None:
        return 1.0
    target = facts.total_tokens / (cfg.prefill_workers * cfg.calibration.prefill_tokens_per_s
                                   * cfg.load)
    return target / facts.span_s


def with_params(cfg: SimConfig, **kw) -> SimConfig:
    """A copy of ``cfg`` with fields replaced (``dataclasses.replace``)."""
    return replace(cfg, **kw)
