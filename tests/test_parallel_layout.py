"""Per-rank cache specs, memory plan and the TP pairing rule (k3serve/parallel/layout.py)."""

from __future__ import annotations

import pytest

from k3serve.cache.specs import CacheDtypes
from k3serve.config import PRESETS
from k3serve.parallel.layout import (
    ParallelMismatch,
    check_pair,
    instance_cache_bytes,
    rank_cache_spec,
)

TINY = PRESETS["k3-tiny"]
D = CacheDtypes.for_config(TINY, "float32")


def test_kda_split_latent_replicated_and_matches_pools() -> None:
    from k3serve.cache.pools import KVPools
    from k3serve.parallel.tp import local_config

    one = rank_cache_spec(TINY, 1, 0, 16, D)
    for r in range(2):
        s = rank_cache_spec(TINY, 2, r, 16, D)
        assert s.kda.slot_size_bytes * 2 == one.kda.slot_size_bytes
        assert s.mla.page_size_bytes == one.mla.page_size_bytes
        assert s.head_range == (2 * r, 2 * r + 2)
    pools = KVPools(local_config(TINY, 2), num_slots=3, num_pages=5, block_size=16)
    plan = instance_cache_bytes(TINY, 2, 3, 5, 16, D)
    nb = pools.nbytes()
    assert plan["kda_per_rank"] == nb["kda_state"] + nb["conv_state"]
    assert plan["mla_per_rank"] == nb["mla_latent"]
    assert plan["instance"] == 2 * plan["per_rank"]


def test_k3_per_rank_state() -> None:
    k3 = PRESETS["k3"]
    s = rank_cache_spec(k3, 8, 7, 64)
    assert s.kda.num_heads == k3.kda_num_heads // 8 and s.head_range[1] == k3.kda_num_heads


def test_pairing_refuses_mismatched_tp() -> None:
    assert check_pair(2, 2) == [(0, 0), (1, 1)]
    with pytest.raises(ParallelMismatch, match=r"tp: this instance has tp=2, the peer has tp=1"):
        check_pair(2, 1)
    with pytest.raises(ValueError, match="tp"):
        rank_cache_spec(TINY, 3, 0, 16)
    with pytest.raises(ValueError, match="rank"):
        rank_cache_spec(TINY, 2, 2, 16)
