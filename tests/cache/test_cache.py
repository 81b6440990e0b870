"""k3serve.cache: hashing, specs, allocator, prefix index and match rules, events, no leaks.

Pure Python (no torch needed); the whole file runs in a few seconds.
"""

from __future__ import annotations

import hashlib
import json
import random
import struct
import subprocess
import sys

import pytest

from k3serve.cache.allocator import CacheFullError, RefPool, SlotPool
from k3serve.cache.events import EventIndex, EventLog
from k3serve.cache.hashing import block_hashes, hash_block, make_salt, root_hash
from k3serve.cache.manager import CacheManager
from k3serve.cache.prefix import max_hit_blocks, usable_prefix_blocks
from k3serve.cache.specs import (
    CacheConfig,
    CacheDtypes,
    KDAStateSpec,
    MLALatentSpec,
    layout_fingerprint,
)
from k3serve.cache.types import PrefixHit
from k3serve.config import PRESETS

FP = "0123456789abcdef0123456789abcdef"
B = 4


# ====================================================================== hashing
def _reference_hashes(tokens, bs, salt):
    """DESIGN.md §3 written out with hashlib directly: the definition the router relies on."""
    prev = hashlib.blake2b(salt.encode(), digest_size=16).digest()
    out = []
    for i in range(len(tokens) // bs):
        blk = tokens[i * bs : (i + 1) * bs]
        prev = hashlib.blake2b(
            prev + b"".join(struct.pack("<i", t) for t in blk), digest_size=16
        ).digest()
        out.append(prev.hex())
    return out


def test_block_hashes_match_definition_and_chain():
    toks = list(range(1000, 1010))
    hs = block_hashes(toks, 4, "salt")
    assert hs == _reference_hashes(toks, 4, "salt")
    assert len(hs) == 2  # the partial block has no hash
    assert all(len(h) == 32 and h == h.lower() for h in hs)
    # chained: a prefix's hashes are a prefix of the hashes
    assert block_hashes(toks[:8], 4, "salt") == hs
    # changing an early token changes every later hash
    toks2 = [toks[0] + 1] + toks[1:]
    assert all(a != b for a, b in zip(block_hashes(toks2, 4, "salt"), hs))
    # continuing a chain == hashing the whole
    assert block_hashes(toks[4:], 4, "ignored", parent=hs[0]) == hs[1:]
    assert hash_block(root_hash("salt"), toks[:4]) == hs[0]
    assert block_hashes([1, 2, 3], 4, "salt") == []


def test_block_hashes_deterministic_across_processes():
    toks = [random.Random(0).randrange(163840) for _ in range(300)]
    code = (
        "import json,sys; from k3serve.cache.hashing import block_hashes;"
        f"print(json.dumps(block_hashes({toks!r}, 64, 'fp|tenant')))"
    )
    outs = set()
    for seed in ("0", "1"):
        r = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={"PYTHONHASHSEED": seed, "PATH": ""},
            cwd=_repo_root(),
        )
        outs.add(tuple(json.loads(r.stdout)))
    assert outs == {tuple(block_hashes(toks, 64, "fp|tenant"))}


def _repo_root():
    import pathlib

    return str(pathlib.Path(__file__).resolve().parents[2])


def test_hashing_imports_without_torch():
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import k3serve.cache.hashing as h, k3serve.cache.events, k3serve.cache.prefix, "
        "k3serve.cache.manager, k3serve.cache.specs, k3serve.cache.allocator, k3serve.protocol\n"
        "print(h.block_hashes([1,2,3,4], 2, 'x')[1])\n"
        "assert 'numpy' not in sys.modules\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=_repo_root(), check=False
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == block_hashes([1, 2, 3, 4], 2, "x")[1]


