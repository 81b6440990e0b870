"""Store tier pieces without a live stack: snapshot points, fetch plan, import bookkeeping, pool
bytes round trip, the router's store holder and pricing, the client's down/full handling, and
evictions reaching the router's index (reconciliation, failed reads)."""

from __future__ import annotations

import random
import time

import pytest

from k3serve.cache.events import EventLog, make_state
from k3serve.cache.manager import CacheManager
from k3serve.cache.prefix import fetch_plan, log_snapshot_points
from k3serve.cache.specs import CacheConfig
from kvstore.store.client import KVStore, StoreConfig, StoreState, block_key, snapshot_key
from kvstore.store.tier import store_events
from router.index import STORE, GlobalIndex
from router.placement import PlacementParams, PlacementRequest, PrefillWorkerState, cache_aware
from router.policies import RecentLoad, WorkerView, live_view


def test_log_snapshot_points_are_dense_then_doubling():
    assert log_snapshot_points(2048, 64, 4) == [64, 128, 192, 256, 384, 512, 768, 1024, 1536,
                                                2048]
    assert log_snapshot_points(200, 64, 4) == [64, 128, 192]
    assert log_snapshot_points(2048, 64, 0) == []


def test_first_divergence_hits_with_dense_snapshots():
    cm = CacheManager(CacheConfig(64, 4, 16, 4, dense_snapshot_blocks=2), "fp")
    rng = random.Random(0)
    shared = [rng.randrange(100) for _ in range(10)]
    a, b = shared + [1] * 9, shared + [2] * 5
    cm.add("a", a)
    cm.admit("a", cm.match("a"), len(a))
    saves = cm.commit("a", a, 4)
    saves += cm.commit("a", a, 4)
    saves += cm.commit("a", a, 8)
    assert [s.position for s in saves] == [4, 8, 16]  # points 4, 8, then spacing 8: 16
    cm.finish("a")
    cm.add("b", b)
    assert cm.match("b").num_tokens == 8  # diverged at 10: boundary 8 has a snapshot
    cm.check()


def test_fetch_plan_combines_local_and_store():
    hs = ["h0", "h1", "h2", "h3"]
    local_b, local_s = {"h0", "h1"}, {"h1"}
    store_b, store_s = {"h0", "h1", "h2", "h3"}, {"h3"}
    j, blocks, snap = fetch_plan(hs, 4, local_b.__contains__, local_s.__contains__,
                                 store_b.__contains__, store_s.__contains__)
    assert (j, blocks, snap) == (4, ["h2", "h3"], "h3")
    j, blocks, snap = fetch_plan(hs, 2, local_b.__contains__, local_s.__contains__,
                                 store_b.__contains__, store_s.__contains__)
    assert (j, blocks, snap) == (2, [], None)


def test_import_pins_local_part_and_indexes_fetched_entries():
    cm = CacheManager(CacheConfig(4, 2, 2, 4), "fp")
    ids = list(range(13))
    hs, cap = cm.prefix_hashes(ids)
    assert cap == 3 and len(hs) == 3
    plan = cm.importer.begin(hs, hs, hs[-1])
    assert plan is not None and len(plan.pages) == 3 and plan.snapshot is not None
    cm.importer.end(plan)
    assert cm.lookup(ids) == 12
    cm.check()
    # a second import needing more pages than free (all 3 held by the first prefix? no: LRU)
    other = [100 + i for i in range(13)]
    ho, _ = cm.prefix_hashes(other)
    plan2 = cm.importer.begin(ho, ho, ho[-1])  # 3 pages: 1 free + LRU ones evicted
    assert plan2 is not None
    cm.importer.abort(plan2)
    cm.check()
    assert cm.importer.begin(ho, ho[:1], ho[-1]) is None  # blocks 1-2 neither local nor fetched


