"""Request placement: a pure cost function over (request, worker states).

The router turns one request into a ``PlacementRequest`` (prompt length, block size, a
sequence number) and a snapshot of each worker's state (its usable cached depth for this
prompt from the global index, the prefill work queued on it, its decode load and free
memory), then calls ``place``. Nothing here performs I/O or keeps state between calls, so
the simulator can replay traces through the very same policies.

Prefill choice — a policy function (the name → policy table: :mod:`router.policies.table`):

* ``cache_aware``: estimated TTFT of worker *w* =
  ``(queued_tokens_w + prompt_tokens - cached_tokens_w) / rate_w`` (seconds; ``rate_w``:
  the worker's measured prefill rate, else the static one, :attr:`PrefillWorkerState.rate`); the
  KV transfer delays token #2, not TTFT, so it is not in the cost. A load guard first drops
  workers whose queued work (seconds: queued tokens / rate) exceeds
  ``guard_factor × least queued + guard_seconds``, so a hot prefix cannot pile every request
  onto one worker. Ties → least queued, then :func:`tie_breaks`.
* ``least_load``: least queued prefill work (queued tokens / rate), cache-blind but for its
  ties (:func:`tie_breaks`: at an idle tie a repeated prompt meets its earlier copy).
* ``round_robin``: ``seq mod n`` over the healthy workers (``seq`` comes with the request).
* ``random``: uniform, seeded by ``(seed, seq)`` so a replay is reproducible.
* ``prefix_home`` (the default) and ``approx_radix``: in :mod:`router.policies`.

Decode choice (all policies): a worker with room for the request (free cache tokens for
prompt + ``max_tokens`` per choice, a free state slot per choice) and the lightest batch;
if none has room, the one with the most free tokens (the request waits there).

Ties (every cost-based policy, and the decode choice): :func:`tie_breaks`. A request that
carries a content address (``PlacementRequest.key``: the live router and the simulator pass
the chained hash of the prompt's last full block) breaks them by rendezvous hashing (highest
random weight, Thaler & Ravishankar 1998): among the tied workers, the one whose
``blake2b(key, worker_id)`` is largest. The choice then depends only on the request's content
and on the workers' states and ids — not on a counter or the order a router lists its
workers in — so router replicas with the same view of the workers' events choose the same
worker; distinct prompts spread uniformly, a repeated prompt goes where its copy
went at the last tie. (Keyed on the *first* block instead, every tie of prompts that share a
system prompt went to one worker: in the simulator ``cache_aware``'s balance on the
conversation trace went from 1.04 to 4.8 with the store.) Without a key: a rotation by
``seq``.

``snapshot_at``: with ``PlacementParams.snapshot_interval_blocks`` = k, every multiple of k
blocks past the chosen worker's hit and before the prompt end. And when the prompt shares MLA blocks with earlier prompts (any worker) up to a
boundary deeper than what the chosen prefill worker can reuse, and the prompt diverges there,
that boundary is a branch point: the chosen worker is asked to keep a KDA snapshot at it
(DESIGN.md §3), so the next prompt diverging there hits. The prompt-end boundary
``⌊(L−1)/B⌋·B`` is snapshotted by the worker anyway and is never requested.
"""

from __future__ import annotations

import hashlib
import random as _random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field


class NoWorkerAvailable(RuntimeError):
    """No healthy prefill or decode worker to place a request on (the API answers 503)."""


@dataclass(frozen=True)
class PlacementRequest:
    """What placement needs to know about one request.

    Attributes:
        num_prompt_tokens: Prompt length L in tokens (≥ 1).
        block_size: Cache block size B in tokens (the workers' ``/internal/info``).
        seq: Router-wide request sequence number (drives ``round_robin`` and ``random``, and
            breaks ties when ``key`` is empty).
        max_new_tokens: Upper bound of generated tokens per choice (decode memory).
        n: Number of choices (decode state slots and memory).
        key: Content address of the request that breaks cost ties (:func:`tie_breaks`): the
            chained hash of the prompt's last full block (``router.pipeline.affinity_key``);
            ``""``: none (ties rotate by ``seq``).
    """

    num_prompt_tokens: int
    block_size: int
    seq: int = 0
    max_new_tokens: int = 0
    n: int = 1
    key: str = ""

    def __post_init__(self) -> None:
        if self.num_prompt_tokens < 1:
            raise ValueError(f"num_prompt_tokens must be >= 1, got {self.num_prompt_tokens}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")

    @property
    def max_cached_blocks(self) -> int:
        """Deepest reusable boundary in blocks: ``⌊(L−1)/B⌋`` (one token is always computed)."""
        return (self.num_prompt_tokens - 1) // self.block_size


