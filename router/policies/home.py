"""``prefix_home``: placement that values where a prefix lives (issue 12).

Cost of sending request *r* (prompt ``L`` tokens, at most ``⌊(L−1)/B⌋`` blocks reusable) to
prefill worker *w*, in seconds::

    cost_w = queued_w / rate_w                       # wait behind the worker's queue
           + (L − c_w·B) / rate_w                    # its own compute (c_w: usable blocks)
           + store_w                                 # store load, when the store supplies it
           + dup_weight · (c* − c_w)·B / rate_w      # pool work wasted vs the best holder
           + util_weight · util_w · (L − c_w·B) / rate_w   # congestion of a busy worker

``c*`` is the best usable depth on any worker. The duplication term is what makes the policy
not myopic: a request sent away from the worker holding its prefix recomputes (and caches a
second copy of) blocks the pool already has, work every later request queues behind, and
it splits that prefix's later traffic over two homes. The congestion term (``util_w``: the
worker's recent busy fraction by the router's own account) spreads hot prefixes before the
queues show it, which keeps the long-run load even.

Guard (never remove every holder of the best prefix unless truly overloaded): a worker is
eligible when its queue is within ``guard_factor × least + guard_seconds`` (the
``cache_aware`` guard), or when it holds the best prefix and its queue is below
``overload_seconds``. Ties → less queued, then a rotation by ``seq``.

Accepts plain ``PrefillWorkerState`` objects (the live router's): no store, ``util`` 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from router.placement import PlacementParams, PlacementRequest, PrefillWorkerState
from router.policies import local_depth


@dataclass(frozen=True)
class HomeParams(PlacementParams):
    """Knobs of ``prefix_home`` (a ``PlacementParams``; other policies ignore the extras).

    Attributes:
        dup_weight: seconds of cost per second of pool work a placement duplicates.
        util_weight: weight of the worker's recent utilisation on its own compute.
        overload_seconds: a holder of the best prefix stays eligible while its queued work
            is below this many seconds.
    """

    dup_weight: float = 1.0
    util_weight: float = 1.0
    overload_seconds: float = 2.0
    home_weight: float = 0.0


_DEFAULT = HomeParams()


def prefix_home(req: PlacementRequest, workers: Sequence[PrefillWorkerState],
                params: PlacementParams) -> int:
    """Least ``cost_w`` over the eligible workers (module docstring)."""
    hp = params if isinstance(params, HomeParams) else _DEFAULT
    n = len(workers)
    B, L, cap = req.block_size, req.num_prompt_tokens, req.max_cached_blocks
    depth = [min(w.cached_blocks, cap) for w in workers]
    best = max(depth)
    mla = [min(w.mla_blocks, cap) for w in workers]
    best_mla = max(mla)
    queued = [w.queued_tokens / w.prefill_rate for w in workers]
    least = min(queued)
    bound = params.guard_factor * least + params.guard_seconds
    best_i, best_key = 0, None
    for i, w in enumerate(workers):
        q = queued[i]
        if q > bound and not (best > 0 and depth[i] == best and q < hp.overload_seconds):
            continue
        c = depth[i]
        compute = (L - c * B) / w.prefill_rate
        cost = q + compute + hp.dup_weight * (best - c) * B / w.prefill_rate
        cost += hp.home_weight * (best_mla - mla[i]) * B / w.prefill_rate
        cost += hp.util_weight * getattr(w, "util", 0.0) * compute
        loc = min(local_depth(w), cap)
        sr = getattr(w, "store_tokens_per_s", 0.0)
        if c > loc and sr > 0:
            cost += (c - loc) * B / sr
        key = (cost, q, (i - req.seq) % n)
        if best_key is None or key < best_key:
            best_i, best_key = i, key
    return best_i