def test_salt_isolation_and_validation():
    toks = list(range(64))
    a = block_hashes(toks, 16, make_salt(FP))
    b = block_hashes(toks, 16, make_salt(FP, "tenant-a"))
    c = block_hashes(toks, 16, make_salt(FP, "tenant-b"))
    d = block_hashes(toks, 16, make_salt(FP[::-1]))
    assert len({*a, *b, *c, *d}) == 16  # no hash shared between salts
    assert make_salt(FP, "t") == FP + "|t"
    for bad in ("", "a|b", None):
        with pytest.raises(ValueError, match="fingerprint"):
            make_salt(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="cache_salt"):
        make_salt(FP, "")
    with pytest.raises(ValueError, match="token_ids"):
        block_hashes([1, -2], 1, "s")
    with pytest.raises(ValueError, match="token_ids"):
        block_hashes([2**31], 1, "s")
    with pytest.raises(ValueError, match="block_size"):
        block_hashes([1], 0, "s")
    with pytest.raises(ValueError, match="parent"):
        block_hashes([1], 1, "s", parent="xyz")


# ====================================================================== specs
def test_specs_byte_arithmetic_k3():
    k3 = PRESETS["k3"]
    kda = KDAStateSpec.from_config(k3, CacheDtypes.for_config(k3))
    assert kda.state_bytes_per_layer == 96 * 128 * 128 * 4
    assert kda.num_layers == 69
    assert kda.state_bytes_per_layer * 69 / 2**20 == pytest.approx(414, abs=0.5)  # DESIGN.md §2
    assert kda.conv_bytes_per_layer * 69 / 2**20 == pytest.approx(14.6, abs=0.1)
    assert kda.snapshot_size_bytes == kda.slot_size_bytes == 69 * kda.bytes_per_layer
    mla = MLALatentSpec.from_config(k3, block_size=64)
    assert mla.bytes_per_token == 24 * 576 * 2 == 27648
    assert mla.page_size_bytes == 64 * 27648
    assert mla.num_pages_for(65) == 2 and mla.bytes_for(65) == 2 * mla.page_size_bytes
    # a snapshot costs as much as ~15 k tokens of latents (DESIGN.md §2)
    assert 15_000 < kda.snapshot_size_bytes / mla.bytes_per_token < 17_000
    cc = CacheConfig.from_memory(
        mla,
        kda,
        latent_bytes=10 * mla.page_size_bytes + 5,
        num_slots=2,
        snapshot_bytes=3 * kda.snapshot_size_bytes,
    )
    assert (cc.num_pages, cc.num_snapshots, cc.block_size) == (10, 3, 64)


def test_layout_fingerprint():
    tiny = PRESETS["k3-tiny"]
    d = CacheDtypes("float32", "float32")
    fp = layout_fingerprint(tiny, 64, d)
    assert len(fp) == 32 and fp == layout_fingerprint(
        tiny, 64, {"latent": "float32", "conv": "float32"}
    )
    assert fp != layout_fingerprint(tiny, 32, d)
    assert fp != layout_fingerprint(tiny, 64, CacheDtypes("bfloat16", "float32"))
    assert fp != layout_fingerprint(tiny.replace(kda_num_heads=2), 64, d)
    # the same latent width split differently between the two MLA parts
    r, rope = tiny.kv_lora_rank, tiny.qk_rope_head_dim
    moved = tiny.replace(kv_lora_rank=r + 8, qk_rope_head_dim=rope - 8)
    assert moved.mla_latent_dim == tiny.mla_latent_dim
    assert fp != layout_fingerprint(moved, 64, d)
    # the weights: two checkpoints (or seeds) of the same shape never share hashes
    assert layout_fingerprint(tiny, 64, d, "ckpt:a") != layout_fingerprint(tiny, 64, d, "ckpt:b")
    assert layout_fingerprint(tiny, 64, d, "ckpt:a") == layout_fingerprint(tiny, 64, d, "ckpt:a")
    assert fp != layout_fingerprint(tiny, 64, d, "ckpt:a")
    with pytest.raises(ValueError, match="dtype"):
        CacheDtypes("float8", "float32")
    with pytest.raises(ValueError, match="num_pages"):
        CacheConfig(num_pages=0, num_slots=1)