@dataclass(frozen=True)
class PrefillWorkerState:
    """One prefill worker as placement sees it.

    Attributes:
        worker_id: The worker's name (the router uses its base URL).
        cached_blocks: Usable cached depth for this prompt in blocks (MLA blocks + a KDA
            snapshot at the boundary; ``GlobalIndex.match(...).usable_blocks``).
        mla_blocks: MLA-only prefix depth for this prompt in blocks (≥ ``cached_blocks``).
        queued_tokens: Prefill tokens sent to the worker and not finished yet.
        prefill_rate: The static prefill throughput assumed for the worker, tokens per second
            (the router's ``--prefill-rate``); used only while ``measured_rate`` is 0.
        healthy: Whether the worker may receive requests.
        store_blocks: Usable depth (blocks) the worker can reach by fetching from the shared
            store (≥ ``cached_blocks`` when the store holds more; 0: no store / nothing).
        measured_rate: The worker's measured prefill throughput, tokens per second (computed
            prompt tokens over the busy seconds of its recent prefills, as it reports them
            with its cache events); 0: no measurement yet.
    """

    worker_id: str
    cached_blocks: int = 0
    mla_blocks: int = 0
    queued_tokens: int = 0
    prefill_rate: float = 10_000.0
    healthy: bool = True
    store_blocks: int = 0
    measured_rate: float = 0.0

    @property
    def rate(self) -> float:
        """The prefill rate placement prices this worker at, tokens/s: ``measured_rate``
        when measured, else the static ``prefill_rate``."""
        return self.measured_rate if self.measured_rate > 0 else self.prefill_rate


@dataclass(frozen=True)
class DecodeWorkerState:
    """One decode worker as placement sees it.

    Attributes:
        worker_id: The worker's name.
        free_tokens: Free MLA cache capacity in tokens (free + evictable pages × B).
        free_slots: Free KDA state slots (one per running sequence).
        running: Sequences in its decode batch plus those reserved and not yet admitted.
        healthy: Whether the worker may receive requests.
    """

    worker_id: str
    free_tokens: int = 1 << 62
    free_slots: int = 1 << 30
    running: int = 0
    healthy: bool = True


@dataclass(frozen=True)
class PlacementParams:
    """Knobs of the cache-aware policy.

    Attributes:
        guard_factor: A worker is eligible only if its queued work (queued tokens / prefill
            rate, seconds) is at most ``guard_factor × least queued work + guard_seconds``.
        guard_seconds: Absolute slack of the load guard, in seconds of queued prefill.
        seed: Seed of the ``random`` policy.
        snapshot_branch_points: Whether to request ``snapshot_at`` at branch points.
        store_token_cost: What a token fetched from the shared store costs, as a fraction of
            computing it (a store hit is priced below a local one, above a miss). Measured on
            one CPU box (benchmarks/store.py): a k3-tiny block of 64 tokens (41 kB) arrives in
            well under 1 ms against ~8 ms to prefill it; 0.1 leaves room for a cluster.
        snapshot_interval_blocks: ask the chosen prefill worker to keep a KDA snapshot at every
            multiple of this many blocks in the part of the prompt it computes (0: none), so
            the first prompt to diverge from it inside that part still reuses up to the last
            multiple before the divergence. The snapshots share the worker's LRU snapshot
            budget.
    """

    guard_factor: float = 1.5
    guard_seconds: float = 0.5
    seed: int = 0
    snapshot_branch_points: bool = True
    store_token_cost: float = 0.1
    snapshot_interval_blocks: int = 0


