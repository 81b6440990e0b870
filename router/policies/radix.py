"""``approx_radix``: the cache-aware policy of SGLang's router, from its public description.

SGLang's router (sgl-router / SMG, ``--policy cache_aware``) keeps an approximate radix tree
per worker of the prompts it routed there (not the workers' real caches) and decides:

1. If the load is imbalanced — ``max_load − min_load > balance_abs_threshold`` and
   ``max_load > balance_rel_threshold × min_load``, load = requests in flight — route to the
   least-loaded worker (shortest queue).
2. Otherwise, if the best prefix match rate (matched / prompt length) exceeds
   ``cache_threshold``, route to the worker with the highest match.
3. Otherwise route to the worker with the smallest tree (most room to cache).

Defaults as published: ``cache_threshold = 0.3``, ``balance_abs_threshold = 64``,
``balance_rel_threshold = 1.5``. Ties → ``router.placement.tie_breaks`` (rendezvous hashing of
the request's key with the worker id; no key: a rotation by ``seq``). Reads :class:`router.policies.
WorkerView`'s ``approx_blocks``, ``tree_blocks`` and ``running``; where they are unknown (plain
states, −1: the live router keeps no approximate tree) it falls back to ``mla_blocks`` (the
exact index) and queued tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

from router.placement import PlacementParams, PlacementRequest, PrefillWorkerState, tie_breaks

CACHE_THRESHOLD = 0.3
BALANCE_ABS_THRESHOLD = 64
BALANCE_REL_THRESHOLD = 1.5


def approx_radix(req: PlacementRequest, workers: Sequence[PrefillWorkerState],
                 params: PlacementParams) -> int:
    """SGLang-router-style choice over approximate trees (module docstring)."""
    n = len(workers)
    rot = tie_breaks(req, [w.worker_id for w in workers])
    load = [getattr(w, "running", -1) for w in workers]
    if any(x < 0 for x in load):
        load = [w.queued_tokens for w in workers]
    lo, hi = min(load), max(load)
    if hi - lo > BALANCE_ABS_THRESHOLD and hi > BALANCE_REL_THRESHOLD * lo:
        return min(range(n), key=lambda i: (load[i], rot[i]))
    match = [a if (a := getattr(w, "approx_blocks", -1)) >= 0 else w.mla_blocks
             for w in workers]
    best = max(match)
    if best * req.block_size > CACHE_THRESHOLD * req.num_prompt_tokens:
        return min(range(n), key=lambda i: (-match[i], load[i], rot[i]))
    tree = [getattr(w, "tree_blocks", 0) for w in workers]
    return min(range(n), key=lambda i: (tree[i], load[i], rot[i]))
