"""Discrete-event replay of a trace through the router's real placement code.

What runs is the product's code, imported (issue 12): ``router.index.GlobalIndex`` fed by
the INTERFACES.md §4 cache events of every simulated worker (and of the store), the
registered placement policies through ``router.policies.table.place``, and one real
``k3serve.cache.manager.CacheManager`` per prefill worker (paged MLA blocks with LRU
eviction, a KDA snapshot budget, snapshots at ``⌊(L−1)/B⌋·B`` and at ``snapshot_at``, the
usable-hit rule, the event log). The simulator adds only time and the store tier:

* A prefill worker is a FIFO server. A request's prefix lookup happens when it starts (so the
  router's prediction, made at arrival from events pulled every ``poll_s``, is wrong when
  queued work evicts what it counted on); its service time comes from the
  :class:`~simulate.calibration.Calibration` (uncached tokens at the prefill rate, a
  store load priced by latency + bytes).
* The store (``store_fraction`` > 0, :class:`~simulate.store.SimStore`) receives every
  computed block and snapshot when the prefill finishes; a worker whose own usable hit is
  shallower than what the store can complete loads the difference (and the snapshot).
  ``store_snapshot_interval`` adds store-only KDA snapshots every k blocks (written through
  at compute time, not kept in the worker's own budget); by default it is chosen from the
  byte arithmetic (:func:`auto_store_interval`).
* Decode workers hold a sequence from placement until ``output_tokens`` are generated at
  ``decode_tokens_per_s`` after its prefill; placement picks them with ``choose_decode``.

Events at equal times: finishes before the arrival that sees them (as in the router, which
learns a prefill finished before the next request arrives at the same instant).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from k3serve.cache.manager import CacheManager
from k3serve.cache.specs import CacheConfig
from k3serve.traces import (
    DEFAULT_FINGERPRINT,
    TRACE_BLOCK,
    TraceRequest,
    oracle_hits,
    snapshot_rule_ceiling,
    token_oracle,
    working_set,
)
from router.index import GlobalIndex
from router.placement import (
    DecodeWorkerState,
    PlacementParams,
    PlacementRequest,
)
from router.policies import RouterView, WorkerView
from router.policies.load import UTIL_HORIZON_S, RecentLoad
from router.policies.table import place
from simulate.calibration import Calibration
from simulate.store import STORE_ID, SimStore

STORE_INTERVALS = (1, 2, 4, 8, 16, 32, 64, 128)


@dataclass(frozen=True)
class SimConfig:
    """One simulated deployment (defaults: issue 12's table setup).

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
        router_prefill_rate: the prefill tokens/s the router assumes per worker in its
            placement costs and load accounts (a live router: what workers report, else
            ``RouterConfig.prefill_rate``); ``None``: the calibration's true rate.
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
        if not self.poll_s >= 0:
            raise ValueError(f"poll_s: must be ≥ 0, got {self.poll_s!r}")


@dataclass(frozen=True)
class TraceFacts:
    """What the replay needs to know about a trace once, whatever the policy.

    Attributes:
        num_requests, total_tokens: rows and prompt tokens.
        block_size: tokens per block.
        working_blocks, working_snapshots: distinct full blocks, prompt-end boundaries.
        oracle_hit_rate: :func:`k3serve.traces.token_oracle`.
        snapshot_ceiling: :func:`k3serve.traces.snapshot_rule_ceiling` (no interval).
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
    of the store (the rest keeps latents and prompt-end snapshots; measured trade-off in the
    report of issue 12).
    """
    cap = store_capacity_blocks(facts, cfg)
    if cap <= 0:
        return 0
    sb = snapshot_blocks(cfg.calibration)
    for k in STORE_INTERVALS:
        if facts.working_blocks / k * sb <= budget_share * cap:
            return k
    return 0


@dataclass
class _Worker:
    name: str
    cm: CacheManager
    queue: deque = field(default_factory=deque)
    busy: bool = False
    computed: int = 0
    router_queued: int = 0  # router's account: predicted uncached tokens not finished
    recent: RecentLoad = field(default_factory=RecentLoad)  # the live router's util account
    running: int = 0  # requests sent and not finished (SGLang-style load)


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


def _pct(xs: Sequence[float], q: float) -> float:
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


def replay(reqs: Sequence[TraceRequest], policy: str, cfg: SimConfig = SimConfig(),
           facts: TraceFacts | None = None,
           progress: Callable[[int], None] | None = None) -> PolicyResult:
    """Replay ``reqs`` (arrival order) under ``policy``; deterministic for a given input.

    Args:
        reqs: a scaled trace (:func:`k3serve.traces.load_trace`), hashed with
            ``cfg.fingerprint``.
        policy: a name in ``router.policies.table.POLICIES``.
        cfg: the deployment.
        facts: :func:`trace_facts` of ``reqs`` (computed when ``None``).
        progress: called with the number of requests placed since the last call.

    Raises:
        KeyError: unknown policy.
        ValueError: empty trace.
    """
    facts = facts or trace_facts(reqs)
    cal = cfg.calibration
    B = facts.block_size
    rate = cfg.router_prefill_rate or cal.prefill_tokens_per_s  # the router's belief
    scale = time_scale(facts, cfg)
    nb, ns = facts.working_blocks, facts.working_snapshots
    ccfg = CacheConfig(num_pages=max(1, int(cfg.cache_fraction * nb)), num_slots=2,
                       num_snapshots=max(1, int(cfg.cache_fraction * ns)), block_size=B,
                       snapshot_interval_tokens=cfg.worker_snapshot_interval * B)
    if cfg.cache is not None:  # a live stack's cache exactly (simulate.live)
        if cfg.cache.block_size != B:
            raise ValueError(f"cache.block_size: {cfg.cache.block_size} != the trace's {B}")
        ccfg = cfg.cache
    workers = [_Worker(f"p{i}", CacheManager(ccfg, cfg.fingerprint),
                       recent=RecentLoad(cfg.util_horizon_s))
               for i in range(cfg.prefill_workers)]
    by_name = {w.name: w for w in workers}
    store = None
    interval = 0
    if cfg.store_fraction > 0:
        store = SimStore(store_capacity_blocks(facts, cfg), snapshot_blocks(cal))
        interval = (auto_store_interval(facts, cfg) if cfg.store_snapshot_interval is None
                    else cfg.store_snapshot_interval)
    index = GlobalIndex()
    for w in workers:
        index.add_worker(w.name)
        index.load_state(w.name, w.cm.cache_state())
    if store is not None:
        index.add_worker(STORE_ID)
        index.load_state(STORE_ID, store.cache_state())
    view = RouterView(cfg.prefill_workers, ccfg.num_pages)
    decode_running = [0] * cfg.decode_workers
    decode_count = [0] * cfg.decode_workers
    dec_ids = {f"d{i}": i for i in range(cfg.decode_workers)}
    n = len(reqs)
    hits = [0] * n
    local_hits = [0] * n
    predicted = [0] * n
    ttft = [0.0] * n
    arrivals = [r.arrival * scale for r in reqs]
    heap: list[tuple[float, int, int, int, object]] = []  # (time, kind, order, ref, payload)
    order = 0
    FINISH, DECODE_DONE = 0, 0  # events sort by time, then push order
    dec_of = [-1] * n

    def push(t: float, kind: int, ref: int, payload: object = None) -> None:
        nonlocal order
        order += 1
        heapq.heappush(heap, (t, kind, order, ref, payload))

    widx = {w.name: i for i, w in enumerate(workers)}

    def start(w: _Worker, t: float) -> None:
        rid, snaps = w.queue.popleft()
        r = reqs[rid]
        cap = r.max_cached_blocks
        cm = w.cm
        store_depth = 0
        if store is not None:
            store_depth = store.usable_depth(r.hashes, cap, cm.index.has_block)
        toks = r.tokens()
        want = set(snaps)
        local = cm.index.match(r.hashes, cap)[0] if store_depth else 0
        if store_depth > local:
            want.add(store_depth * B)  # the loaded snapshot becomes the worker's own
        h_local = cm.run_prefill(rid, toks, snapshot_at=tuple(sorted(want)))
        h_store = max(0, store_depth * B - h_local)
        work = r.num_tokens - h_local - h_store
        w.computed += work
        hits[rid] = h_local + h_store
        local_hits[rid] = h_local
        if h_store:
            store.load(r.hashes, h_local // B, store_depth)
        done = t + cal.prefill_seconds(work, h_store)
        ttft[rid] = done - arrivals[rid]
        w.busy = True
        payload = None
        if store is not None:
            pts = {cap} if cap > 0 else set()
            pts.update(p // B for p in want if 0 < p // B <= cap)
            if interval:
                pts.update(range(interval, cap + 1, interval))
            payload = [r.hashes[p - 1] for p in sorted(pts)]
        push(done, FINISH, widx[w.name], (rid, payload))

    def run_until(t: float) -> None:
        while heap and heap[0][0] <= t:
            tt, _kind, _o, ref, payload = heapq.heappop(heap)
            if ref >= 0:  # prefill finished on worker ref
                w = workers[ref]
                rid, snaps = payload  # type: ignore[misc]
                r = reqs[rid]
                w.router_queued -= r.num_tokens - predicted[rid]
                w.running -= 1
                if store is not None:
                    store.put(r.hashes, snaps)
                if dec_of[rid] >= 0:
                    push(tt + r.output_tokens / cal.decode_tokens_per_s, DECODE_DONE,
                         -dec_of[rid] - 1)
                if w.queue:
                    start(w, tt)
                else:
                    w.busy = False
            else:  # decode finished on decode worker -ref-1
                decode_running[-ref - 1] -= 1

    last_poll = -math.inf
    pending = 0
    for seq, r in enumerate(reqs):
        t = arrivals[seq]
        run_until(t)
        if t - last_poll >= cfg.poll_s:
            for w in workers:
                index.apply_events(w.name, w.cm.events_since(index.cursor(w.name)[1]))
            if store is not None:
                index.apply_events(STORE_ID, store.events_since(index.cursor(STORE_ID)[1]))
            last_poll = t
        cap = r.max_cached_blocks
        match = index.match(r.hashes, cap)
        sm = match.get(STORE_ID)
        s_use, s_mla = (sm.usable_blocks, sm.mla_blocks) if sm else (0, 0)
        radix = view.match(r.hashes)
        states = []
        for i, w in enumerate(workers):
            m = match.get(w.name)
            use, mla = (m.usable_blocks, m.mla_blocks) if m else (0, 0)
            states.append(WorkerView(
                w.name, max(use, s_use), max(mla, s_mla), w.router_queued, rate,
                local_blocks=use, store_blocks=s_use,
                store_tokens_per_s=cal.store_tokens_per_s if store is not None else 0.0,
                util=w.recent.util(rate, t), request_rate=w.recent.request_rate(t),
                running=w.running, approx_blocks=radix[i], tree_blocks=view.tree_size(i)))
        dstates = [DecodeWorkerState(f"d{i}", running=decode_running[i])
                   for i in range(cfg.decode_workers)]
        req = PlacementRequest(r.num_tokens, B, seq=seq, max_new_tokens=r.output_tokens,
                               key=r.hashes[-1] if r.hashes else "")
        p = place(req, states, dstates, policy=policy, params=cfg.params)
        w = by_name[p.prefill]
        predicted[seq] = p.predicted_cached_tokens
        w.router_queued += r.num_tokens - p.predicted_cached_tokens
        w.running += 1
        w.recent.add(r.num_tokens - p.predicted_cached_tokens, 1.0, now=t)
        view.record(widx[w.name], r.hashes, cap)
        w.queue.append((seq, p.snapshot_at))
        if not w.busy:
            start(w, t)
        if p.decode is not None:
            d = dec_ids[p.decode]
            decode_running[d] += 1
            decode_count[d] += 1
            dec_of[seq] = d
        pending += 1
        if progress is not None and pending >= 64:
            progress(pending)
            pending = 0
    run_until(math.inf)
    if progress is not None and pending:
        progress(pending)
    total = facts.total_tokens
    actual = sum(hits)
    pred = sum(predicted)
    agreed = sum(min(a, b) for a, b in zip(predicted, hits, strict=True))
    load = tuple(w.computed for w in workers)
    mean = sum(load) / len(load)
    dmean = sum(decode_count) / len(decode_count) if decode_count else 0.0
    return PolicyResult(
        policy=policy,
        hit_rate=actual / total,
        local_hit_rate=sum(local_hits) / total,
        store_hit_rate=(actual - sum(local_hits)) / total,
        oracle_hit_rate=facts.oracle_hit_rate,
        snapshot_ceiling=facts.snapshot_ceiling,
        ttft_p50_s=_pct(ttft, 0.5),
        ttft_p99_s=_pct(ttft, 0.99),
        ttft_mean_s=sum(ttft) / n,
        load=load,
        load_max_over_mean=max(load) / mean if mean else 1.0,
        predicted=pred,
        actual=actual,
        agreement=agreed / actual if actual else 1.0,
        decode_max_over_mean=max(decode_count) / dmean if dmean else 0.0,
        hits=tuple(hits),
        ttft=tuple(ttft),
        arrivals=tuple(arrivals),
        store_interval=interval,
        store_stats=({"puts": store.puts, "gets": store.gets, "evictions": store.evictions,
                      "capacity_blocks": store.capacity, "used_blocks": store.used}
                     if store is not None else {}),
    )


def with_params(cfg: SimConfig, **kw) -> SimConfig:
    """A copy of ``cfg`` with fields replaced (``dataclasses.replace``)."""
    return replace(cfg, **kw)