# ====================================================================== allocator
def test_refpool_refcounts_lru_eviction():
    evicted = []
    pool = RefPool(3, "page", on_evict=evicted.append)
    a, b, c = pool.allocate(), pool.allocate(), pool.allocate()
    assert (a, b, c) == (0, 1, 2) and not pool.can_allocate()
    with pytest.raises(CacheFullError):
        pool.allocate()
    pool.set_cached(a, True)
    pool.set_cached(b, True)
    pool.incref(a)  # shared
    pool.decref(a)
    assert pool.ref_count(a) == 1 and pool.num_free == 0
    pool.decref(b)  # cached → LRU
    pool.decref(a)  # cached → LRU (more recent)
    pool.decref(c)  # not cached → free
    assert pool.lru_ids() == [b, a] and pool.num_free == 3 and pool.num_cached_free == 2
    assert pool.allocate() == c and evicted == []  # free ids go first
    pool.incref(b)  # a hit takes b out of the LRU
    assert pool.lru_ids() == [a]
    assert pool.allocate() == a and evicted == [a]  # evicts the LRU head
    pool.check()
    pool.decref(c)  # c: free again
    with pytest.raises(ValueError, match="below zero"):
        pool.decref(c)
    with pytest.raises(ValueError, match="free id"):
        pool.incref(c)
    with pytest.raises(ValueError, match="free id"):
        pool.set_cached(c, True)
    slots = SlotPool(2)
    s = slots.allocate()
    slots.free(s)
    with pytest.raises(ValueError):
        slots.free(s)


# ====================================================================== manager driver
def _mgr(pages=64, slots=8, snaps=16, caching=True, interval=0, log=None):
    cfg = CacheConfig(
        num_pages=pages,
        num_slots=slots,
        num_snapshots=snaps,
        block_size=B,
        enable_prefix_caching=caching,
        snapshot_interval_tokens=interval,
    )
    return CacheManager(cfg, FP, log=log)


def _prefill(cm, sid, toks, chunk=3, **kw):
    """Admit and compute a whole prompt in chunks (never crossing chunk_end). Returns saves."""
    if not cm.has(sid):
        cm.add(sid, toks, **kw)
    hit = cm.match(sid)
    n = min(chunk, hit.chunk_end - hit.num_tokens)
    adm = cm.admit(sid, hit, n)
    saves = []
    while True:
        saves += [(s.position) for s in cm.commit(sid, toks, n)]
        done = cm.num_computed(sid)
        if done == len(toks):
            return adm, saves
        n = min(chunk, cm.chunk_end(sid) - done)
        assert n > 0
        cm.allocate(sid, n)


def _decode(cm, sid, toks, new_tokens):
    """Decode after a prefill: token #1 comes from the prefill's logits; each later token needs
    one forward of the previous one (so the last sampled token is never computed)."""
    saves = []
    for i, t in enumerate(new_tokens):
        if i:
            cm.allocate(sid, 1)
            saves += [s.position for s in cm.commit(sid, toks, 1)]
        toks.append(t)
    return saves


def test_repeated_prompt_reuses_floor_l_minus_1():
    for L in (4, 5, 8, 9, 15, 16, 17):
        cm = _mgr()
        toks = list(range(100, 100 + L))
        adm, saves = _prefill(cm, "a", toks)
        assert adm.num_cached == 0
        p0 = (L - 1) // B * B
        # p0, plus the rolling end-of-request snapshot when the prompt ends on a boundary
        assert saves == ([p0] if p0 else []) + ([L] if L % B == 0 else [])
        cm.finish("a")
        adm2, _ = _prefill(cm, "b", toks)
        assert adm2.num_cached == p0, L
        assert (adm2.load_snapshot is None) == (p0 == 0)
        cm.finish("b")
        cm.check()


