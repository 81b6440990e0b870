"""Placement policies beyond router/placement.py's four, and the richer worker view they read.

``router.placement.place`` passes each policy the ``PrefillWorkerState`` objects it was given;
the policies here accept plain ones (the live router's) and read more when the caller passes
a :class:`WorkerView` (a ``PrefillWorkerState`` subclass; the simulator fills every field):
where the usable prefix lives (own cache vs the shared store), the worker's recent
utilisation, in-flight request count, and the router's approximate radix tree (SGLang kind,
:class:`RouterView`).

Policies (in the name → policy table, :mod:`router.policies.table`):

* ``prefix_home`` (:mod:`router.policies.home`): values where a prefix lives.
* ``approx_radix`` (:mod:`router.policies.radix`): SGLang-router's cache-aware policy.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from router.index import PrefixMatch
from router.placement import PrefillWorkerState
from router.policies.load import PoolLoad, RecentLoad


@dataclass(frozen=True)
class WorkerView(PrefillWorkerState):
    """A prefill worker as the richer policies see it (all extra fields optional).

    Two fillings. The simulator's: ``cached_blocks`` / ``mla_blocks`` are the *effective*
    depths (the deeper of the worker's own cache and the store) and ``local_blocks`` the own
    cache's, so every policy predicts the hit it will get. The live router's
    (``router.pipeline.Router.place``): the plain ``PrefillWorkerState`` meaning
    (``cached_blocks`` = own cache, ``store_blocks`` = the store's, ``local_blocks`` −1), plus
    ``util`` / ``request_rate`` from the router's :class:`~router.policies.load.RecentLoad`
    and ``running`` from its load account; :func:`depths` reads either.

    Attributes:
        local_blocks: usable depth in the worker's own cache, blocks (−1: unknown, take
            ``cached_blocks``).
        store_blocks: usable depth in the shared store, blocks (0: no store / no hit).
        store_tokens_per_s: latent tokens per second a store load delivers (0: unknown; a
            policy then prices a store token at ``PlacementParams.store_token_cost`` of a
            computed one).
        util: the worker's recent busy fraction by the router's account (predicted uncached
            tokens sent, decayed, over the prefill rate), in ``[0, ∞)``; 0 when unknown.
        request_rate: requests per second the router sent to the worker recently (decayed
            over the same horizon as ``util``); 0 when unknown.
        running: requests sent and not finished (−1: unknown).
        approx_blocks: depth matched in the router's approximate tree of what it routed here
            (−1: no tree; policies take ``mla_blocks``).
        tree_blocks: size of that tree, blocks.
        chain_tokens: the part of the ``util`` account that this prompt's own history put
            there: decayed uncached tokens of recent prompts sent to this worker that this
            one extends (:meth:`router.recent.RecentPlacements.extended`); placement does not
            count them as load against the worker (the work that built the prefix this
            request reuses does not delay it).
    """

    local_blocks: int = -1
    store_blocks: int = 0
    store_tokens_per_s: float = 0.0
    util: float = 0.0
    request_rate: float = 0.0
    running: int = -1
    approx_blocks: int = -1
    tree_blocks: int = 0
    chain_tokens: float = 0.0


def local_depth(w: PrefillWorkerState) -> int:
    """Usable blocks in the worker's own cache (``cached_blocks`` for a plain state)."""
    lb = getattr(w, "local_blocks", -1)
    return w.cached_blocks if lb < 0 else lb


def depths(w: PrefillWorkerState, cap: int) -> tuple[int, int]:
    """``(effective, local)`` usable depth of a prompt on ``w``, blocks, each ≤ ``cap``.

    Effective = what the worker reuses once it has loaded what the store adds; local = its
    own cache. A plain state (``local_blocks`` −1): local ``cached_blocks``, effective the
    deeper of that and ``store_blocks``; a simulator view: ``cached_blocks`` is effective.
    """
    lb = getattr(w, "local_blocks", -1)
    if lb < 0:
        loc = min(w.cached_blocks, cap)
        return max(loc, min(w.store_blocks, cap)), loc
    return min(w.cached_blocks, cap), min(lb, cap)


class RouterView:
    """The router's approximate radix tree: per worker, the block chains it routed there.

    SGLang's router keeps, per worker, a tree of the prompts it sent (not what the worker
    really caches) and evicts it LRU beyond a size; this is that, over block hashes: one
    ``hash → worker bitmask`` dict (a chain match walks it once for every worker) and one
    LRU per worker capped at ``capacity_blocks``.

    Args:
        num_workers: workers, addressed by index ``0 … num_workers − 1``.
        capacity_blocks: tree size kept per worker (blocks, ≥ 1).

    Raises:
        ValueError: ``num_workers`` < 1 or ``capacity_blocks`` < 1.
    """

    def __init__(self, num_workers: int, capacity_blocks: int):
        if num_workers < 1:
            raise ValueError(f"num_workers: must be ≥ 1, got {num_workers}")
        if capacity_blocks < 1:
            raise ValueError(f"capacity_blocks: must be ≥ 1, got {capacity_blocks}")
        self.n = num_workers
        self.capacity = capacity_blocks
        self._mask: dict[str, int] = {}
        self._lru: list[OrderedDict[str, None]] = [OrderedDict() for _ in range(num_workers)]

    def record(self, worker: int, hashes: Sequence[str], max_blocks: int | None = None) -> None:
        """Insert (or refresh) a routed prompt's chain in ``worker``'s tree, evicting LRU."""
        lru = self._lru[worker]
        bit = 1 << worker
        mask = self._mask
        for h in hashes:
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
                mask[h] = mask.get(h, 0) | bit
        while len(lru) > self.capacity:
            h, _ = lru.popitem(last=False)
            m = mask[h] & ~bit
            if m:
                mask[h] = m
            else:
                del mask[h]

    def match(self, hashes: Sequence[str]) -> list[int]:
        """Matched depth (blocks) of a chain in every worker's tree, one pass."""
        out = [0] * self.n
        mask = (1 << self.n) - 1
        get = self._mask.get
        for i, h in enumerate(hashes):
            m = mask & get(h, 0)
            gone = mask & ~m
            while gone:
                low = gone & -gone
                out[low.bit_length() - 1] = i
                gone ^= low
            mask = m
            if not mask:
                return out
        while mask:
            low = mask & -mask
            out[low.bit_length() - 1] = len(hashes)
            mask ^= low
        return out

    def tree_size(self, worker: int) -> int:
        """Blocks in ``worker``'s tree."""
        return len(self._lru[worker])


def live_view(worker_id: str, match: PrefixMatch | None, store: PrefixMatch | None,
              queued_tokens: int, prefill_rate: float, recent: RecentLoad | PoolLoad,
              now: float | None = None, *, pending: PrefixMatch | None = None,
              measured_rate: float = 0.0, chain_tokens: float = 0.0) -> WorkerView:
    """The live router's view of one prefill worker (``router.pipeline.Router.place``).

    Args:
        worker_id: the worker's URL.
        match: its entry of ``GlobalIndex.match`` (``None``: holds nothing of the prompt).
        store: the ``store`` holder's entry (``None``: no store / nothing there).
        queued_tokens: the router's queued prefill tokens on it (``Worker.queued_tokens``).
        prefill_rate: the static prefill tokens/s assumed for it (``--prefill-rate``).
        recent: its :class:`RecentLoad` (``Worker.recent``) or :class:`PoolLoad`
            (``Worker.placement_load``: the larger of the own and the pool's account):
            ``util`` and ``request_rate``.
        now: the account's clock reading (``None``: read it).
        pending: its entry of :meth:`router.recent.RecentPlacements.match` (prompts the
            router sent there whose cache events have not arrived): counts as held, the
            deeper of it and ``match`` per depth.
        measured_rate: the worker's measured prefill tokens/s (``WorkerLoad.prefill_rate``;
            0: none — ``prefill_rate`` is used, and ``util`` is computed at that rate).
        chain_tokens: its entry of :meth:`router.recent.RecentPlacements.extended`.
    """
    use = max(match.usable_blocks if match else 0, pending.usable_blocks if pending else 0)
    mla = max(match.mla_blocks if match else 0, pending.mla_blocks if pending else 0)
    rate = measured_rate if measured_rate > 0 else prefill_rate
    return WorkerView(
        worker_id, use, mla, queued_tokens, prefill_rate,
        store_blocks=store.usable_blocks if store else 0, measured_rate=measured_rate,
        util=recent.util(rate, now), request_rate=recent.request_rate(now),
        chain_tokens=chain_tokens)


__all__ = ["PoolLoad", "RecentLoad", "RouterView", "WorkerView", "depths", "live_view",
           "local_depth"]
