"""Placement policies: unit checks, the global index, and a trace replay showing cache-aware
placement beats round robin on hit rate at a balanced load.

The replay feeds rows 3000–3399 of the Mooncake trace (``tests/data``) through the product's
simulator (``simulate``): the router's real decision path — the prompt's block hashes,
``GlobalIndex`` fed by the workers' cache events, then ``place`` — onto 2 simulated prefill
workers that run the real cache bookkeeping (``k3serve.cache.manager.CacheManager``). Each
worker's cache holds a quarter of the slice's working set; one 512-token trace block becomes
one 64-token cache block (``simulate.traces``). The router's prediction is made at arrival from
events pulled every ``poll_s``, so it is wrong when queued work evicts what it counted on.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from k3serve.cache.events import EventIndex
from k3serve.cache.hashing import block_hashes, make_salt
from k3serve.cache.manager import CacheManager
from k3serve.cache.prefix import usable_prefix_blocks
from k3serve.cache.specs import CacheConfig
from simulate.traces import load_trace, token_oracle
from router.index import GlobalIndex, ResyncNeeded
from router.placement import (
    DecodeWorkerState,
    NoWorkerAvailable,
    PlacementParams,
    PlacementRequest,
    PrefillWorkerState,
    branch_snapshot,
)
from router.policies.table import POLICIES, place
from simulate import SimConfig, replay
from simulate.calibration import Calibration

TRACE = Path(__file__).parents[1] / "data" / "trace_3000_3399.jsonl"
BLOCK = 64  # tokens per cache block (one 512-token trace block → one cache block)
FINGERPRINT = "replay-k3"  # the workers' layout fingerprint (hash salt)
SALT = make_salt(FINGERPRINT)


# ----------------------------------------------------------------------------- trace replay
# The replay is the product's simulator (simulate/): the real GlobalIndex fed by cache events,
# the real ``place`` and one real CacheManager per prefill worker, FIFO prefill at a fixed rate.
REPLAY_RATE = 8_000.0  # scaled tokens/s per prefill worker: ~50 % busy under cache_aware


def _replay(reqs, policy: str, rate: float = REPLAY_RATE, **params):
    cfg = SimConfig(prefill_workers=2, decode_workers=0, cache_fraction=1 / 4, load=None,
                    calibration=Calibration().with_rate(rate), fingerprint=FINGERPRINT,
                    params=PlacementParams(**params))
    return replay(reqs, policy, cfg)


@pytest.fixture(scope="module")
def trace():
    return load_trace(TRACE, fingerprint=FINGERPRINT)


def test_trace_slice_is_rows_3000_to_3399(trace):
    assert len(trace) == 400
    first = json.loads(TRACE.read_text().splitlines()[0])
    assert first["timestamp"] == 782145  # row 3000 of traces/mooncake_synthetic_trace.jsonl
    assert all(r.num_tokens >= 1 for r in trace)
    assert all(len(r.hashes) == r.num_tokens // BLOCK for r in trace)


@pytest.mark.parametrize("rate", [REPLAY_RATE, 6_000.0], ids=["util50", "util70"])
def test_replay_cache_aware_beats_round_robin_balanced(trace, rate):
    oracle = token_oracle(trace)
    res = {p: _replay(trace, p, rate) for p in ("cache_aware", "round_robin", "least_load",
                                                "random")}
    ca, rr = res["cache_aware"], res["round_robin"]
    # the table every failure message carries
    head = (f"replay rate={rate:.0f} tok/s, cache 1/4 of the working set per worker; "
            f"token oracle {oracle:.4f}")
    table = "\n".join([head] + [
        f"  {r.policy:12s} hit {r.hit_rate:.4f} max/mean load {r.load_max_over_mean:.3f} "
        f"agreement {r.agreement:.4f}" for r in res.values()])
    assert 0.40 < oracle < 0.42, table
    assert ca.hit_rate >= 1.5 * rr.hit_rate, table
    assert ca.load_max_over_mean <= 1.15, table
    assert ca.hit_rate < oracle, table
    # predicted and actual agree on ≥ 99 % of the actual hit tokens
    assert ca.agreement >= 0.99, table
    assert ca.actual > 0, table


def test_replay_deterministic_and_seeded(trace):
    assert _replay(trace[:150], "cache_aware") == _replay(trace[:150], "cache_aware")
    r1 = _replay(trace[:150], "random", seed=1)
    r2 = _replay(trace[:150], "random", seed=2)
    assert r1.load != r2.load


def test_branch_snapshots_help(trace):
    on = _replay(trace, "cache_aware")
    off = _replay(trace, "cache_aware", snapshot_branch_points=False)
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
        workers[k].run_prefill(step, tokens, snapshot_at=(rng.randrange(1, len(tokens) + 1),))
        if step % 7:
            continue
        for i, cm in enumerate(workers):
            if rng.random() < 0.05:  # a worker restarted: new epoch, forced resync
                workers[i] = cm = CacheManager(cfg, FINGERPRINT)
            if rng.random() < 0.1:  # events after a gap: seen as one, resync
                cm.log.events.popleft() if cm.log.events else None
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