def test_prompt_shorter_than_a_block():
    cm = _mgr()
    _prefill(cm, "a", [1, 2, 3])
    cm.finish("a")
    assert cm.lookup([1, 2, 3]) == 0
    assert cm.cache_state()["blocks"] == [] and cm.cache_state()["snapshots"] == []
    cm.add("b", [1, 2, 3])
    hit = cm.match("b")
    assert hit.num_tokens == 0 and hit.snapshot is None and hit.chunk_end == 3


def test_mla_blocks_without_snapshot_fall_back():
    base = list(range(1, 13))  # 3 blocks
    a = base + [50, 51, 52, 53, 9]  # L = 17: blocks 0..3, p0 = 16
    q = base + [50, 51, 52, 99, 98]  # shares blocks 0..2 with a, diverges in block 3
    for snapshot_at, expect in (([], 0), ([8], 8)):
        cm = _mgr()
        _, saves = _prefill(cm, "a", a, snapshot_at=snapshot_at)
        assert saves == sorted({16, *snapshot_at})
        cm.finish("a")
        assert cm.lookup(a) == 16
        # blocks 0..2 cached, no snapshot at 12: an earlier snapshot (8) or none
        assert cm.lookup(q) == expect
        cm.check()
    # the router marks the branch point of q at 12: the next prompt diverging there hits 12
    cm = _mgr()
    _prefill(cm, "a", a)
    cm.finish("a")
    _prefill(cm, "q", q, snapshot_at=[12, 13, 10**6])  # 13 rounds down to 12; 10**6 is ignored
    cm.finish("q")
    assert cm.lookup(base + [7, 7, 7, 7, 7]) == 12
    assert cm.lookup(base[:10] + [7, 7, 7, 7, 7]) == 0  # diverges inside block 2


def test_eviction_of_snapshots_and_blocks_shrinks_hits():
    # two snapshots only: a third prompt evicts the least recently used one
    cm = _mgr(pages=64, snaps=2)
    ps = [[k * 1000 + i for i in range(9)] for k in range(3)]
    for k, p in enumerate(ps):
        _prefill(cm, k, p)
        cm.finish(k)
    assert [cm.lookup(p) for p in ps] == [0, 8, 8]
    assert cm.snapshots.num_evictions == 1
    # pages: a big prompt takes almost every page → earlier blocks are evicted
    cm2 = _mgr(pages=6, snaps=4)
    a = list(range(1, 10))
    _prefill(cm2, "a", a)
    cm2.finish("a")
    assert cm2.lookup(a) == 8
    _prefill(cm2, "big", list(range(500, 521)))  # 21 tokens = 6 pages
    cm2.finish("big")
    assert cm2.lookup(a) == 0 and cm2.pages.num_evictions > 0
    cm2.check()


def test_multi_turn_end_of_request_snapshot():
    cm = _mgr()
    p1 = list(range(1, 11))  # L = 10
    _prefill(cm, "t1", p1)
    toks = list(p1)
    _decode(cm, "t1", toks, [200 + i for i in range(9)])  # answer of 9 → 19 tokens
    assert cm.num_computed("t1") == 18  # the last sampled token is not computed
    assert cm.finish("t1") == 16  # ⌊18/4⌋·4
    turn2 = toks + [300, 301, 302]
    assert cm.lookup(turn2) == 16
    adm, _ = _prefill(cm, "t2", turn2)
    assert adm.num_cached == 16
    cm.finish("t2")
    # a shared system prompt with a snapshot asked for at its end: other users hit it
    sys_p = list(range(900, 912))  # 12 tokens
    _prefill(cm, "u1", sys_p + [1, 2, 3, 4, 5], snapshot_at=[12])
    cm.finish("u1")
    assert cm.lookup(sys_p + [7, 7, 7, 7, 7, 7]) == 12
    cm.check()


