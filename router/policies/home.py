"""``prefix_home``: placement that values where a prefix lives (issue 12).

Preference. Cost of sending request *r* (prompt ``L`` tokens, at most ``⌊(L−1)/B⌋`` blocks
reusable) to prefill worker *w*, in seconds::

    cost_w = queued_w / rate_w                       # wait behind the worker's queue
           + (L − c_w·B) / rate_w                    # its own compute (c_w: usable blocks)
           + store_w                                 # store load, when the store supplies it
           + dup_weight · (c* − c_w)·B / rate_w      # pool work wasted vs the best holder

``c*`` is the best usable depth on any worker. The duplication term is what makes the policy
not myopic: a request sent away from the worker holding its prefix recomputes (and caches a
second copy of) blocks the pool already has — work every later request queues behind — and
splits that prefix's later traffic over two homes.

Bounded load (consistent hashing with bounded loads, Mirrokni et al. 2018, applied to
prefixes): each worker may carry at most ``(1 + balance_slack)`` × the pool's mean recent
load, counting this request. ``util_w`` (``WorkerView.util``) is the worker's recent busy
fraction by the router's own account (predicted uncached compute sent, decayed over a
horizon ``H`` seconds); this request adds ``x_w = compute_w / H``. A worker over the bound is
skipped, so a hot prefix spills to the next-cheapest worker — typically one holding part of
it — which becomes a second home: hot prefixes are replicated just as much as their load
needs, cold ones stay single. That is the only way a holder of the best prefix loses the
request besides a real queue (below); when no worker is within the bound, the least loaded
one takes it.

Queue guard (never remove every holder of the best prefix unless truly overloaded): a worker
whose queued work exceeds ``guard_factor × least + guard_seconds`` (the ``cache_aware``
guard) is skipped unless it holds the best prefix and its queue is below
``overload_seconds``. Ties → less queued, then a rotation by ``seq``.

On plain ``PrefillWorkerState`` objects (the live router's today: no store, no ``util``) the
bound is inactive and the policy is the cost above under the queue guard.
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
        balance_slack: ε of the bounded-load rule (a worker may carry (1 + ε) × mean).
        util_horizon_s: the horizon ``H`` the caller's ``util`` is decayed over, seconds.
        overload_seconds: a holder of the best prefix stays eligible while its queued work
            is below this many seconds.
    """

    dup_weight: float = 3.0
    balance_slack: float = 0.05
    util_horizon_s: float = 10.0
    overload_seconds: float = 2.0
    balance_weight: float = 10.0
    ext_weight: float = 1.0
    queue_weight: float = 1.0


_DEFAULT = HomeParams()


def prefix_home(req: PlacementRequest, workers: Sequence[PrefillWorkerState],
                params: PlacementParams) -> int:
    """Least ``cost_w`` over the workers within the load bound and the queue guard."""
    hp = params if isinstance(params, HomeParams) else _DEFAULT
    n = len(workers)
    B, L, cap = req.block_size, req.num_prompt_tokens, req.max_cached_blocks
    depth = [min(w.cached_blocks, cap) for w in workers]
    best = max(depth)
    queued = [w.queued_tokens / w.prefill_rate for w in workers]
    least = min(queued)
    qbound = params.guard_factor * least + params.guard_seconds
    util = [getattr(w, "util", None) for w in workers]
    bounded = all(u is not None for u in util)
    total_util = sum(util) if bounded else 0.0  # type: ignore[arg-type]
    H = hp.util_horizon_s
    best_i, best_key = -1, None
    for i, w in enumerate(workers):
        q = queued[i]
        c = depth[i]
        if q > qbound and not (best > 0 and c == best and q < hp.overload_seconds):
            continue
        compute = (L - c * B) / w.prefill_rate
        cost = (1 + hp.queue_weight) * q + compute + hp.dup_weight * (best - c) * B / w.prefill_rate
        cost += hp.ext_weight * getattr(w, "request_rate", 0.0) * compute * compute / 2
        if bounded:
            x = compute / H
            excess = util[i] + x - (1 + hp.balance_slack) * (total_util + x) / n  # type: ignore
            if excess > 0:
                if not hp.balance_weight:
                    continue
                cost += hp.balance_weight * excess * H
        loc = min(local_depth(w), cap)
        sr = getattr(w, "store_tokens_per_s", 0.0)
        if c > loc and sr > 0:
            cost += (c - loc) * B / sr
        key = (cost, q, (i - req.seq) % n)
        if best_key is None or key < best_key:
            best_i, best_key = i, key
    if best_i < 0:  # nobody within the bounds: the least loaded
        key_of = (lambda i: (util[i], queued[i], (i - req.seq) % n)) if bounded else \
            (lambda i: (queued[i], (i - req.seq) % n))
        best_i = min(range(n), key=key_of)
    return best_i
