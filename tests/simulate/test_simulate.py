"""k3serve simulate (issue 12): trace mapping, ceilings, the replay, the store, the policies, CLI.

Figures come from the committed slice (rows 3000–3399 of the shared trace) and small
generated traces; every run here is a few seconds on 2 cores.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from k3serve.cache.hashing import block_hashes, make_salt
from simulate import SimConfig, load_calibration, replay, run, trace_facts
from simulate.calibration import SCHEMA, Calibration
from simulate.config import auto_store_interval, snapshot_blocks
from kvstore.store.sim import SimStore
from simulate.tracegen import agent_trace, conversation_trace, write_trace
from simulate.traces import (
    DEFAULT_FINGERPRINT,
    block_tokens,
    load_trace,
    parse_row,
    prompt_tokens,
    scale_rows,
    scaled_length,
    snapshot_rule_ceiling,
    token_oracle,
    working_set,
)
from router.placement import PlacementRequest
from router.policies.table import DEFAULT_POLICY, POLICIES, place
from router.policies import RouterView, WorkerView
from router.policies.home import HomeParams

DATA = Path(__file__).parents[1] / "data"
SLICE = DATA / "trace_3000_3399.jsonl"
SMALL = SimConfig(prefill_workers=4, decode_workers=2, cache_fraction=1 / 4)


@pytest.fixture(scope="module")
def slice_reqs():
    return load_trace(SLICE)


# ----------------------------------------------------------------------------- mapping
def test_block_tokens_deterministic_and_distinct():
    assert block_tokens(7) == block_tokens(7) == list(range(7 * 64, 8 * 64))
    assert block_tokens(7, 16) == list(range(112, 128))
    blocks = {tuple(block_tokens(i)) for i in range(500)}
    assert len(blocks) == 500
    assert not set(block_tokens(3)) & set(block_tokens(4))
    v = [block_tokens(i, 64, vocab_size=256) for i in range(200)]
    assert v[5] == block_tokens(5, 64, vocab_size=256)
    assert len({tuple(b) for b in v}) == 200 and all(0 <= t < 256 for b in v for t in b)
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="block_id"):
            block_tokens(bad)
    with pytest.raises(ValueError, match="vocab_size"):
        block_tokens(1, 64, vocab_size=1)


def test_prompt_tokens_and_scaled_length_match_the_replay_rule():
    # tests/router/test_placement.py's rule: token i = 64·ids[i // 64] + i % 64, last block ⌈last/8⌉
    ids = (46, 47, 48)
    n = scaled_length(2 * 512 + 137, 3)
    assert n == 128 + math.ceil(137 / 8)
    assert prompt_tokens(ids, n) == [64 * ids[i // 64] + i % 64 for i in range(n)]
    with pytest.raises(ValueError, match="input_length"):
        scaled_length(3 * 512 + 1, 3)
    with pytest.raises(ValueError, match="num_tokens"):
        prompt_tokens(ids, 0)


def test_load_trace_hashes_equal_block_hashes_of_the_tokens(slice_reqs):
    assert len(slice_reqs) == 400
    salt = make_salt(DEFAULT_FINGERPRINT)
    for r in slice_reqs[::37]:
        assert list(r.hashes) == block_hashes(r.tokens(), 64, salt)
        assert len(r.hashes) == r.num_tokens // 64
    assert slice_reqs[0].arrival == 0.0


def test_parse_row_names_the_field():
    good = {"timestamp": 1, "input_length": 600, "output_length": 3, "hash_ids": [1, 2]}
    assert parse_row(good).hash_ids == (1, 2)
    for field, bad in (("timestamp", -1), ("input_length", 0), ("hash_ids", [1]),
                       ("hash_ids", []), ("output_length", -2)):
        with pytest.raises(ValueError, match=field):
            parse_row({**good, field: bad})
    with pytest.raises(ValueError, match="hash_ids: missing"):
        parse_row({"timestamp": 1, "input_length": 3})


# ----------------------------------------------------------------------------- ceilings
def test_oracle_and_snapshot_ceiling_on_the_slice(slice_reqs):
    o = token_oracle(slice_reqs)
    assert 0.40 < o < 0.42  # the figure test_placement.py pins
    c = snapshot_rule_ceiling(slice_reqs)
    assert 0 < c < o
    assert snapshot_rule_ceiling(slice_reqs, interval=1) == pytest.approx(o)
    c4, c16 = snapshot_rule_ceiling(slice_reqs, 4), snapshot_rule_ceiling(slice_reqs, 16)
    assert c <= c16 <= c4 <= o
    nb, ns = working_set(slice_reqs)
    assert nb > ns > 0


def test_generators_are_deterministic_and_of_the_trace_kind(tmp_path):
    for gen in (conversation_trace, agent_trace):
        a, b = gen(300, seed=3), gen(300, seed=3)
        assert a == b and a != gen(300, seed=4)
        p = write_trace(a, tmp_path / f"{gen.__name__}.jsonl")
        reqs = load_trace(p)
        assert len(reqs) == 300
        assert all(x.arrival <= y.arrival for x, y in zip(reqs, reqs[1:]))
        # prefixes are shared: the oracle finds reuse, the snapshot rule keeps most of it
        o = token_oracle(reqs)
        assert o > 0.3 and snapshot_rule_ceiling(reqs) > 0.8 * o


# ----------------------------------------------------------------------------- replay
def test_replay_is_deterministic_and_consistent(slice_reqs):
    facts = trace_facts(slice_reqs)
    a = replay(slice_reqs, "cache_aware", SMALL, facts)
    b = replay(slice_reqs, "cache_aware", SMALL, facts)
    assert a == b
    assert a.hit_rate == pytest.approx(sum(a.hits) / facts.total_tokens)
    assert 0 < a.hit_rate < a.oracle_hit_rate
    assert a.store_hit_rate == 0 and a.local_hit_rate == a.hit_rate
    assert a.agreement >= 0.98
    assert len(a.load) == 4 and a.load_max_over_mean >= 1.0
    assert 0 < a.ttft_p50_s <= a.ttft_p99_s
    assert sum(a.load) == facts.total_tokens - a.actual  # computed = prompt − reused


def test_default_policy_beats_cache_aware_on_the_slice(slice_reqs):
    assert DEFAULT_POLICY in POLICIES
    facts = trace_facts(slice_reqs)
    cfg = SimConfig(prefill_workers=8, decode_workers=2, cache_fraction=1 / 8)
    d = replay(slice_reqs, DEFAULT_POLICY, cfg, facts)
    ca = replay(slice_reqs, "cache_aware", cfg, facts)
    assert d.hit_rate > ca.hit_rate
    assert d.load_max_over_mean <= max(1.15, ca.load_max_over_mean)


def test_store_tier_adds_hits_and_the_router_predicts_them(slice_reqs):
    facts = trace_facts(slice_reqs)
    base = replay(slice_reqs, "cache_aware", SMALL, facts)
    cfg = SimConfig(prefill_workers=4, decode_workers=2, cache_fraction=1 / 4,
                    store_fraction=1.0, store_snapshot_interval=0)
    s = replay(slice_reqs, "cache_aware", cfg, facts)
    assert s.store_hit_rate > 0
    assert s.hit_rate > base.hit_rate
    assert s.hit_rate == pytest.approx(s.local_hit_rate + s.store_hit_rate)
    assert s.agreement >= 0.95  # the index is fed the store's events
    assert s.store_stats["used_blocks"] <= s.store_stats["capacity_blocks"]
    # a store-only snapshot interval only adds usable boundaries
    k = replay(slice_reqs, "cache_aware", SimConfig(
        prefill_workers=4, decode_workers=2, cache_fraction=1 / 4, store_fraction=4.0,
        store_snapshot_interval=4), facts)
    assert k.store_interval == 4 and k.hit_rate >= s.hit_rate


def test_store_lru_and_interval_from_bytes():
    st = SimStore(capacity_blocks=5, snapshot_blocks=2)
    st.put(["a", "b", "c"], ["c"])  # 3 + 2 = 5
    assert st.blocks == {"a", "b", "c"} and st.snaps == {"c"}
    st.put(["a"])  # refresh a: b is now the oldest
    st.put(["d"])
    assert "b" not in st.blocks and "a" in st.blocks
    # blocks from the store or the worker's own cache, the snapshot from the store
    assert st.usable_depth(["a", "x", "c"], 3, lambda h: h == "x") == 3
    assert st.usable_depth(["a", "x", "c"], 3, lambda h: False) == 0  # x held by nobody
    assert st.usable_depth(["a", "x", "c"], 2, lambda h: h == "x") == 0  # no snapshot ≤ 2
    st.put([], ["a"])
    assert st.usable_depth(["a", "b"], 2, lambda h: False) == 1
    with pytest.raises(ValueError, match="capacity_blocks"):
        SimStore(0, 1)
    reqs = load_trace(SLICE)
    facts = trace_facts(reqs)
    cal = Calibration()
    assert snapshot_blocks(cal) == pytest.approx(420_864 / 320 / 512)
    big = SimConfig(store_fraction=8.0)
    small = SimConfig(store_fraction=1.0)
    k3 = SimConfig(store_fraction=1.0, calibration=Calibration(
        model="k3", snapshot_bytes=16_000 * 27_648, mla_bytes_per_token=27_648))
    assert auto_store_interval(facts, SimConfig()) == 0  # no store
    assert 0 < auto_store_interval(facts, big) <= auto_store_interval(facts, small)
    assert auto_store_interval(facts, k3) == 0 or \
        auto_store_interval(facts, k3) >= auto_store_interval(facts, small)


# ----------------------------------------------------------------------------- policies
def _wv(name, cached=0, queued=0, **kw):
    return WorkerView(name, cached, cached, queued, 1000.0, **kw)


def test_approx_radix_follows_the_sglang_rules():
    req = PlacementRequest(1000, 100, seq=0)
    # match 4/10 > 0.3 → highest approximate match, whatever the load
    ws = [_wv("a", approx_blocks=1, running=0), _wv("b", approx_blocks=4, running=10)]
    assert place(req, ws, policy="approx_radix").prefill == "b"
    # imbalanced (100 − 0 > 64 and 100 > 1.5 × 0) → least loaded
    ws = [_wv("a", approx_blocks=1, running=0), _wv("b", approx_blocks=4, running=100)]
    assert place(req, ws, policy="approx_radix").prefill == "a"
    # match 2/10 ≤ 0.3 → smallest tree
    ws = [_wv("a", approx_blocks=2, tree_blocks=50), _wv("b", tree_blocks=10)]
    assert place(req, ws, policy="approx_radix").prefill == "b"


def test_prefix_home_keeps_a_holder_with_a_queue_and_spills_when_overloaded():
    req = PlacementRequest(1000, 100, seq=0)
    p = HomeParams()
    # a holds 9 blocks, queued 0.6 s; b idle: cache_aware's guard drops a, prefix_home keeps it
    ws = [_wv("a", 9, queued=600), _wv("b")]
    assert place(req, ws, policy="cache_aware").prefill == "b"
    assert place(req, ws, policy="prefix_home", params=p).prefill == "a"
    # truly overloaded (queue ≥ overload_seconds): the holder is dropped
    ws = [_wv("a", 9, queued=int(1000 * (p.overload_seconds + 1))), _wv("b")]
    assert place(req, ws, policy="prefix_home", params=p).prefill == "b"
    # the holder carries far more than its share of recent work: spills to the partial holder
    ws = [_wv("a", 9, util=0.9), _wv("b", 5, util=0.01), _wv("c", 0, util=0.01)]
    assert place(req, ws, policy="prefix_home", params=p).prefill == "b"
    # plain states (the live router's) work too
    from router.placement import PrefillWorkerState

    plain = [PrefillWorkerState("a", 3, 3, 0, 1000.0), PrefillWorkerState("b", 0, 0, 0, 1000.0)]
    assert place(req, plain, policy="prefix_home").prefill == "a"
    # ... with the live router's store depth (``store_blocks`` beside the own cache): a store
    # hit beats a miss, a local hit beats the same depth from the store
    st = [PrefillWorkerState("miss", 0, 0, 0, 1000.0),
          PrefillWorkerState("store", 0, 0, 0, 1000.0, store_blocks=9)]
    assert place(req, st, policy="prefix_home").prefill == "store"
    st.append(PrefillWorkerState("local", 9, 9, 0, 1000.0, store_blocks=9))
    assert place(req, st, policy="prefix_home").prefill == "local"


def test_router_view_matches_and_evicts():
    v = RouterView(3, capacity_blocks=4)
    v.record(0, ["a", "b", "c"])
    v.record(1, ["a", "x"])
    assert v.match(["a", "b", "c", "d"]) == [3, 1, 0]
    v.record(0, ["y", "z"])  # 5 > 4 blocks: "a" (oldest) goes
    assert v.match(["a", "b"]) == [0, 1, 0] and v.tree_size(0) == 4


# ----------------------------------------------------------------------------- CLI, runner
def test_cli_writes_the_json_schema_and_plot(tmp_path, capsys):
    from simulate.cli import main

    out, png = tmp_path / "sim.json", tmp_path / "sim.png"
    rc = main(["--trace", str(SLICE), "--workers", "4:2", "--cache-fraction",
               "0.25", "--policy", DEFAULT_POLICY, "cache_aware", "--json", str(out),
               "--plot", str(png), "--no-progress", "--jobs", "1"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "TTFT p50" in text and DEFAULT_POLICY + " *" in text
    doc = json.loads(out.read_text())
    pols = doc["policies"]
    assert [p["policy"] for p in pols] == [DEFAULT_POLICY, "cache_aware"]
    assert [p["default"] for p in pols] == [True, False]
    for p in pols:
        for k in ("hit_rate", "oracle_hit_rate", "ttft_p50_s", "ttft_p99_s",
                  "load_max_over_mean", "agreement", "snapshot_ceiling"):
            assert isinstance(p[k], float), k
        assert 0 < p["hit_rate"] < p["oracle_hit_rate"] < 1
    assert doc["setup"]["prefill_workers"] == 4 and doc["setup"]["decode_workers"] == 2
    assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"
    assert main(["--trace", str(SLICE), "--policy", "nope", "--no-progress"]) == 2


def test_a_row_larger_than_a_worker_cache_is_one_line_naming_cache_fraction(capsys):
    """The shipped CI slice's longest rows need more pages than 1/16 of the working set (the
    default ``--cache-fraction``) gives one of 32 prefill workers."""
    from simulate.cli import main

    ci_slice = Path(__file__).parents[2] / "traces" / "mooncake_ci_slice_3940_3963.jsonl"
    assert main(["--trace", str(ci_slice), "--no-progress", "--jobs", "1",
                 "--policy", "round_robin"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("k3serve simulate: error: --cache-fraction: a trace row does not "
                             "fit one prefill worker's cache (need "), err
    assert err[0].endswith("raise --cache-fraction (0.0625 now), or scale the trace down "
                           "(--length-scale)"), err


def test_k3serve_simulate_is_the_simulator_cli():
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "cli", "simulate", "--help"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "usage: k3serve simulate" in r.stdout and "--store-fraction" in r.stdout


def test_runner_parallel_equals_inline(slice_reqs):
    a = run(slice_reqs[:200], ["round_robin", "cache_aware"], SMALL, jobs=2, progress=False)
    b = run(slice_reqs[:200], ["round_robin", "cache_aware"], SMALL, jobs=1, progress=False)
    assert a == b


def test_calibration_file_schema(tmp_path):
    cal = load_calibration()
    assert cal.prefill_tokens_per_s == 8000.0 and cal.model == "k3-tiny"
    assert 1300 < cal.snapshot_equiv_tokens < 1330
    assert cal.prefill_seconds(8000) == pytest.approx(1.0)
    assert cal.prefill_seconds(0, 6400) > 0  # a store load costs something
    assert cal.store_seconds(6400) < 6400 / cal.prefill_tokens_per_s  # below recompute
    p = tmp_path / "c.json"
    p.write_text(json.dumps({**cal.to_json(), "prefill_tokens_per_s": 0}))
    with pytest.raises(ValueError, match="prefill_tokens_per_s"):
        load_calibration(p)
    p.write_text(json.dumps({**cal.to_json(), "schema": "x"}))
    with pytest.raises(ValueError, match="schema"):
        load_calibration(p)
    p.write_text(json.dumps({**cal.to_json(), "speed": 1}))
    with pytest.raises(ValueError, match="speed"):
        load_calibration(p)
    assert cal.to_json()["schema"] == SCHEMA


def test_scale_rows_rejects_empty():
    with pytest.raises(ValueError, match="rows"):
        scale_rows([])


def test_generators_add_follow_ups_that_extend_a_prompt_right_after_it():
    for gen in (conversation_trace, agent_trace):
        assert gen(200, seed=1) == gen(200, seed=1, followup_prob=0.0)
        rows = gen(400, seed=1, followup_prob=0.3)
        assert rows == gen(400, seed=1, followup_prob=0.3)
        # a follow-up: the same blocks (or one more), a few tokens longer, < 0.5 s later
        ext = 0
        for r in rows:
            for q in rows:
                dt = q["timestamp"] - r["timestamp"]
                dn = q["input_length"] - r["input_length"]
                if 0 <= dt <= 500 and 1 <= dn <= 16 and \
                        q["hash_ids"][:len(r["hash_ids"])] == r["hash_ids"]:
                    ext += 1
                    break
        assert ext >= 0.15 * len(rows)