def test_fork_shares_full_blocks_copies_partial():
    cm = _mgr()
    toks = list(range(1, 11))  # 10 tokens: 2 full blocks + partial
    _prefill(cm, "p", toks)
    plan = cm.fork("p", "c")
    bt_p, bt_c = cm.block_table("p"), cm.block_table("c")
    assert bt_c[:2] == bt_p[:2] and bt_c[2] != bt_p[2]
    assert plan.page_copies == ((bt_p[2], bt_c[2]),) and plan.src_slot != plan.dst_slot
    assert cm.pages.ref_count(bt_p[0]) == 2
    tp, tc = list(toks), list(toks)
    _decode(cm, "p", tp, [1, 2, 3])
    _decode(cm, "c", tc, [4, 5, 6])
    cm.finish("p")
    cm.finish("c")
    cm.check()
    assert cm.usage().pages_used == 0 and cm.usage().slots_used == 0


def test_caching_off_and_stale_hit():
    cm = _mgr(caching=False)
    _prefill(cm, "a", list(range(1, 20)))
    cm.finish("a")
    assert cm.lookup(list(range(1, 20))) == 0 and cm.log.last_seq == 0
    cm = _mgr(pages=4, snaps=2)
    a = list(range(1, 10))
    _prefill(cm, "a", a)
    cm.finish("a")
    cm.add("b", a)
    hit = cm.match("b")
    assert hit.num_tokens == 8
    _prefill(cm, "x", list(range(50, 66)))  # evicts a's pages
    with pytest.raises(ValueError, match="stale"):
        cm.admit("b", hit, 1)
    with pytest.raises(ValueError, match="seq_id"):
        cm.add("b", a)
    with pytest.raises(ValueError, match="snapshot_at"):
        cm.add("c", a, snapshot_at=[-1])
    with pytest.raises(ValueError, match="token_ids"):
        cm.add("d", [])
    assert not cm.can_admit("b", PrefixHit(0), 100)


def test_interval_snapshots():
    cm = _mgr(interval=8)
    toks = list(range(1, 30))  # L = 29, p0 = 28; interval points 8, 16, 24
    _, saves = _prefill(cm, "a", toks, chunk=5)
    assert saves == [8, 16, 24, 28]
    cm.finish("a")
    assert cm.lookup(toks[:17] + [0] * 5) == 16


# ====================================================================== events
def _random_workload(cm, rng, n, vocab=6, max_len=30, shared=3):
    """Prompts from a few shared stems (prefix sharing), random decode lengths, some aborts."""
    stems = [[rng.randrange(vocab) for _ in range(rng.randrange(4, 16))] for _ in range(shared)]
    for i in range(n):
        toks = list(rng.choice(stems)) + [
            rng.randrange(vocab) for _ in range(rng.randrange(1, max_len))
        ]
        try:
            _prefill(cm, i, toks, chunk=rng.randrange(1, 9), snapshot_at=[rng.randrange(0, 20)])
        except CacheFullError:
            cm.remove(i)
            continue
        try:
            _decode(cm, i, toks, [rng.randrange(vocab) for _ in range(rng.randrange(0, 10))])
        except CacheFullError:
            cm.remove(i)
            continue
        cm.remove(i) if rng.random() < 0.2 else cm.finish(i)


def test_events_replay_reproduces_cache_content():
    rng = random.Random(5)
    cm = _mgr(pages=24, snaps=5)
    idx = EventIndex()
    idx.sync(lambda a: cm.events_since(a), cm.cache_state)
    for _round in range(6):
        _random_workload(cm, rng, 20)
        assert idx.sync(lambda a: cm.events_since(a, limit=None), cm.cache_state) is False
        st = cm.cache_state()
        assert idx.content() == (frozenset(st["blocks"]), frozenset(st["snapshots"]))
        assert idx.last_seq == cm.log.last_seq
    assert cm.pages.num_evictions > 0 and cm.snapshots.num_evictions > 0
    # a fresh reader replaying the whole log from an empty index gets the same
    fresh = EventIndex()
    fresh.load_state({"epoch": cm.log.epoch, "last_seq": 0})
    assert fresh.apply(cm.events_since(0))
    assert fresh.content() == idx.content()
    # router-side match agrees with the worker
    for _ in range(50):
        p = [rng.randrange(6) for _ in range(rng.randrange(1, 30))]
        hs = block_hashes(p, B, make_salt(FP))
        assert fresh.match(hs, len(p), B) == cm.lookup(p)