@dataclass(frozen=True)
class Placement:
    """The outcome of one placement decision.

    Attributes:
        prefill: Chosen prefill worker id.
        decode: Chosen decode worker id (``None`` when no decode pool was given).
        predicted_cached_tokens: Tokens the chosen prefill worker should reuse (a multiple of B).
        snapshot_at: Token positions (multiples of B) where the prefill worker should keep a
            KDA snapshot, ascending.
        policy: Name of the prefill policy that decided.
    """

    prefill: str
    decode: str | None
    predicted_cached_tokens: int
    snapshot_at: tuple[int, ...] = field(default=())
    policy: str = "cache_aware"


# A prefill policy picks an index into ``workers`` (all healthy, non-empty).
PrefillPolicy = Callable[[PlacementRequest, Sequence[PrefillWorkerState], PlacementParams], int]


def hrw_weight(key: str, worker_id: str) -> int:
    """Rendezvous (highest-random-weight) weight of ``worker_id`` for ``key``: the first 8
    bytes of ``blake2b(key ‖ 0x00 ‖ worker_id)`` as an unsigned integer in ``[0, 2⁶⁴)``."""
    h = hashlib.blake2b(f"{key}\x00{worker_id}".encode(), digest_size=8)
    return int.from_bytes(h.digest(), "big")


def tie_breaks(req: PlacementRequest, worker_ids: Sequence[str]) -> list[int]:
    """The last element of a policy's sort key, per worker (lower wins a tie).

    With ``req.key``: ``−hrw_weight(key, worker_id)`` (rendezvous hashing: the same worker for
    the same content and worker set, whatever the caller's counter or worker order; removing
    a worker moves only the requests it would have won). Without: ``(i − seq) mod n`` (a
    rotation over the list as given).

    Args:
        req: The request (``key``, ``seq``).
        worker_ids: The candidates' ids, in the caller's order.

    Returns:
        One integer per worker, in that order; all distinct unless two ids hash alike.
    """
    if req.key:
        return [-hrw_weight(req.key, w) for w in worker_ids]
    n = len(worker_ids)
    return [(i - req.seq) % n for i in range(n)]


def _uncached(req: PlacementRequest, w: PrefillWorkerState,
              store_cost: float = 1.0) -> float:
    """Tokens of work left on ``w``: the prompt minus its local hit, with the part only the
    store holds charged at ``store_cost`` of a computed token."""
    local = min(w.cached_blocks, req.max_cached_blocks)
    store = max(0, min(w.store_blocks, req.max_cached_blocks) - local)
    return req.num_prompt_tokens - (local + store * (1.0 - store_cost)) * req.block_size


def cache_aware(req: PlacementRequest, workers: Sequence[PrefillWorkerState],
                params: PlacementParams) -> int:
    """Least estimated TTFT among the workers that pass the load guard.

    TTFT_w = (queued_tokens_w + uncached_tokens_w) / rate_w, in seconds.
    """
    least = min(w.queued_tokens / w.rate for w in workers)
    bound = params.guard_factor * least + params.guard_seconds
    tie = tie_breaks(req, [w.worker_id for w in workers])
    best, best_key = 0, None
    for i, w in enumerate(workers):
        queued_s = w.queued_tokens / w.rate
        if queued_s > bound:
            continue
        ttft = queued_s + _uncached(req, w, params.store_token_cost) / w.rate
        key = (ttft, queued_s, tie[i])
        if best_key is None or key < best_key:
            best, best_key = i, key
    return best


def least_load(req: PlacementRequest, workers: Sequence[PrefillWorkerState],
               params: PlacementParams) -> int:
    """Least queued prefill time (queued tokens / rate), cache-blind; ties →
    :func:`tie_breaks`."""
    tie = tie_breaks(req, [w.worker_id for w in workers])
    return min(range(len(workers)), key=lambda i: (
        workers[i].queued_tokens / workers[i].rate, tie[i]))


def round_robin(req: PlacementRequest, workers: Sequence[PrefillWorkerState],
                params: PlacementParams) -> int:
    """Worker ``seq mod n`` over the healthy workers."""
    return req.seq % len(workers)


