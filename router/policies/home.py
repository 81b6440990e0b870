"""``prefix_home``: placement that values where a prefix lives.

Cost of sending request *r* (prompt ``L`` tokens, at most ``⌊(L−1)/B⌋`` blocks reusable) to
prefill worker *w*, in seconds (``rate``: the worker's measured prefill tokens/s, else the
static one: ``PrefillWorkerState.rate``)::

    compute_w = (L − c_w·B) / rate                   # its own compute (c_w: usable blocks)
    cost_w = (1 + queue_weight) · queued_w / rate    # wait, and the wait it adds behind it
           + compute_w
           + store_w                                 # store load, when the store supplies it
           + dup_weight · (c* − c_w)·B / rate        # pool work wasted vs the best holder
           + ext_weight · λ_w · compute_w² / 2       # delay this compute imposes on arrivals
           + balance_weight · H · max(0, excess_w)   # bounded load (below)

``c*`` is the best usable depth on any worker. The duplication term is what makes the policy
not myopic: a request sent away from the worker holding its prefix recomputes (and caches a
second copy of) blocks the pool already has — work every later request queues behind — and
splits that prefix's later traffic over two homes. The externality term is the M/G/1 view
of the same thing for the chosen worker: requests arrive there at ``λ_w``
(``WorkerView.request_rate``), and ``λ·s²/2`` of them-seconds wait behind a job of ``s``
seconds, so long cold prompts keep away from busy homes.

Bounded load (consistent hashing with bounded loads, Mirrokni, Thorup & Zadimoghaddam 2018,
applied to prefixes, as a soft bound): ``util_w`` (``WorkerView.util``) is the worker's
recent busy fraction by the router's own account (predicted uncached compute sent, decayed
over ``H = util_horizon_s``); with this request's ``x_w = compute_w / H``,
``excess_w = util_w + x_w − max((1 + balance_slack) · (Σ util + x_w) / n, balance_floor)``. A worker past its
share pays for the excess, so a hot prefix spills to the next-cheapest worker — typically one
holding part of it — which becomes a second home: hot prefixes get replicated just as much as
their load needs, cold ones stay single. Requests whose move would waste the most (deep hits,
small compute) stay; cold-ish ones move first.

The own chain is not load: ``util_w`` is what w computed recently, and part of it may be the
very prompt this request extends (P just computed or still computing, then P + a few tokens;
an agent's last step). Where the last prompt sent to w is the one this request extends
(``WorkerView.chain_tokens``, from the router's record of where it sent each prompt,
:class:`router.recent.RecentPlacements`) and w holds the prefix deeper in its own cache than
any other worker can reach (own cache or store), the bound reads
``util_w − chain_tokens_w / (rate · H)``: that work built the prefix this request reuses,
and whatever of it is still queued is in the wait term already. A worker that took other work
since, or a prefix others can also reach, keeps the full account, so hot homes still spill.

Queue guard (never remove every holder of the best prefix unless truly overloaded): a worker
whose queued work exceeds ``guard_factor × least + guard_seconds`` (the ``cache_aware``
guard) is skipped unless it holds the best prefix and its wait is below the larger of
``overload_seconds`` and the time to recompute that prefix at its rate (``c*·B / rate``): a
request leaves the holder of its prefix on the guard only when waiting there takes longer
than computing the prefix again elsewhere. Ties → less queued, then ``router.placement.tie_breaks`` (rendezvous
hashing of the prompt's content address with the worker id, so router replicas with the
same view agree; without a key, a rotation by ``seq``).

The live router feeds it the same figures as the simulator: ``util`` and ``request_rate``
come from one :class:`router.policies.load.RecentLoad` per worker in ``router.workers.Worker``
(the simulator uses the same class), the store's depth from the index's ``store`` holder
(a plain state's ``store_blocks``; :func:`router.policies.depths`), prompts sent and not yet
reported by the worker's events from :class:`router.recent.RecentPlacements` (counted as held:
:func:`router.policies.live_view`'s ``pending``), and ``measured_rate`` from the worker's
reports. On plain
``PrefillWorkerState`` objects without ``util`` the bound and the externality are inactive:
the policy is the cost above under the queue guard.

Knobs: :class:`HomeParams`, chosen with benchmarks/simulate_grid.py over the three traces
(Mooncake, conversation, agent), with and without the store, at the simulator's defaults. The
median TTFT is set by the last partial block of deep hits (≈ 7 ms at 8,000 tokens/s) plus the
waits of the ~2 % of short requests that land behind a long cold prefill on their home; a
lighter queue weight (0.5) and duplication weight (1.0) than the first cut (1.0, 3.0) keep
hit / oracle and the balance and make ``prefix_home``'s p50 the lowest on all six runs
(docs/results/simulate.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from router.placement import PlacementParams, PlacementRequest, PrefillWorkerState, tie_breaks
from router.policies import depths
from router.policies.load import UTIL_HORIZON_S


@dataclass(frozen=True)
class HomeParams(PlacementParams):
    """Knobs of ``prefix_home`` (a ``PlacementParams``; other policies ignore the extras).

    Attributes:
        dup_weight: seconds of cost per second of pool work a placement duplicates.
        balance_slack: ε of the bounded-load rule (a worker may carry (1 + ε) × mean).
        util_horizon_s: the horizon ``H`` the caller's ``util`` is decayed over, seconds.
        overload_seconds: a holder of the best prefix stays eligible while its queued work
            is below this many seconds.
        balance_weight: seconds of cost per second of work past the load bound (0: a hard
            bound: workers past it are skipped).
        ext_weight: weight of the externality ``λ_w · compute_w² / 2``.
        queue_weight: extra weight of the worker's queue (the wait this request adds behind
            it for the requests that follow).
        balance_floor: a busy fraction below which no worker is past the load bound (the
            bound is ``max((1 + ε) · mean, balance_floor)``): on a nearly idle pool relative
            imbalance costs nothing, so a prompt goes to the worker holding its prefix — the
            continuous form of the ``⌈(1 + ε) · m / n⌉`` capacity of bounded-load hashing, which
            never falls below one.
        snapshot_interval_blocks: ``PlacementParams.snapshot_interval_blocks``, on here: the
            first prompt to diverge inside a computed span reuses up to the last multiple of 16
            blocks, where prompt-end and branch-point snapshots alone would give it nothing
            (on the Mooncake trace the snapshot rule without it stops below 0.90 of the token
            oracle, ``simulate.traces.snapshot_rule_ceiling``).
    """

    dup_weight: float = 1.0
    balance_slack: float = 0.10
    util_horizon_s: float = UTIL_HORIZON_S
    overload_seconds: float = 2.0
    balance_weight: float = 20.0
    ext_weight: float = 1.0
    queue_weight: float = 0.5
    balance_floor: float = 0.01
    snapshot_interval_blocks: int = 16


_DEFAULT = HomeParams()


def prefix_home(req: PlacementRequest, workers: Sequence[PrefillWorkerState],
                params: PlacementParams) -> int:
    """Least ``cost_w`` over the workers within the load bound and the queue guard."""
    hp = params if isinstance(params, HomeParams) else _DEFAULT
    n = len(workers)
    B, L, cap = req.block_size, req.num_prompt_tokens, req.max_cached_blocks
    dl = [depths(w, cap) for w in workers]
    depth = [e for e, _ in dl]
    best = max(depth)
    rate = [w.rate for w in workers]
    queued = [w.queued_tokens / r for w, r in zip(workers, rate, strict=True)]
    least = min(queued)
    qbound = params.guard_factor * least + params.guard_seconds
    util = [getattr(w, "util", None) for w in workers]
    bounded = all(u is not None for u in util)
    H = hp.util_horizon_s
    total_util = sum(util) if bounded else 0.0  # type: ignore[arg-type]
    own = util
    if bounded:  # the own chain's past work is not load where only this worker holds it
        first, second = (sorted(depth, reverse=True) + [0])[:2]
        own = [max(0.0, util[i] - getattr(w, "chain_tokens", 0.0) / (rate[i] * H))  # type: ignore
               if dl[i][1] > (second if depth[i] == first else first)
               else util[i] for i, w in enumerate(workers)]
    tie = tie_breaks(req, [w.worker_id for w in workers])
    best_i, best_key = -1, None
    for i, w in enumerate(workers):
        q, c, r = queued[i], depth[i], rate[i]
        if q > qbound and not (best > 0 and c == best
                               and q < max(hp.overload_seconds, c * B / r)):
            continue
        compute = (L - c * B) / r
        cost = (1 + hp.queue_weight) * q + compute + hp.dup_weight * (best - c) * B / r
        cost += hp.ext_weight * getattr(w, "request_rate", 0.0) * compute * compute / 2
        if bounded:
            x = compute / H
            bound = max((1 + hp.balance_slack) * (total_util + x) / n, hp.balance_floor)
            excess = own[i] + x - bound  # type: ignore[operator]
            if excess > 0:
                if not hp.balance_weight:
                    continue
                cost += hp.balance_weight * excess * H
        loc = dl[i][1]
        if c > loc:  # the store supplies (c − loc) blocks: their load time
            sr = getattr(w, "store_tokens_per_s", 0.0)
            cost += (c - loc) * B * (1 / sr if sr > 0 else params.store_token_cost / r)
        key = (cost, q, tie[i])
        if best_key is None or key < best_key:
            best_i, best_key = i, key
    if best_i < 0:  # nobody within the bounds: the least loaded
        key_of = (lambda i: (own[i], queued[i], tie[i])) if bounded else \
            (lambda i: (queued[i], tie[i]))
        best_i = min(range(n), key=key_of)
    return best_i