def test_pool_bytes_round_trip():
    import torch

    from k3serve.cache.pools import KVPools
    from k3serve.config import PRESETS

    p = KVPools(PRESETS["k3-tiny"], 2, 3, 16, 2)
    p.mla_latent.normal_()
    p.snap_state.normal_()
    p.snap_conv.normal_()
    blk, snap = bytes(p.block_bytes(1).numpy()), bytes(p.snapshot_bytes(0).numpy())
    assert len(blk) == p.block_nbytes() and len(snap) == p.snapshot_nbytes()
    p.load_block(2, blk)
    p.load_snapshot_bytes(1, snap)
    assert torch.equal(p.mla_latent[:, 2], p.mla_latent[:, 1])
    assert torch.equal(p.snap_state[:, 1], p.snap_state[:, 0])
    assert torch.equal(p.snap_conv[:, 1], p.snap_conv[:, 0])
    with pytest.raises(ValueError, match="data"):
        p.load_block(0, blk[:-1])


def test_router_indexes_store_events_under_the_store_and_prices_them():
    idx = GlobalIndex()
    idx.add_worker("w")
    idx.load_state("w", {"epoch": "e", "last_seq": 0, "blocks": [], "snapshots": []})
    idx.apply_events("w", {"epoch": "e", "last_seq": 2, "events": [
        {"seq": 1, "type": "stored", "block_hashes": ["a", "b"], "source": "store"},
        {"seq": 2, "type": "stored", "block_hashes": ["b"], "snapshot": True,
         "source": "store"}]})
    assert idx.cached_depth(["a", "b"], "w") == 0
    assert idx.store_depth(["a", "b"]) == 2
    assert idx.match(["a", "b"])[STORE].usable_blocks == 2
    req = PlacementRequest(300, 64)
    params = PlacementParams()
    local = PrefillWorkerState("local", cached_blocks=4, queued_tokens=0)
    via_store = PrefillWorkerState("store", cached_blocks=0, store_blocks=4, queued_tokens=0)
    miss = PrefillWorkerState("miss", queued_tokens=0)
    assert cache_aware(req, [via_store, local, miss], params) == 1  # local beats store
    assert cache_aware(req, [miss, via_store], params) == 1  # store beats a miss


class _FakeClient:
    def __init__(self):
        self.data: dict[str, bytes] = {}
        self.rc = 0

    def batch_is_exist(self, keys):
        return [-900] * len(keys) if self.rc == -900 else [int(k in self.data) for k in keys]

    def is_exist(self, key):
        return -900 if self.rc == -900 else int(key in self.data)

    def put(self, key, data):
        if self.rc:
            return self.rc
        self.data[key] = bytes(data)
        return 0

    def get(self, key):
        return b"" if self.rc == -900 else self.data.get(key, b"")

    def close(self):
        pass


def test_client_down_full_and_recovery(caplog):
    fake = _FakeClient()
    s = KVStore(StoreConfig(url="127.0.0.1:1", retry_s=0.05), "f" * 32, client=fake).start()
    try:
        assert s.put_block("h", b"x" * 10) and s.flush()
        assert fake.data[block_key(s.fingerprint, "h")] == b"x" * 10
        assert s.lookup(["h", "g"], ["h"]) == ({"h"}, set())
        assert s.get_block("h") == b"x" * 10
        assert s.drain_changes() == [("h", False, True)]
        fake.rc = -200  # full: a failed put, reads still served
        s.put_snapshot("s", b"y")
        s.flush()
        assert s.state is StoreState.FULL and s.stats.failures == 1 and s.available
        fake.rc = -900  # master gone
        s.put_snapshot("s2", b"y")
        s.flush()
        assert s.state is StoreState.DOWN and not s.available
        assert s.lookup(["h"], []) == (set(), set()) and s.get_block("h") is None
        assert not s.put_block("h3", b"z")  # dropped while down
        fake.rc = 0
        import time

        t_end = time.monotonic() + 5
        while s.state is not StoreState.UP and time.monotonic() < t_end:
            time.sleep(0.02)
        assert s.state is StoreState.UP
        assert s.put_snapshot("s3", b"q") and s.flush()
        assert snapshot_key(s.fingerprint, "s3") in fake.data
        downs = [r for r in caplog.records if "is down" in r.getMessage()]
        assert len(downs) == 1
    finally:
        s.close()


