"""Placement policies: unit checks, and a trace replay showing cache-aware placement beats
round robin on hit rate at a balanced load.

The replay feeds rows 3000–3399 of the shared Mooncake trace (``tests/data``) through the
router's real decision path — ``block_hashes`` of the prompt's tokens, ``GlobalIndex`` fed by
the workers' INTERFACES.md §4 cache events, then ``place`` — onto 2 simulated prefill workers
that run the real cache bookkeeping (``k3serve.cache.manager.CacheManager``: paged MLA blocks
with LRU eviction, a budget of KDA snapshots at ``⌊(L−1)/B⌋·B`` and ``snapshot_at``, the
usable-hit rule, the event log). Each worker's cache holds about a quarter of the slice's
working set (blocks and prompt-end snapshots).

Scaling: one 512-token trace block becomes one 64-token cache block (tokens ÷ 8); trace block
id ``x`` becomes tokens ``64·x … 64·x + 63`` (equal ids = equal content), the last, partial
trace block keeps its share (rounded up).

Prefill workers are FIFO servers computing the uncached tokens at a fixed rate (tokens/s); a
request's prefix lookup happens when it starts, so the router's prediction (made at arrival,
from events pulled every ``poll_s``) is wrong when queued work evicts what it counted on.
"""

from __future__ import annotations

import json
import math
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from k3serve.cache.events import EventIndex
from k3serve.cache.hashing import block_hashes, make_salt
from k3serve.cache.manager import CacheManager
from k3serve.cache.prefix import usable_prefix_blocks
from k3serve.cache.specs import CacheConfig
from router.index import GlobalIndex, ResyncNeeded
from router.placement import (
    POLICIES,
    DecodeWorkerState,
    NoWorkerAvailable,
    PlacementParams,
    PlacementRequest,
    PrefillWorkerState,
    branch_snapshot,
    place,
)

TRACE = Path(__file__).parents[1] / "data" / "trace_3000_3399.jsonl"
BLOCK = 64  # tokens per cache block
TRACE_BLOCK = 512  # tokens per trace block
SCALE = TRACE_BLOCK // BLOCK  # one trace block → one cache block
FINGERPRINT = "replay-k3"  # the workers' layout fingerprint (hash salt)
SALT = make_salt(FINGERPRINT)


# ----------------------------------------------------------------------------- trace
@dataclass(frozen=True)
class TraceRequest:
    """One trace row, scaled: arrival (s), prompt token ids, the router's block hashes."""

    arrival: float
    tokens: tuple[int, ...]
    hashes: tuple[str, ...]

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)


