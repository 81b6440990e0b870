"""prefix_home's decisions on the cases that recomputed a known prefix: a prompt extended
right after its long prefill, a wait priced at the worker's measured prefill rate, and the
router's record of where it just sent a prompt (``router.recent.RecentPlacements``)."""

from __future__ import annotations

import math

import pytest

from k3serve.cache.hashing import block_hashes
from router.index import PrefixMatch
from router.placement import PlacementRequest, PrefillWorkerState
from router.policies.table import place
from router.policies import WorkerView, live_view
from router.policies.home import HomeParams
from router.policies.load import RecentLoad
from router.recent import RecentPlacements

B = 64
H = HomeParams().util_horizon_s
MEASURED = 600.0  # tokens/s the worker measures (a CPU box)
STATIC = 10_000.0  # the router's --prefill-rate guess


def _req(tokens: int, seq: int = 1) -> PlacementRequest:
    return PlacementRequest(tokens, B, seq=seq, key="k")


def test_p_plus_one_goes_to_p_worker_right_after_p_long_prefill():
    """P (3,073 tokens) just computed on w0 at 600 tokens/s (5 s of a 10 s load horizon);
    P + 1 token arrives: w0 is idle and holds 48 blocks, so it stays there."""
    p_tokens = 3073
    util = p_tokens / (MEASURED * H)
    req = _req(p_tokens + 1)
    views = [WorkerView("w0", 48, 48, 0, STATIC, measured_rate=MEASURED, util=util,
                        request_rate=0.1, chain_tokens=p_tokens),
             WorkerView("w1", 0, 0, 0, STATIC, measured_rate=MEASURED)]
    p = place(req, views, policy="prefix_home", params=HomeParams())
    assert p.prefill == "w0" and p.predicted_cached_tokens == 48 * B >= 3008
    # the same load without the record of P (its work counted as w0's load) sent P+1 away:
    # the bound, not the wait, decided
    blind = [views[0].__class__(**{**views[0].__dict__, "chain_tokens": 0.0}), views[1]]
    assert place(req, blind, policy="prefix_home", params=HomeParams()).prefill == "w1"


@pytest.mark.parametrize("view", [False, True], ids=["plain", "view"])
def test_moves_away_only_when_the_wait_exceeds_recompute_at_the_measured_rate(view):
    """w0 holds 40 of a 2,600-token prompt's blocks (2,560 tokens: 4.27 s to recompute at
    600 tokens/s); w1 holds nothing and is idle."""
    req = _req(2600)
    recompute_s = 40 * B / MEASURED

    def choose(queued: int, measured: float = MEASURED) -> str:
        cls = WorkerView if view else PrefillWorkerState
        ws = [cls("w0", 40, 40, queued, STATIC, measured_rate=measured),
              cls("w1", 0, 0, 0, STATIC, measured_rate=measured)]
        return place(req, ws, policy="prefix_home", params=HomeParams()).prefill

    below = int(0.8 * recompute_s * MEASURED)  # 3.4 s of wait: below recompute
    above = int(1.25 * recompute_s * MEASURED)  # 5.3 s: above
    assert choose(0) == "w0"
    assert choose(below) == "w0"
    assert choose(above) == "w1"
    # without a measurement the static guess (10,000 tokens/s) prices that queue at 0.32 s
    assert choose(above, measured=0.0) == "w0"
    assert PrefillWorkerState("w", measured_rate=0.0, prefill_rate=STATIC).rate == STATIC
    assert PrefillWorkerState("w", measured_rate=MEASURED).rate == MEASURED


def _hashes(n_tokens: int, salt: str = "s") -> list[str]:
    return block_hashes(list(range(n_tokens)), B, salt)