class _Reported:
    """One worker's store client feeding the router's index as the live stack does: the
    client's changes → the worker's cache event log (``StoreTier.export``) → the router's
    poll (``GlobalIndex.apply_events``) → the ``store`` holder placement prices."""

    def __init__(self, store: KVStore):
        self.store = store
        self.log = EventLog()
        self.idx = GlobalIndex()
        self.idx.add_worker("w")
        self.idx.load_state("w", make_state(self.log.epoch, 0, [], []))

    def pull(self) -> None:
        for type_, hs, snap in store_events(self.store.drain_changes()):
            self.log.append(type_, hs, snapshot=snap, source="store")
        self.idx.apply_events("w", self.log.since(self.idx.cursor("w")[1]))

    def store_view(self, chain: list[str]) -> WorkerView:
        """A prefill worker holding nothing itself, 100 tokens queued, as the router sees it."""
        m = self.idx.match(chain, len(chain))
        return live_view("p", m.get("p"), m.get(STORE), 100, 10_000.0, RecentLoad())


def test_store_eviction_is_reported_and_no_longer_priced_as_a_store_hit():
    fake = _FakeClient()
    s = KVStore(StoreConfig(url="127.0.0.1:1", retry_s=0.05, reconcile_s=0.05), "f" * 32,
                client=fake).start()
    r = _Reported(s)
    chain = ["a", "b", "c", "d"]
    req = PlacementRequest(4 * 64 + 10, 64)
    try:
        for h in "abc":
            s.put_block(h, b"x" * 8)
        s.put_snapshot("c", b"y" * 8)
        assert s.flush()
        r.pull()
        assert r.idx.store_depth(chain) == 3 and r.store_view(chain).store_blocks == 3
        cold = PrefillWorkerState("cold", queued_tokens=0)  # idle, holds nothing
        assert cache_aware(req, [cold, r.store_view(chain)], PlacementParams()) == 1
        # the master evicts block b; nobody reads it: the writer's reconciliation notices
        del fake.data[block_key(s.fingerprint, "b")]
        t_end = time.monotonic() + 10
        while r.idx.store_depth(chain) and time.monotonic() < t_end:
            time.sleep(0.02)
            r.pull()
        assert r.idx.store_depth(chain) == 0 and r.store_view(chain).store_blocks == 0
        assert s.stats.gone == 1
        assert cache_aware(req, [cold, r.store_view(chain)], PlacementParams()) == 0
        # put again (a worker computed it anew): claimed again, in order
        s.put_block("b", b"x" * 8)
        assert s.flush()
        r.pull()
        assert r.idx.store_depth(chain) == 3
    finally:
        s.close()


def test_failed_store_read_reports_at_once():
    """A worker that finds a value gone when it reads it (evicted between lookup and get), or a
    lookup that finds absent a key it reported, reports it without waiting for reconciliation."""
    fake = _FakeClient()
    s = KVStore(StoreConfig(url="127.0.0.1:1", reconcile_s=3600), "f" * 32, client=fake).start()
    r = _Reported(s)
    try:
        for h in "ab":
            s.put_block(h, b"x" * 8)
            s.put_snapshot(h, b"y" * 8)
        assert s.flush()
        r.pull()
        assert r.idx.store_depth(["a", "b"]) == 2
        del fake.data[snapshot_key(s.fingerprint, "b")]
        assert s.get_snapshot("b") is None
        r.pull()
        assert r.idx.store_depth(["a", "b"]) == 1
        del fake.data[block_key(s.fingerprint, "a")]
        assert s.lookup(["a", "b"], []) == ({"b"}, set())
        r.pull()
        assert r.idx.store_depth(["a", "b"]) == 0
        # a lookup of keys nobody reported adds nothing to the log
        n = r.log.last_seq
        assert s.lookup(["zz"], ["zz"]) == (set(), set())
        r.pull()
        assert r.log.last_seq == n
    finally:
        s.close()