def random_choice(req: PlacementRequest, workers: Sequence[PrefillWorkerState],
                  params: PlacementParams) -> int:
    """Uniform choice, reproducible from ``(params.seed, req.seq)``."""
    return _random.Random(params.seed * 1_000_003 + req.seq).randrange(len(workers))


def choose_decode(req: PlacementRequest, workers: Sequence[DecodeWorkerState]) -> str:
    """Decode worker with room for the request and the lightest batch.

    Room = ``free_tokens >= n × (L + max_new_tokens)`` (an upper bound: the choices share the
    prompt's pages) and ``free_slots >= n``. Ties → most free tokens, then the rendezvous
    weight of ``req.key`` (:func:`tie_breaks`; no key: lowest index).

    Raises:
        NoWorkerAvailable: no healthy decode worker.
    """
    need_tokens = req.n * (req.num_prompt_tokens + req.max_new_tokens)
    tie = ([-hrw_weight(req.key, w.worker_id) for w in workers] if req.key
           else range(len(workers)))
    best, best_key = None, None
    for i, w in enumerate(workers):
        if not w.healthy:
            continue
        fits = w.free_tokens >= need_tokens and w.free_slots >= req.n
        key = (not fits, w.running if fits else 0, -w.free_tokens, tie[i])
        if best_key is None or key < best_key:
            best, best_key = w.worker_id, key
    if best is None:
        raise NoWorkerAvailable("no healthy decode worker")
    return best


def branch_snapshot(req: PlacementRequest, chosen: PrefillWorkerState,
                    shared_blocks: int) -> tuple[int, ...]:
    """Branch-point snapshot request for the chosen prefill worker.

    Args:
        req: The request.
        chosen: The chosen prefill worker's state.
        shared_blocks: Deepest MLA prefix (blocks) of this prompt held by any worker — the
            prompt shares that many blocks with earlier prompts and diverges right after.

    Returns:
        ``(shared_blocks × B,)`` when that boundary is deeper than what ``chosen`` reuses,
        leaves at least one token to compute, and is not the prompt-end boundary; else ``()``.
    """
    m = min(shared_blocks, req.max_cached_blocks)
    if m <= 0 or m == req.max_cached_blocks or m <= chosen.cached_blocks:
        return ()
    return (m * req.block_size,)


def place(req: PlacementRequest, prefill: Sequence[PrefillWorkerState],
          decode: Sequence[DecodeWorkerState] = (), policy: PrefillPolicy = cache_aware,
          params: PlacementParams = PlacementParams(), name: str = "cache_aware") -> Placement:
    """Choose the prefill and decode workers of one request. Pure: no I/O, no mutation.

    Args:
        req: The request.
        prefill: Every prefill worker's state (unhealthy ones are skipped).
        decode: Every decode worker's state; empty → ``Placement.decode`` is ``None``.
        policy: The prefill policy (by name: :func:`router.policies.table.place`).
        params: Cache-aware and random policy knobs.
        name: The policy's name (``Placement.policy``).

    Returns:
        The placement, with the predicted cached tokens of the chosen prefill worker
        (``min(cached_blocks, ⌊(L−1)/B⌋) × B``) and the ``snapshot_at`` request.

    Raises:
        NoWorkerAvailable: no healthy prefill worker, or decode workers given but none healthy.
    """
    choose = policy
    healthy = [w for w in prefill if w.healthy]
    if not healthy:
        raise NoWorkerAvailable("no healthy prefill worker")
    chosen = healthy[choose(req, healthy, params)]
    dec = choose_decode(req, decode) if decode else None
    cached = min(chosen.cached_blocks, req.max_cached_blocks) * req.block_size
    snaps: tuple[int, ...] = ()
    if params.snapshot_branch_points:
        shared = max(w.mla_blocks for w in prefill)
        snaps = branch_snapshot(req, chosen, shared)
    k = params.snapshot_interval_blocks
    if k > 0:
        grid = range((chosen.cached_blocks // k + 1) * k, req.max_cached_blocks, k)
        snaps = tuple(sorted({*snaps, *(j * req.block_size for j in grid)}))
    return Placement(chosen.worker_id, dec, cached, snaps, name)
