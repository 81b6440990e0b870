"""Discrete-event replay of a trace through the router's real placement code.

What runs is the product's code, imported: ``router.index.GlobalIndex`` fed by
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
* The store (``store_fraction`` > 0, :class:`~kvstore.store.sim.SimStore`) receives every
  computed block and snapshot when the prefill finishes; a worker whose own usable hit is
  shallower than what the store can complete loads the difference (and the snapshot).
  ``store_snapshot_interval`` adds store-only KDA snapshots every k blocks (written through
  at compute time, not kept in the worker's own budget); by default it is chosen from the
  byte arithmetic (:func:`auto_store_interval`).
* Each worker measures its prefill rate (computed tokens over busy seconds of its last
  ``RATE_WINDOW`` prefills) and placement prices it at that; the router keeps its record of
  where it just sent each prompt (:class:`router.recent.RecentPlacements`), as the live
  router does, so a prompt extending one still queued or computing meets it there.
* Decode workers hold a sequence from placement until ``output_tokens`` are generated at
  ``decode_tokens_per_s`` after its prefill; placement picks them with ``choose_decode``.

Events at equal times: finishes before the arrival that sees them (as in the router, which
learns a prefill finished before the next request arrives at the same instant).

Inputs and results: :mod:`simulate.config`.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from k3serve.cache.manager import CacheManager
from k3serve.cache.specs import CacheConfig
from router.index import GlobalIndex
from router.placement import DecodeWorkerState, PlacementRequest
from router.policies import RouterView, WorkerView
from router.policies.load import RecentLoad
from router.policies.table import place
from router.recent import RecentPlacements
from simulate.config import (
    PolicyResult,
    SimConfig,
    TraceFacts,
    auto_store_interval,
    pct,
    snapshot_blocks,
    store_capacity_blocks,
    time_scale,
    trace_facts,
)
from kvstore.store.sim import STORE_ID, SimStore
from simulate.traces import TraceRequest

#: Prefills a worker's measured rate is taken over (its most recent ones).
RATE_WINDOW = 16


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
    #: (computed tokens, busy seconds) of its last RATE_WINDOW prefills
    timed: deque = field(default_factory=lambda: deque(maxlen=RATE_WINDOW))

    def measured_rate(self) -> float:
        """Computed tokens over busy seconds of its recent prefills (0: none yet)."""
        secs = sum(s for _, s in self.timed)
        return sum(t for t, _ in self.timed) / secs if secs > 0 else 0.0


class Replay:
    """One policy's discrete-event replay of a trace (:func:`replay` runs it).

    Args:
        reqs: the scaled trace in arrival order.
        policy: a name in ``router.policies.table.POLICIES``.
        cfg: the deployment.
        facts: :func:`simulate.config.trace_facts` of ``reqs``.

    Raises:
        ValueError: ``cfg.cache`` of another block size than the trace's.
    """

    def __init__(self, reqs: Sequence[TraceRequest], policy: str, cfg: SimConfig,
                 facts: TraceFacts) -> None:
        self.reqs, self.policy, self.cfg, self.facts = reqs, policy, cfg, facts
        self.cal = cal = cfg.calibration
        self.B = B = facts.block_size
        self.rate = cfg.router_prefill_rate or cal.prefill_tokens_per_s  # the static belief
        nb, ns = facts.working_blocks, facts.working_snapshots
        ccfg = CacheConfig(num_pages=max(1, int(cfg.cache_fraction * nb)), num_slots=2,
                           num_snapshots=max(1, int(cfg.cache_fraction * ns)), block_size=B,
                           snapshot_interval_tokens=cfg.worker_snapshot_interval * B)
        if cfg.cache is not None:  # a live stack's cache exactly (simulate.live)
            if cfg.cache.block_size != B:
                raise ValueError(f"cache.block_size: {cfg.cache.block_size} != the trace's {B}")
            ccfg = cfg.cache
        self.workers = [_Worker(f"p{i}", CacheManager(ccfg, cfg.fingerprint),
                                recent=RecentLoad(cfg.util_horizon_s))
                        for i in range(cfg.prefill_workers)]
        self.widx = {w.name: i for i, w in enumerate(self.workers)}
        self.store: SimStore | None = None
        self.interval = 0
        if cfg.store_fraction > 0:
            self.store = SimStore(store_capacity_blocks(facts, cfg), snapshot_blocks(cal))
            self.interval = (auto_store_interval(facts, cfg)
                             if cfg.store_snapshot_interval is None
                             else cfg.store_snapshot_interval)
        self.index = GlobalIndex()
        for w in self.workers:
            self.index.add_worker(w.name)
            self.index.load_state(w.name, w.cm.cache_state())
        if self.store is not None:
            self.index.add_worker(STORE_ID)
            self.index.load_state(STORE_ID, self.store.cache_state())
        self.view = RouterView(cfg.prefill_workers, ccfg.num_pages)
        self.sent = RecentPlacements(cfg.recent_ttl_s)
        self.decode_running = [0] * cfg.decode_workers
        self.decode_count = [0] * cfg.decode_workers
        self.dec_ids = {f"d{i}": i for i in range(cfg.decode_workers)}
        n = len(reqs)
        self.hits, self.local_hits, self.predicted = [0] * n, [0] * n, [0] * n
        self.ttft = [0.0] * n
        self.dec_of = [-1] * n
        scale = time_scale(facts, cfg)
        self.arrivals = [r.arrival * scale for r in reqs]
        self.heap: list[tuple[float, int, int, object]] = []  # (time, order, ref, payload)
        self.order = 0
        self.last_poll = -math.inf

    def push(self, t: float, ref: int, payload: object = None) -> None:
        """Schedule an event: ``ref`` ≥ 0 a prefill finished on that worker, < 0 a decode
        finished on decode worker ``−ref − 1``. Equal times pop in push order."""
        self.order += 1
        heapq.heappush(self.heap, (t, self.order, ref, payload))

    def start(self, w: _Worker, t: float) -> None:
        """Start the next queued prefill on ``w`` at ``t``: its real prefix lookup, a store
        load where the store completes more, the finish event."""
        rid, snaps = w.queue.popleft()
        r, B, store, cm = self.reqs[rid], self.B, self.store, w.cm
        cap = r.max_cached_blocks
        store_depth = store.usable_depth(r.hashes, cap, cm.index.has_block) if store else 0
        want = set(snaps)
        local = cm.index.match(r.hashes, cap)[0] if store_depth else 0
        if store_depth > local:
            want.add(store_depth * B)  # the loaded snapshot becomes the worker's own
        h_local = cm.run_prefill(rid, r.tokens(), snapshot_at=tuple(sorted(want)))
        h_store = max(0, store_depth * B - h_local)
        work = r.num_tokens - h_local - h_store
        w.computed += work
        self.hits[rid] = h_local + h_store
        self.local_hits[rid] = h_local
        if h_store:
            store.load(r.hashes, h_local // B, store_depth)  # type: ignore[union-attr]
        secs = self.cal.prefill_seconds(work, h_store)
        if work > 0:  # the worker's measurement: compute time, not the store load
            w.timed.append((work, self.cal.prefill_seconds(work)))
        self.ttft[rid] = t + secs - self.arrivals[rid]
        w.busy = True
        payload = None
        if store is not None:
            pts = {cap} if cap > 0 else set()
            pts.update(p // B for p in want if 0 < p // B <= cap)
            if self.interval:
                pts.update(range(self.interval, cap + 1, self.interval))
            payload = [r.hashes[p - 1] for p in sorted(pts)]
        self.push(t + secs, self.widx[w.name], (rid, payload))

    def run_until(self, t: float) -> None:
        """Process every event up to ``t`` (inclusive)."""
        heap = self.heap
        while heap and heap[0][0] <= t:
            tt, _o, ref, payload = heapq.heappop(heap)
            if ref < 0:  # decode finished on decode worker -ref-1
                self.decode_running[-ref - 1] -= 1
                continue
            w = self.workers[ref]
            rid, snaps = payload  # type: ignore[misc]
            r = self.reqs[rid]
            w.router_queued -= r.num_tokens - self.predicted[rid]
            w.running -= 1
            if self.store is not None:
                self.store.put(r.hashes, snaps)
            if self.dec_of[rid] >= 0:
                self.push(tt + r.output_tokens / self.cal.decode_tokens_per_s,
                          -self.dec_of[rid] - 1)
            if w.queue:
                self.start(w, tt)
            else:
                w.busy = False

    def poll(self, t: float) -> None:
        """Pull every worker's (and the store's) cache events into the index, every
        ``poll_s`` of simulated time."""
        if t - self.last_poll < self.cfg.poll_s:
            return
        index = self.index
        for w in self.workers:
            index.apply_events(w.name, w.cm.events_since(index.cursor(w.name)[1]))
        if self.store is not None:
            index.apply_events(STORE_ID, self.store.events_since(index.cursor(STORE_ID)[1]))
        self.last_poll = t

    def views(self, r: TraceRequest, t: float) -> list[WorkerView]:
        """Every prefill worker as placement sees it when ``r`` arrives at ``t``."""
        cfg, cap = self.cfg, r.max_cached_blocks
        match = self.index.match(r.hashes, cap)
        pending = self.sent.match(r.hashes, cap, t)
        chain = self.sent.extended(r.hashes, t, cfg.util_horizon_s)
        sm = match.get(STORE_ID)
        s_use, s_mla = (sm.usable_blocks, sm.mla_blocks) if sm else (0, 0)
        radix = self.view.match(r.hashes)
        store_rate = self.cal.store_tokens_per_s if self.store is not None else 0.0
        out = []
        for i, w in enumerate(self.workers):
            m, p = match.get(w.name), pending.get(w.name)
            use = max(m.usable_blocks if m else 0, p.usable_blocks if p else 0)
            mla = max(m.mla_blocks if m else 0, p.mla_blocks if p else 0)
            measured = w.measured_rate() if cfg.measured_rate else 0.0
            rate = measured or self.rate
            out.append(WorkerView(
                w.name, max(use, s_use), max(mla, s_mla), w.router_queued, self.rate,
                measured_rate=measured, local_blocks=use, store_blocks=s_use,
                store_tokens_per_s=store_rate, util=w.recent.util(rate, t),
                request_rate=w.recent.request_rate(t), running=w.running,
                approx_blocks=radix[i], tree_blocks=self.view.tree_size(i),
                chain_tokens=chain.get(w.name, 0.0)))
        return out

    def arrive(self, seq: int) -> None:
        """Place request ``seq`` at its arrival and queue it on the chosen workers."""
        r, t, B = self.reqs[seq], self.arrivals[seq], self.B
        self.run_until(t)
        self.poll(t)
        dstates = [DecodeWorkerState(f"d{i}", running=self.decode_running[i])
                   for i in range(self.cfg.decode_workers)]
        req = PlacementRequest(r.num_tokens, B, seq=seq, max_new_tokens=r.output_tokens,
                               key=r.hashes[-1] if r.hashes else "")
        p = place(req, self.views(r, t), dstates, policy=self.policy, params=self.cfg.params)
        w = self.workers[self.widx[p.prefill]]
        self.predicted[seq] = p.predicted_cached_tokens
        uncached = r.num_tokens - p.predicted_cached_tokens
        w.router_queued += uncached
        w.running += 1
        w.recent.add(uncached, 1.0, now=t)
        self.view.record(self.widx[w.name], r.hashes, r.max_cached_blocks)
        self.sent.record(w.name, r.hashes, [r.max_cached_blocks, *(s // B for s in p.snapshot_at)],
                         uncached, t)
        w.queue.append((seq, p.snapshot_at))
        if not w.busy:
            self.start(w, t)
        if p.decode is not None:
            d = self.dec_ids[p.decode]
            self.decode_running[d] += 1
            self.decode_count[d] += 1
            self.dec_of[seq] = d

    def result(self) -> PolicyResult:
        """The figures once every event ran."""
        facts, hits, store = self.facts, self.hits, self.store
        total, n = facts.total_tokens, len(self.reqs)
        actual = sum(hits)
        agreed = sum(min(a, b) for a, b in zip(self.predicted, hits, strict=True))
        load = tuple(w.computed for w in self.workers)
        mean = sum(load) / len(load)
        dc = self.decode_count
        dmean = sum(dc) / len(dc) if dc else 0.0
        return PolicyResult(
            policy=self.policy, hit_rate=actual / total,
            local_hit_rate=sum(self.local_hits) / total,
            store_hit_rate=(actual - sum(self.local_hits)) / total,
            oracle_hit_rate=facts.oracle_hit_rate, snapshot_ceiling=facts.snapshot_ceiling,
            ttft_p50_s=pct(self.ttft, 0.5), ttft_p99_s=pct(self.ttft, 0.99),
            ttft_mean_s=sum(self.ttft) / n, load=load,
            load_max_over_mean=max(load) / mean if mean else 1.0,
            predicted=sum(self.predicted), actual=actual,
            agreement=agreed / actual if actual else 1.0,
            decode_max_over_mean=max(dc) / dmean if dmean else 0.0,
            hits=tuple(hits), ttft=tuple(self.ttft), arrivals=tuple(self.arrivals),
            store_interval=self.interval,
            store_stats=({"puts": store.puts, "gets": store.gets, "evictions": store.evictions,
                          "capacity_blocks": store.capacity, "used_blocks": store.used}
                         if store is not None else {}))


def replay(reqs: Sequence[TraceRequest], policy: str, cfg: SimConfig = SimConfig(),
           facts: TraceFacts | None = None,
           progress: Callable[[int], None] | None = None) -> PolicyResult:
    """Replay ``reqs`` (arrival order) under ``policy``; deterministic for a given input.

    Args:
        reqs: a scaled trace (:func:`simulate.traces.load_trace`), hashed with
            ``cfg.fingerprint``.
        policy: a name in ``router.policies.table.POLICIES``.
        cfg: the deployment.
        facts: :func:`simulate.config.trace_facts` of ``reqs`` (computed when ``None``).
        progress: called with the number of requests placed since the last call.

    Raises:
        KeyError: unknown policy.
        ValueError: empty trace.
    """
    rp = Replay(reqs, policy, cfg, facts or trace_facts(reqs))
    pending = 0
    for seq in range(len(reqs)):
        rp.arrive(seq)
        pending += 1
        if progress is not None and pending >= 64:
            progress(pending)
            pending = 0
    rp.run_until(math.inf)
    if progress is not None and pending:
        progress(pending)
    return rp.result()
