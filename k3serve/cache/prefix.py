"""Prefix index: block hash → page, boundary hash → KDA snapshot, and the hit rule.

A prefix hit needs BOTH kinds of cache (DESIGN.md §3): MLA latents of every block before the
boundary (sliceable, per token) AND a KDA snapshot at the boundary (the recurrent state cannot
be rewound, only restored). Example, ``B = 4``, prompt of ``L = 15`` tokens::

    block      0       1       2       3
    tokens   0..3    4..7    8..11   12..14 (partial)
    MLA      [hit]   [hit]   [hit]   —          blocks cached: 3
    snapshot    ·      @8       ·    (@12: none) snapshots at boundaries 8 (after block 1)
    cap                       ⌊(L-1)/B⌋ = 3 blocks (≥ 1 prompt token is always computed)

    usable hit = deepest j ≤ min(3, cap) with a snapshot at j·B → j = 2 → 8 tokens reused:

    |<-- cache hit: 8 -->|<------- computed: 7 ------->|
    0                    8                            15

The rule (:func:`usable_prefix_blocks`) is a pure function, shared by the worker's
:class:`PrefixIndex` and the router's :class:`k3serve.cache.events.EventIndex`.
Pure Python, no torch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from k3serve.cache.allocator import RefPool


class EventSink(Protocol):
    """Where the index logs its changes (:class:`k3serve.cache.events.EventLog`)."""

    def append(self, type_: str, block_hashes: Sequence[str], snapshot: bool) -> int:
        """Log one ``stored`` / ``removed`` event; returns its ``seq``."""
        ...


def max_hit_blocks(prompt_len: int, block_size: int) -> int:
    """Blocks a prompt of ``prompt_len`` tokens may reuse: ``⌊(L-1)/B⌋`` (≥ 1 token computed).

    Raises:
        ValueError: ``prompt_len`` < 1 or ``block_size`` < 1.
    """
    if prompt_len < 1 or block_size < 1:
        raise ValueError(f"prompt_len, block_size: must be ≥ 1, got {prompt_len}, {block_size}")
    return (prompt_len - 1) // block_size


def usable_prefix_blocks(
    hashes: Sequence[str],
    max_blocks: int,
    has_block: Callable[[str], bool],
    has_snapshot: Callable[[str], bool],
) -> int:
    """Deepest ``j ≤ max_blocks`` with blocks ``0..j-1`` all cached and a snapshot at ``j·B``.

    Args:
        hashes: chained block hashes of the prompt (``hashes[i]`` names tokens ``[0, (i+1)·B)``
            and the boundary ``(i+1)·B``).
        max_blocks: cap, normally :func:`max_hit_blocks`.
        has_block: whether the MLA latents of the block with this hash are cached.
        has_snapshot: whether a KDA snapshot exists at the boundary after this block.

    Returns:
        ``j`` in blocks (0 = no usable hit; the sequence starts from a zero state).
    """
    limit = min(len(hashes), max_blocks)
    n = 0
    while n < limit and has_block(hashes[n]):
        n += 1
    for j in range(n, 0, -1):
        if has_snapshot(hashes[j - 1]):
            return j
    return 0


def fetch_plan(
    hashes: Sequence[str],
    max_blocks: int,
    has_block: Callable[[str], bool],
    has_snapshot: Callable[[str], bool],
    store_block: Callable[[str], bool],
    store_snapshot: Callable[[str], bool],
) -> tuple[int, list[str], str | None]:
    """The deepest usable prefix over the local cache AND the shared store, and what to fetch.

    Same rule as :func:`usable_prefix_blocks`, with a block (snapshot) usable when either tier
    holds it::

        block     0     1     2     3        local: blocks 0-1, snapshot @2·B
        local    [x]   [x]    .     .        store: blocks 0-3, snapshot @4·B
        store    [x]   [x]   [x]   [x] @4    → j = 4: fetch blocks 2, 3 and the snapshot @4·B

    Returns:
        ``(j, block hashes to fetch (in prefix order), snapshot hash to fetch or None)``;
        ``j = 0``: no usable prefix in either tier.
    """
    j = usable_prefix_blocks(
        hashes,
        max_blocks,
        lambda h: has_block(h) or store_block(h),
        lambda h: has_snapshot(h) or store_snapshot(h),
    )
    if j == 0:
        return 0, [], None
    blocks = [h for h in hashes[:j] if not has_block(h)]
    snap = None if has_snapshot(hashes[j - 1]) else hashes[j - 1]
    return j, blocks, snap


def log_snapshot_points(p0: int, block_size: int, dense_blocks: int) -> list[int]:
    """Log-spaced snapshot points in ``(0, p0]`` (the first-divergence policy, DESIGN.md §3).

    Every block boundary up to ``dense_blocks·B``; from there the spacing doubles each time
    the position reaches ``dense_blocks`` spacings. With ``B = 64``, ``dense_blocks = 4``::

        64 128 192 256 | 384 512 | 768 1024 | 1536 2048 | 3072 4096 …
        spacing 64       128       256        512         1024

    A prompt that first diverges from a cached one at depth ``d`` then reuses at least
    ``d − spacing(d) ≥ d/2`` tokens (all of them below ``dense_blocks·B``), at a cost of
    ``dense_blocks + 2·log2(p0 / (dense_blocks·B))`` snapshots per prompt instead of ``p0/B``.

    Returns:
        Ascending positions, multiples of ``block_size``; ``[]`` when ``dense_blocks == 0``.
    """
    if dense_blocks <= 0 or p0 < block_size:
        return []
    pts, q, step = [], block_size, block_size
    while q <= p0:
        pts.append(q)
        if q >= dense_blocks * step:
            step *= 2
        q += step
    return pts


class PrefixIndex:
    """The worker's hash maps over its page and snapshot pools, with an event log.

    The pools' ``on_evict`` is wired here: evicting an id drops its hash and logs ``removed``.

    Args:
        pages: page pool (``RefPool``); its ``on_evict`` is set by this constructor.
        snapshots: snapshot pool; ditto.
        log: where ``stored`` / ``removed`` events go (``None``: no events).
    """

    def __init__(self, pages: RefPool, snapshots: RefPool, log: EventSink | None = None):
        self.pages = pages
        self.snapshots = snapshots
        self.log = log
        self._page_of: dict[str, int] = {}
        self._page_hash: dict[int, str] = {}
        self._snap_of: dict[str, int] = {}
        self._snap_hash: dict[int, str] = {}
        pages.on_evict = self._evict_page
        snapshots.on_evict = self._evict_snapshot

    # ------------------------------------------------------------------ lookups
    def page_of(self, h: str) -> int | None:
        return self._page_of.get(h)

    def snapshot_of(self, h: str) -> int | None:
        return self._snap_of.get(h)

    def has_block(self, h: str) -> bool:
        return h in self._page_of

    def has_snapshot(self, h: str) -> bool:
        return h in self._snap_of

    def match(self, hashes: Sequence[str], max_blocks: int) -> tuple[int, list[int], int | None]:
        """Usable hit for a prompt's hashes (read-only: no ref counts, no LRU change).

        Returns:
            ``(num_blocks, pages, snapshot_id)``: pages of blocks ``0..num_blocks-1`` and the
            snapshot at the boundary (``None`` when ``num_blocks == 0``).
        """
        j = usable_prefix_blocks(hashes, max_blocks, self.has_block, self.has_snapshot)
        if j == 0:
            return 0, [], None
        return j, [self._page_of[h] for h in hashes[:j]], self._snap_of[hashes[j - 1]]

    def block_hashes(self) -> list[str]:
        """Every indexed block hash (sorted)."""
        return sorted(self._page_of)

    def snapshot_hashes(self) -> list[str]:
        """Every boundary hash with a snapshot (sorted)."""
        return sorted(self._snap_of)

    # ------------------------------------------------------------------ registration
    def register_blocks(self, hashes: Sequence[str], pages: Sequence[int]) -> int:
        """Index computed full blocks (pages the caller holds a reference to).

        A hash already indexed keeps its page (two sequences computed the same block); the
        caller's duplicate page stays unindexed and is freed with the sequence.

        Returns:
            How many blocks were newly indexed (one ``stored`` event lists them).
        """
        new: list[str] = []
        for h, p in zip(hashes, pages, strict=True):
            if h in self._page_of or p in self._page_hash:
                continue
            self._page_of[h] = p
            self._page_hash[p] = h
            self.pages.set_cached(p, True)
            new.append(h)
        if new and self.log is not None:
            self.log.append("stored", new, snapshot=False)
        return len(new)

    def register_snapshot(self, h: str, snap: int) -> bool:
        """Index a snapshot (held by the caller) at the boundary named by block hash ``h``.

        Returns:
            False when a snapshot at ``h`` already exists (the caller releases its own).
        """
        if h in self._snap_of or snap in self._snap_hash:
            return False
        self._snap_of[h] = snap
        self._snap_hash[snap] = h
        self.snapshots.set_cached(snap, True)
        if self.log is not None:
            self.log.append("stored", [h], snapshot=True)
        return True

    def clear(self) -> int:
        """Forget every *unreferenced* cached page and snapshot (``reset_prefix_cache``).

        Referenced entries stay indexed (running sequences use them).

        Returns:
            Entries forgotten.
        """
        n = 0
        for p in self.pages.lru_ids():
            self.pages.set_cached(p, False)
            self._drop_page(p)
            n += 1
        for s in self.snapshots.lru_ids():
            self.snapshots.set_cached(s, False)
            self._drop_snapshot(s)
            n += 1
        return n

    # ------------------------------------------------------------------ eviction
    def _drop_page(self, p: int) -> None:
        h = self._page_hash.pop(p)
        del self._page_of[h]
        if self.log is not None:
            self.log.append("removed", [h], snapshot=False)

    def _drop_snapshot(self, s: int) -> None:
        h = self._snap_hash.pop(s)
        del self._snap_of[h]
        if self.log is not None:
            self.log.append("removed", [h], snapshot=True)

    def _evict_page(self, p: int) -> None:
        self._drop_page(p)

    def _evict_snapshot(self, s: int) -> None:
        self._drop_snapshot(s)

    def check(self) -> None:
        """Invariants: maps are inverse; indexed ids are marked cached in their pool.

        Raises:
            AssertionError: a broken invariant.
        """
        for a, b, pool in (
            (self._page_of, self._page_hash, self.pages),
            (self._snap_of, self._snap_hash, self.snapshots),
        ):
            if len(a) != len(b) or any(b.get(i) != h for h, i in a.items()):
                raise AssertionError(f"{pool.name}: hash maps are not inverse")
            for i in range(pool.num_ids):
                if pool.is_cached(i) != (i in b):
                    raise AssertionError(f"{pool.name} {i}: cached flag disagrees with the index")


__all__ = [
    "EventSink",
    "PrefixIndex",
    "fetch_plan",
    "log_snapshot_points",
    "max_hit_blocks",
    "usable_prefix_blocks",
]