def load_trace(path: Path = TRACE) -> list[TraceRequest]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    t0 = rows[0]["timestamp"]
    out = []
    for r in rows:
        ids, n_in = r["hash_ids"], r["input_length"]
        last = n_in - (len(ids) - 1) * TRACE_BLOCK  # tokens in the last trace block, 1..512
        n = (len(ids) - 1) * BLOCK + math.ceil(last / SCALE)
        tokens = tuple(BLOCK * ids[i // BLOCK] + i % BLOCK for i in range(n))
        out.append(TraceRequest((r["timestamp"] - t0) / 1000.0, tokens,
                                tuple(block_hashes(tokens, BLOCK, SALT))))
    return out


def token_oracle(reqs: list[TraceRequest]) -> float:
    """Infinite cache, one pool, exact prefix at block granularity (one token always computed)."""
    seen: set[str] = set()
    hit = total = 0
    for r in reqs:
        m = 0
        for h in r.hashes:
            if h not in seen:
                break
            m += 1
        hit += min(m, (r.num_tokens - 1) // BLOCK) * BLOCK
        total += r.num_tokens
        seen.update(r.hashes)
    return hit / total


def working_set(reqs: list[TraceRequest]) -> tuple[int, int]:
    """Distinct full blocks, distinct prompt-end snapshot boundaries of the slice."""
    blocks = {h for r in reqs for h in r.hashes}
    ends = {r.hashes[(r.num_tokens - 1) // BLOCK - 1] for r in reqs
            if (r.num_tokens - 1) // BLOCK > 0}
    return len(blocks), len(ends)


# ----------------------------------------------------------------------------- worker model
def run_prefill(cm: CacheManager, rid: int, tokens: tuple[int, ...],
                snapshot_at: tuple[int, ...]) -> int:
    """Drive one prefill-only request through the cache bookkeeping; return cached tokens.

    Chunks end at the manager's snapshot points (``chunk_end``), as the engine's do.
    """
    cm.add(rid, tokens, snapshot_at=snapshot_at, snapshot_on_finish=False)
    hit = cm.match(rid)
    first = hit.chunk_end - hit.num_tokens
    cm.admit(rid, hit, first)
    cm.commit(rid, tokens, first)
    while cm.num_computed(rid) < len(tokens):
        n = cm.chunk_end(rid) - cm.num_computed(rid)
        cm.allocate(rid, n)
        cm.commit(rid, tokens, n)
    cm.finish(rid)
    return hit.num_tokens


@dataclass
class SimWorker:
    """FIFO prefill server over a ``CacheManager``; computes uncached tokens at ``rate``/s.

    ``queue`` holds (request, snapshot_at, predicted cached tokens); ``done`` holds
    (request, predicted, actual, finish time) in start order.
    """

    name: str
    cm: CacheManager
    rate: float
    free_at: float = 0.0
    queue: deque = field(default_factory=deque)
    done: list = field(default_factory=list)
    computed: int = 0

    def advance(self, t: float) -> None:
        """Start (look up, compute, store) every queued request that starts by time t."""
        while self.queue and self.free_at <= t:
            req, snaps, predicted = self.queue.popleft()
            actual = run_prefill(self.cm, len(self.done), req.tokens, snaps)
            work = req.num_tokens - actual
            self.computed += work
            self.free_at = max(self.free_at, req.arrival) + work / self.rate
            self.done.append((req, predicted, actual, self.free_at))

    def router_queued_tokens(self, t: float) -> int:
        """The router's account: predicted uncached tokens of prefills not answered by t."""
        q = sum(r.num_tokens - p for r, _, p in self.queue)
        if self.done and self.done[-1][3] > t:
            r, p, _, _ = self.done[-1]
            q += r.num_tokens - p
        return q


# ----------------------------------------------------------------------------- replay
@dataclass
class ReplayResult:
    policy: str
    hit_rate: float
    load: list[int]
    predicted: int
    actual: int
    agreed: int  # Σ min(predicted, actual) over requests

    @property
    def balance(self) -> float:
        return max(self.load) / (sum(self.load) / len(self.load))


def replay(reqs: list[TraceRequest], policy: str, *, workers: int = 2, capacity_blocks: int,
           capacity_snapshots: int, rate: float, poll_s: float = 0.05,
           params: PlacementParams | None = None) -> ReplayResult:
    """Replay arrivals through ``GlobalIndex`` + ``place`` onto simulated prefill workers.

    The router's queued-token figure per worker is its own account: the predicted uncached
    tokens of requests sent and not finished (what router/app.py keeps).
    """
    cfg = CacheConfig(num_pages=capacity_blocks, num_slots=2, num_snapshots=capacity_snapshots,
                      block_size=BLOCK)
    sims = [SimWorker(f"p{i}", CacheManager(cfg, FINGERPRINT), rate) for i in range(workers)]
    index = GlobalIndex()
    for w in sims:
        index.add_worker(w.name)
        index.load_state(w.name, w.cm.cache_state())
    last_poll = -math.inf
    for seq, r in enumerate(reqs):
        t = r.arrival
        for w in sims:
            w.advance(t)
        if t - last_poll >= poll_s:
            for w in sims:
                index.apply_events(w.name, w.cm.events_since(index.cursor(w.name)[1]))
            last_poll = t
        match = index.match(r.hashes, (r.num_tokens - 1) // BLOCK)
        states = []
        for w in sims:
            m = match.get(w.name)
            states.append(PrefillWorkerState(
                w.name, m.usable_blocks if m else 0, m.mla_blocks if m else 0,
                w.router_queued_tokens(t), rate))
        p = place(PlacementRequest(r.num_tokens, BLOCK, seq=seq), states, policy=policy,
                  params=params or PlacementParams())
        w = next(w for w in sims if w.name == p.prefill)
        w.queue.append((r, p.snapshot_at, p.predicted_cached_tokens))
        w.advance(t)
    for w in sims:
        w.advance(math.inf)
    done = [d for w in sims for d in w.done]
    total = sum(r.num_tokens for r in reqs)
    actual = sum(a for _, _, a, _ in done)
    predicted = sum(p for _, p, _, _ in done)
    agreed = sum(min(p, a) for _, p, a, _ in done)
    return ReplayResult(policy, actual / total, [w.computed for w in sims], predicted, actual,
                        agreed)


# ----------------------------------------------------------------------------- trace replay
REPLAY_RATE = 8_000.0  # scaled tokens/s per prefill worker: ~50 % busy under cache_aware


@pytest.fixture(scope="module")
def trace() -> list[TraceRequest]:
    return load_trace()


def test_trace_slice_is_rows_3000_to_3399(trace):
    assert len(trace) == 400
    first = json.loads(TRACE.read_text().splitlines()[0])
    assert first["timestamp"] == 782145  # row 3000 of shared/traces (0-based)
    assert all(r.num_tokens >= 1 for r in trace)
    assert all(len(r.hashes) == r.num_tokens // BLOCK for r in trace)


@pytest.mark.parametrize("rate", [REPLAY_RATE, 6_000.0], ids=["util50", "util70"])
def test_replay_cache_aware_beats_round_robin_balanced(trace, rate, capsys):
    nb, ns = working_set(trace)
    cfg = {"capacity_blocks": nb // 4, "capacity_snapshots": ns // 4, "rate": rate}
    oracle = token_oracle(trace)
    rr = replay(trace, "round_robin", **cfg)
    ca = replay(trace, "cache_aware", **cfg)
    others = {p: replay(trace, p, **cfg) for p in ("least_load", "random")}
    with capsys.disabled():
        print(f"\n[replay rate={rate:.0f} tok/s, cache {nb // 4}/{nb} blocks "
              f"{ns // 4}/{ns} snapshots per worker] token oracle {oracle:.4f}")
        for res in (ca, rr, *others.values()):
            print(f"  {res.policy:12s} hit {res.hit_rate:.4f} max/mean load {res.balance:.3f} "
                  f"agreement {res.agreed / max(1, res.actual):.4f}")
    assert 0.40 < oracle < 0.42
    assert ca.hit_rate >= 1.5 * rr.hit_rate
    assert ca.balance <= 1.15
    assert ca.hit_rate < oracle
    # predicted and actual agree on ≥ 99 % of the actual hit tokens
    assert ca.agreed >= 0.99 * ca.actual
    assert ca.actual > 0


def test_replay_deterministic_and_index_matches_worker_caches(trace):
    nb, ns = working_set(trace)
    a = replay(trace[:150], "cache_aware", capacity_blocks=nb // 4, capacity_snapshots=ns // 4,
               rate=REPLAY_RATE)
    b = replay(trace[:150], "cache_aware", capacity_blocks=nb // 4, capacity_snapshots=ns // 4,
               rate=REPLAY_RATE)
    assert a == b
    r1 = replay(trace[:150], "random", capacity_blocks=nb // 4, capacity_snapshots=ns // 4,
                rate=REPLAY_RATE, params=PlacementParams(seed=1))
    r2 = replay(trace[:150], "random", capacity_blocks=nb // 4, capacity_snapshots=ns // 4,
                rate=REPLAY_RATE, params=PlacementParams(seed=2))
    assert r1.load != r2.load


def test_branch_snapshots_help(trace):
    nb, ns = working_set(trace)
    cfg = {"capacity_blocks": nb // 4, "capacity_snapshots": ns // 4, "rate": REPLAY_RATE}
    on = replay(trace, "cache_aware", **cfg)
    off = replay(trace, "cache_aware", **cfg,
                 params=PlacementParams(snapshot_branch_points=False))
    assert on.hit_rate > off.hit_rate


# ----------------------------------------------------------------------------- index
def _ev(seq, kind, hashes, snap=False):
    return {"seq": seq, "type": kind, "block_hashes": list(hashes), "snapshot": snap}


def _synced(index, worker, epoch="e1"):
    index.add_worker(worker)
    index.load_state(worker, {"epoch": epoch, "last_seq": 0, "blocks": [], "snapshots": []})


def test_index_match_all_workers_in_one_pass():
    h = [f"h{i}" for i in range(6)]
    idx = GlobalIndex()
    for w in ("w0", "w1", "w2", "w3"):
        _synced(idx, w)
    # diagram of router/index.py: w0 holds 0..4 + snapshot at 4; w1 0..3 + snapshot at 2;
    # w3 holds 0..1 only; w2 holds nothing of this chain.
    idx.apply_events("w0", {"epoch": "e1", "last_seq": 2, "events": [
        _ev(1, "stored", h[:5]), _ev(2, "stored", [h[3]], True)]})
    idx.apply_events("w1", {"epoch": "e1", "last_seq": 2, "events": [
        _ev(1, "stored", h[:4]), _ev(2, "stored", [h[1]], True)]})
    idx.apply_events("w3", {"epoch": "e1", "last_seq": 1, "events": [_ev(1, "stored", h[:2])]})
    m = idx.match(h)
    assert m == {"w0": (5, 4), "w1": (4, 2), "w3": (2, 0)}
    assert idx.match(h, max_blocks=3) == {"w0": (5, 0), "w1": (4, 2), "w3": (2, 0)}
    for w in ("w0", "w1", "w2", "w3"):
        assert idx.cached_depth(h, w) == m.get(w, (0, 0))[1]
    assert idx.cached_depth(h, "w0", max_blocks=3) == 0
    assert idx.match([]) == {} and idx.match(["zz"] + h) == {}
    # a hole in the chain stops the match even if later blocks are present
    idx.apply_events("w0", {"epoch": "e1", "last_seq": 3, "events": [
        _ev(3, "removed", [h[2]])]})
    assert idx.match(h)["w0"] == (2, 0)
    assert idx.has_snapshot(h[3], "w0") and not idx.has_snapshot(h[3], "w1")


def test_index_gap_epoch_and_malformed_force_resync_without_mutation():
    idx = GlobalIndex()
    idx.add_worker("w")
    with pytest.raises(ResyncNeeded, match="not synced"):  # never synced
        idx.apply_events("w", {"epoch": "e", "last_seq": 0, "events": []})
    idx.load_state("w", {"epoch": "e", "last_seq": 3, "blocks": ["a"], "snapshots": ["a"]})
    with pytest.raises(ResyncNeeded, match="gap"):
        idx.apply_events("w", {"epoch": "e", "last_seq": 6, "events": [
            _ev(4, "stored", ["b"]), _ev(6, "stored", ["c"])]})
    assert idx.num_blocks("w") == 1 and idx.cursor("w") == ("e", 3)
    with pytest.raises(ResyncNeeded, match="announced"):  # events dropped, none sent
        idx.apply_events("w", {"epoch": "e", "last_seq": 5, "events": []})
    with pytest.raises(ResyncNeeded, match="epoch"):
        idx.apply_events("w", {"epoch": "f", "last_seq": 0, "events": []})
    with pytest.raises(ResyncNeeded, match="malformed"):
        idx.apply_events("w", {"epoch": "e", "last_seq": 4, "events": [{"seq": 4}]})
    with pytest.raises(ResyncNeeded, match="malformed.*type"):  # an unknown event type
        idx.apply_events("w", {"epoch": "e", "last_seq": 4,
                               "events": [_ev(4, "evicted", ["b"])]})
    with pytest.raises(ResyncNeeded, match="malformed.*epoch"):
        idx.apply_events("w", {"last_seq": 4})
    assert idx.num_blocks() == 1 and idx.cursor("w") == ("e", 3)
    # overlapping pull: already-applied events are skipped; a cut answer (last_seq beyond
    # the events sent) is applied as far as it goes
    assert idx.apply_events("w", {"epoch": "e", "last_seq": 9, "events": [
        _ev(3, "removed", ["a"]), _ev(4, "stored", ["b"])]}) == 1
    assert idx.match(["a", "b"]) == {"w": (2, 1)} and idx.cursor("w") == ("e", 4)
    with pytest.raises(ResyncNeeded, match="announced"):
        idx.apply_events("w", {"epoch": "e", "last_seq": 9, "events": [_ev(4, "stored", ["b"])]})
    with pytest.raises(ValueError):
        idx.load_state("w", {"epoch": "e", "blocks": []})
    with pytest.raises(KeyError):
        idx.apply_events("nobody", {"epoch": "e", "last_seq": 0, "events": []})


def test_index_resync_diff_and_worker_removal_reuses_bit():
    idx = GlobalIndex()
    _synced(idx, "a")
    _synced(idx, "b")
    idx.load_state("a", {"epoch": "e2", "last_seq": 9, "blocks": ["x", "y"], "snapshots": ["y"]})
    idx.load_state("b", {"epoch": "e1", "last_seq": 0, "blocks": ["x"], "snapshots": ["x"]})
    assert idx.match(["x", "y"]) == {"a": (2, 2), "b": (1, 1)}
    idx.load_state("a", {"epoch": "e3", "last_seq": 0, "blocks": ["x"], "snapshots": []})
    assert idx.match(["x", "y"]) == {"a": (1, 0), "b": (1, 1)}
    assert idx.cursor("a") == ("e3", 0)
    idx.remove_worker("a")
    assert idx.workers == ["b"] and idx.num_blocks() == 1 and idx.num_snapshots() == 1
    _synced(idx, "c")  # takes a's bit: must start empty
    assert idx.match(["x", "y"]) == {"b": (1, 1)}
    idx.remove_worker("nobody")


def test_index_replay_equals_worker_caches_random():
    """Events of real cache activity replayed into ``GlobalIndex`` reproduce every worker.

    Checked three ways per query: ``GlobalIndex.match`` against the worker's own index
    (MLA depth) and ``CacheManager.lookup`` (usable hit), and against
    ``k3serve.cache.events.EventIndex`` (the per-worker reader) fed the same events.
    """
    import random

    rng = random.Random(7)
    B = 4
    cfg = CacheConfig(num_pages=40, num_slots=2, num_snapshots=6, block_size=B)
    workers = [CacheManager(cfg, FINGERPRINT) for _ in range(5)]
    readers = [EventIndex() for _ in workers]
    idx = GlobalIndex()
    for i, cm in enumerate(workers):
        idx.add_worker(f"w{i}")
    stems = [[rng.randrange(30) for _ in range(12 * B)] for _ in range(8)]
    checked = resyncs = 0
    for step in range(300):
        stem = rng.choice(stems)
        tokens = tuple(stem[: rng.randrange(1, 12 * B)]
                       + [rng.randrange(1000) for _ in range(rng.randrange(0, 6 * B))])
        k = rng.randrange(len(workers))
        run_prefill(workers[k], step, tokens, (rng.randrange(1, len(tokens) + 1),))
        if step % 7:
            continue
        for i, cm in enumerate(workers):
            if rng.random() < 0.05:  # a worker restarted: new epoch, forced resync
                workers[i] = cm = CacheManager(cfg, FINGERPRINT)
            if rng.random() < 0.1:  # events after a gap: seen as one, resync
                cm.log._events.popleft() if cm.log._events else None
            try:
                idx.apply_events(f"w{i}", cm.events_since(idx.cursor(f"w{i}")[1]))
            except ResyncNeeded:
                resyncs += 1
                idx.load_state(f"w{i}", cm.cache_state())
            readers[i].sync(cm.events_since, cm.cache_state)
        for _ in range(5):
            q = tuple(rng.choice(stems)[: rng.randrange(1, 12 * B)])
            hashes = block_hashes(q, B, SALT)
            cap = (len(q) - 1) // B
            got = idx.match(hashes, cap)
            for i, cm in enumerate(workers):
                mla = 0
                while mla < len(hashes) and cm.index.has_block(hashes[mla]):
                    mla += 1
                usable = cm.lookup(q) // B
                # the one hit rule, on the worker's own index, is what match() answers
                assert usable_prefix_blocks(hashes, cap, cm.index.has_block,
                                            cm.index.has_snapshot) == usable
                assert readers[i].match(hashes, len(q), B) == usable * B
                assert got.get(f"w{i}", (0, 0)) == (mla, usable)
                assert idx.cached_depth(hashes, f"w{i}", cap) == usable
                checked += usable > 0
    assert checked > 50 and resyncs > 3  # usable hits and resyncs really happened


# ----------------------------------------------------------------------------- placement
def _pw(name, cached=0, mla=None, queued=0, rate=1000.0, healthy=True):
    return PrefillWorkerState(name, cached, cached if mla is None else mla, queued, rate, healthy)


def test_cache_aware_prefers_cache_until_queue_outweighs_it():
    req = PlacementRequest(num_prompt_tokens=1000, block_size=100)
    # a has 500 cached tokens, b none; equal queues → a
    assert place(req, [_pw("a", 5), _pw("b")]).prefill == "a"
    # a's queue (400) < its hit (500) → a still wins on TTFT: (400+500) < (0+1000)
    assert place(req, [_pw("a", 5, queued=400), _pw("b")]).prefill == "a"
    # a's queue 600 > hit → b
    assert place(req, [_pw("a", 5, queued=600), _pw("b")]).prefill == "b"
    # load guard: b queued 0.2 s; a queued 0.4 s > 1.5 × 0.2 + 0.05 → a excluded even though
    # its TTFT estimate is lower (0.4 + 0.1 < 0.2 + 1.0)
    params = PlacementParams(guard_factor=1.5, guard_seconds=0.05)
    assert place(req, [_pw("a", 9, queued=400), _pw("b", queued=200)]).prefill == "a"
    assert place(req, [_pw("a", 9, queued=400), _pw("b", queued=200)],
                 params=params).prefill == "b"
    # faster worker wins with equal cache
    assert place(req, [_pw("a"), _pw("b", rate=2000.0)]).prefill == "b"


def test_cached_tokens_capped_one_token_always_computed():
    # L = 1000, B = 100: at most ⌊999/100⌋ = 9 blocks reusable
    req = PlacementRequest(num_prompt_tokens=1000, block_size=100)
    p = place(req, [_pw("a", 10)])
    assert p.predicted_cached_tokens == 900
    req = PlacementRequest(num_prompt_tokens=1001, block_size=100)
    assert place(req, [_pw("a", 10)]).predicted_cached_tokens == 1000
    req = PlacementRequest(num_prompt_tokens=50, block_size=100)
    assert place(req, [_pw("a", 3)]).predicted_cached_tokens == 0


def test_idle_ties_rotate_and_policies_registry():
    assert set(POLICIES) >= {"cache_aware", "round_robin", "least_load", "random"}
    ws = [_pw("a"), _pw("b"), _pw("c")]
    for policy in ("cache_aware", "least_load", "round_robin"):
        got = [place(PlacementRequest(10, 4, seq=s), ws, policy=policy).prefill
               for s in range(6)]
        assert got == ["a", "b", "c", "a", "b", "c"], policy
    got = {place(PlacementRequest(10, 4, seq=s), ws, policy="random").prefill
           for s in range(40)}
    assert got == {"a", "b", "c"}
    same = [place(PlacementRequest(10, 4, seq=s), ws, policy="random").prefill for s in range(9)]
    assert same == [place(PlacementRequest(10, 4, seq=s), ws, policy="random").prefill
                    for s in range(9)]
    assert place(PlacementRequest(10, 4), [_pw("a", queued=50), _pw("b", queued=10)],
                 policy="least_load").prefill == "b"
    with pytest.raises(KeyError):
        place(PlacementRequest(10, 4), ws, policy="nope")


def test_unhealthy_workers_skipped_and_none_raises():
    req = PlacementRequest(10, 4)
    assert place(req, [_pw("a", 2, healthy=False), _pw("b")]).prefill == "b"
    with pytest.raises(NoWorkerAvailable):
        place(req, [_pw("a", healthy=False)])
    with pytest.raises(NoWorkerAvailable):
        place(req, [_pw("a")], [DecodeWorkerState("d", healthy=False)])
    with pytest.raises(ValueError):
        PlacementRequest(0, 4)


def test_snapshot_at_branch_points():
    req = PlacementRequest(num_prompt_tokens=1000, block_size=100)  # prompt end boundary: 9
    # b shares 6 blocks of MLA but has snapshots only up to 2: branch point at 600
    p = place(req, [_pw("a"), _pw("b", cached=2, mla=6)])
    assert p.prefill == "b" and p.snapshot_at == (600,)
    # the chosen worker can already reuse up to the branch point → nothing to ask
    assert place(req, [_pw("a", cached=6, mla=6)]).snapshot_at == ()
    # shared up to the prompt end: the worker snapshots there anyway
    assert place(req, [_pw("a", cached=0, mla=9)]).snapshot_at == ()
    assert place(req, [_pw("a", cached=0, mla=12)]).snapshot_at == ()
    # nothing shared
    assert place(req, [_pw("a")]).snapshot_at == ()
    # MLA depth elsewhere counts: a computes everything, and the branch is at 4 blocks
    p = place(req, [_pw("a"), _pw("b", mla=4, queued=10**6)])
    assert p.prefill == "a" and p.snapshot_at == (400,)
    assert place(req, [_pw("b", cached=1, mla=4)],
                 params=PlacementParams(snapshot_branch_points=False)).snapshot_at == ()
    assert branch_snapshot(req, _pw("x", cached=5), 5) == ()


def test_decode_choice_by_room_then_batch_load():
    req = PlacementRequest(num_prompt_tokens=100, block_size=10, max_new_tokens=50, n=2)
    # need 2 × 150 = 300 tokens and 2 slots
    d = [DecodeWorkerState("full", free_tokens=200, free_slots=8, running=0),
         DecodeWorkerState("busy", free_tokens=10_000, free_slots=8, running=5),
         DecodeWorkerState("light", free_tokens=400, free_slots=8, running=1),
         DecodeWorkerState("noslot", free_tokens=10_000, free_slots=1, running=0)]
    assert place(req, [_pw("p")], d).decode == "light"
    # same batch load → more free memory
    d2 = [DecodeWorkerState("x", free_tokens=400, running=1),
          DecodeWorkerState("y", free_tokens=900, running=1)]
    assert place(req, [_pw("p")], d2).decode == "y"
    # nobody has room → the one with the most free tokens (the request waits there)
    d3 = [DecodeWorkerState("x", free_tokens=100), DecodeWorkerState("y", free_tokens=250)]
    assert place(req, [_pw("p")], d3).decode == "y"
    assert place(req, [_pw("p")]).decode is None