def test_recently_placed_prompt_counts_as_a_hit_there():
    """P sent to w1 a moment ago, its cache events not in yet: the index knows nothing, the
    record says w1 will hold P's 48 blocks (snapshot at the prompt end)."""
    p_tokens = 3073
    hashes = _hashes(p_tokens + 1)
    rec = RecentPlacements(ttl_s=30.0)
    rec.record("w1", hashes[:48], [(p_tokens - 1) // B], p_tokens, now=100.0)
    req = _req(p_tokens + 1)
    pending = rec.match(hashes, req.max_cached_blocks, now=100.5)
    assert pending == {"w1": PrefixMatch(48, 48)}
    chain = rec.extended(hashes, now=100.5, horizon_s=H)
    assert chain["w1"] == pytest.approx(p_tokens * math.exp(-0.5 / H))
    views = []
    for w in ("w0", "w1"):
        load = RecentLoad(H, clock=lambda: 100.5)
        if w == "w1":
            load.add(p_tokens, now=100.0)
        views.append(live_view(w, None, None, 0, STATIC, load, 100.5, pending=pending.get(w),
                               measured_rate=MEASURED, chain_tokens=chain.get(w, 0.0)))
    p = place(req, views, policy="prefix_home", params=HomeParams())
    assert p.prefill == "w1" and p.predicted_cached_tokens == 48 * B


def test_recent_placements_match_expire_and_forget():
    h = _hashes(640)  # 10 blocks
    rec = RecentPlacements(ttl_s=5.0)
    rec.record("a", h[:6], [3, 6], 384, now=0.0)
    rec.record("b", h[:4], [4, 99], 256, now=1.0)  # 99: outside the chain, ignored
    m = rec.match(h, 9)
    assert m == {"a": PrefixMatch(6, 6), "b": PrefixMatch(4, 4)}
    assert rec.match(h, 5)["a"] == PrefixMatch(6, 3)  # usable capped at max_blocks
    other = _hashes(640, "t")
    assert rec.match(other, 9) == {} and rec.extended(other, 1.0, H) == {}
    assert set(rec.extended(h[:5], 1.0, H)) == {"b"}  # a's chain (6 blocks) is not a prefix
    assert set(rec.extended(h, 1.0, H)) == {"a", "b"}  # each the last sent to its worker
    rec.record("b", _hashes(640, "u")[:2], [2], 128, now=1.5)
    assert set(rec.extended(h, 1.5, H)) == {"a"}  # b worked on something else since
    assert len(rec) == 3
    rec.expire(5.5)  # a sent at 0.0 is past its 5 s
    assert set(rec.match(h, 9)) == {"b"} and len(rec) == 2
    rec.forget("b")
    assert rec.match(h, 9) == {} and len(rec) == 0
    with pytest.raises(ValueError, match="ttl_s"):
        RecentPlacements(ttl_s=0)


def test_interval_snapshots_past_the_hit():
    req = _req(40 * B + 5)
    ws = [PrefillWorkerState("w0", cached_blocks=17, mla_blocks=17)]
    p = place(req, ws, policy="prefix_home", params=HomeParams(snapshot_interval_blocks=8))
    assert p.snapshot_at == (24 * B, 32 * B)  # 40 = the prompt end, snapshotted anyway
    p0 = place(req, ws, policy="prefix_home", params=HomeParams(snapshot_interval_blocks=0))
    assert p0.snapshot_at == ()


def test_simulated_follow_ups_hit_their_prompt_while_it_is_still_computing():
    """Eight prompts of 40 trace blocks, each followed 0.1 s later (before its prefill of
    0.32 s has finished, so before any cache event) by itself plus 5 trace tokens: every
    follow-up goes where its prompt went and reuses all of it."""
    from simulate import SimConfig, replay
    from simulate.traces import TRACE_BLOCK, parse_row, scale_rows

    rows = []
    for k in range(8):
        ids = list(range(100 * k, 100 * k + 40))
        for dt, extra in ((0, 0), (100, 5)):
            rows.append({"timestamp": 1000 * k + dt, "input_length": 39 * TRACE_BLOCK + 100
                         + extra, "output_length": 4, "hash_ids": ids})
    reqs = scale_rows([parse_row(r) for r in rows])
    cfg = SimConfig(prefill_workers=4, decode_workers=1, cache_fraction=1.0, load=None,
                    params=HomeParams())
    res = replay(reqs, "prefix_home", cfg)
    for first, follow in zip(reqs[::2], range(1, len(reqs), 2), strict=True):
        assert res.hits[follow] == first.max_cached_blocks * B == 39 * B
    blind = replay(reqs, "prefix_home", SimConfig(**{**cfg.__dict__, "recent_ttl_s": 1e-9}))
    assert sum(blind.hits[1::2]) < sum(res.hits[1::2])  # without the record: misses