def test_event_index_resyncs_on_gap_and_new_epoch():
    rng = random.Random(1)
    cm = _mgr(pages=16, snaps=3, log=EventLog(max_events=5))
    idx = EventIndex()
    idx.sync(cm.events_since, cm.cache_state)
    _random_workload(cm, rng, 10)  # far more than 5 events: the reader falls behind
    assert idx.apply(cm.events_since(idx.last_seq)) is False  # gap
    assert idx.sync(cm.events_since, cm.cache_state) is True
    st = cm.cache_state()
    assert idx.content() == (frozenset(st["blocks"]), frozenset(st["snapshots"]))
    cm2 = _mgr()  # a restarted worker: new epoch
    assert cm2.log.epoch != cm.log.epoch
    assert idx.apply(cm2.events_since(0)) is False
    assert idx.sync(cm2.events_since, cm2.cache_state) is True and idx.epoch == cm2.log.epoch
    with pytest.raises(ValueError):
        cm2.log.append("evicted", ["x"], False)


def test_usable_prefix_rule():
    hs = ["a", "b", "c", "d"]
    blocks, snaps = {"a", "b", "c"}, {"a", "c", "d"}
    f = lambda m: usable_prefix_blocks(hs, m, blocks.__contains__, snaps.__contains__)
    assert f(4) == 3 and f(2) == 1 and f(0) == 0
    blocks.discard("b")
    assert f(4) == 1
    assert max_hit_blocks(1, 4) == 0 and max_hit_blocks(9, 4) == 2 and max_hit_blocks(8, 4) == 1


# ====================================================================== no leaks
def test_random_alloc_free_abort_leave_everything_free():
    rng = random.Random(1234)
    cm = _mgr(pages=40, slots=6, snaps=6, interval=8)
    running: dict[int, list[int]] = {}
    waiting: dict[int, list[int]] = {}
    nid = reused = 0
    for step in range(3000):
        if nid < 1000 and rng.random() < 0.5:
            toks = [rng.randrange(5) for _ in range(rng.randrange(1, 40))]
            cm.add(nid, toks, cache_salt=rng.choice([None, "t"]), snapshot_at=[rng.randrange(40)])
            waiting[nid] = toks
            nid += 1
        if waiting and rng.random() < 0.6:  # admit one
            sid = rng.choice(list(waiting))
            hit = cm.match(sid)
            n = rng.randrange(1, 10)
            n = min(n, hit.chunk_end - hit.num_tokens)
            if cm.can_admit(sid, hit, n):
                reused += cm.admit(sid, hit, n).num_cached
                cm.commit(sid, waiting[sid], n)
                running[sid] = waiting.pop(sid)
        for sid in list(running):  # advance: a chunk or a decode token
            toks = running[sid]
            done = cm.num_computed(sid)
            if done < cm.num_prompt(sid):
                n = min(rng.randrange(1, 10), cm.chunk_end(sid) - done)
            else:
                n = 1
                if done == len(toks):
                    toks.append(rng.randrange(5))
            if not cm.can_allocate(sid, n):  # preempt by recompute
                cm.release(sid)
                cm.set_tokens(sid, toks)
                waiting[sid] = running.pop(sid)
                continue
            cm.allocate(sid, n)
            cm.commit(sid, toks, n)
            if done >= cm.num_prompt(sid) and rng.random() < 0.03:
                if rng.random() < 0.3 and cm.can_fork(sid):
                    cm.fork(sid, ("c", sid))
                    running[("c", sid)] = list(toks)  # type: ignore[index]
                cm.finish(sid)
                del running[sid]
            elif rng.random() < 0.01:  # abort during prefill or decode
                cm.remove(sid)
                del running[sid]
        for sid in list(waiting):  # abort before admission
            if rng.random() < 0.002:
                cm.remove(sid)
                del waiting[sid]
        if step % 100 == 0:
            cm.check()
    for sid in list(running) + list(waiting):
        cm.remove(sid)
    cm.check()
    u = cm.usage()
    assert nid == 1000
    assert u.pages_used == 0 and u.slots_used == 0 and u.snapshots_used == 0
    assert all(cm.pages.ref_count(i) == 0 for i in range(cm.pages.num_ids))
    assert all(cm.snapshots.ref_count(i) == 0 for i in range(cm.snapshots.num_ids))
    assert cm.seq_ids() == []
    # (re-admissions after preemption reuse blocks too; stats count first admissions only)
    assert reused > cm.stats.hit_tokens >= 0 and cm.pages.num_evictions > 0
    assert cm.stats.snapshots_missed == 0
    assert cm.reset_prefix_cache() > 0
    assert cm.cache_state()["blocks"] == [] and cm.usage().pages_cached == 0


def test_rolling_snapshots_leave_room_for_prompt_snapshots():
    """Every decoding sequence pinned a rolling (end-of-request) snapshot until it finished:
    ``num_snapshots`` concurrent decodes took the whole budget and new prompts' snapshots were
    skipped. Rolling snapshots are capped at ``⌊num_snapshots × rolling_snapshot_fraction⌋``;
    a sequence over the cap publishes no end-of-request snapshot."""
    cm = _mgr(snaps=4)  # cap 2 (default fraction 0.5)
    assert cm.config.max_rolling_snapshots == 2
    for k in range(4):  # L = 5: prompt snapshot at 4, then decoding reaches the boundary 8
        toks = [1000 * (k + 1) + i for i in range(5)]
        _prefill(cm, k, toks)
        _decode(cm, k, toks, [7, 7, 7, 7])
        assert cm.num_computed(k) == 8
    assert cm.snapshots.num_used == 2 and cm.stats.rolling_skipped == 2
    skipped = cm.stats.snapshots_skipped
    p = list(range(500, 509))  # L = 9: its prompt snapshot at 8 is taken, not skipped
    _prefill(cm, "new", p)
    assert cm.stats.snapshots_skipped == skipped
    cm.finish("new")
    assert cm.lookup(p) == 8
    ends = [cm.finish(k) for k in range(4)]
    assert ends == [8, 8, None, None] and cm.stats.end_snapshots == 2
    cm.check()
    # no cap (fraction 1) restores the old behaviour; 0 turns end-of-request snapshots off
    assert CacheConfig(4, 1, 4, rolling_snapshot_fraction=1).max_rolling_snapshots == 4
    assert CacheConfig(4, 1, 4, rolling_snapshot_fraction=0).max_rolling_snapshots == 0
    with pytest.raises(ValueError, match="rolling_snapshot_fraction"):
        CacheConfig(4, 1, 4, rolling_snapshot_fraction=2)


def test_query_stats_count_real_lookups_only():
    """A decode-side reservation and a re-admission after preemption were counted as prefix
    cache queries (the prompt's tokens again each time)."""
    cm = _mgr()
    toks = list(range(1, 10))
    _prefill(cm, "a", toks)
    cm.finish("a")
    assert (cm.stats.num_queries, cm.stats.query_tokens, cm.stats.hit_tokens) == (1, 9, 0)
    cm.add("r", toks, plan_snapshots=False, lookup=False)  # a reservation
    cm.admit("r", PrefixHit(0), len(toks))
    assert cm.stats.num_queries == 1
    cm.remove("r")
    _prefill(cm, "b", toks)  # a real lookup: hits 8
    cm.release("b")  # preempted
    cm.set_tokens("b", toks + [50])
    _prefill(cm, "b", toks + [50])  # re-admitted: not a new query
    assert (cm.stats.num_queries, cm.stats.query_tokens, cm.stats.hit_tokens) == (2, 18, 8)
    cm.finish("b")
    cm.check()
