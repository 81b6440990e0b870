"""The shared store as the simulator models it: one LRU pool of MLA blocks and KDA snapshots.

Models Mooncake Store as a DRAM pool below the prefill workers: workers write
through every full block they compute and every snapshot they take, keyed by block hash; a
worker whose own cache holds less of a prompt than the store loads the deeper usable prefix
from it. Capacity is in *block units* (one MLA block = 1; one snapshot =
``snapshot_blocks``), evicted least recently used (puts and loads both refresh an entry).

The router learns what the store holds like it learns a worker's cache: the store keeps a
:class:`k3serve.cache.events.EventLog` (``stored`` / ``removed``, the INTERFACES.md §4 format)
that the simulator replays into ``router.index.GlobalIndex`` under the worker id
:data:`STORE_ID`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

from k3serve.cache.events import EventLog, make_state

STORE_ID = "store"


class SimStore:
    """LRU pool of blocks and snapshots, measured in block units.

    Args:
        capacity_blocks: capacity in block units (> 0).
        snapshot_blocks: size of one snapshot in block units (> 0).

    Raises:
        ValueError: a capacity or size ≤ 0 (named).
    """

    def __init__(self, capacity_blocks: float, snapshot_blocks: float):
        if not capacity_blocks > 0:
            raise ValueError(f"capacity_blocks: must be > 0, got {capacity_blocks}")
        if not snapshot_blocks > 0:
            raise ValueError(f"snapshot_blocks: must be > 0, got {snapshot_blocks}")
        self.capacity = float(capacity_blocks)
        self.snapshot_blocks = float(snapshot_blocks)
        self.used = 0.0
        self._lru: OrderedDict[tuple[bool, str], float] = OrderedDict()  # (is_snap, hash)
        self.blocks: set[str] = set()
        self.snaps: set[str] = set()
        self.log = EventLog(max_events=1_000_000, epoch="store")
        self.puts = self.gets = self.evictions = 0

    def put(self, block_hashes: Sequence[str], snapshot_hashes: Sequence[str] = ()) -> None:
        """Write through blocks and snapshots (present ones are refreshed), evicting LRU."""
        lru = self._lru
        new_b = [h for h in block_hashes if h not in self.blocks]
        new_s = [h for h in snapshot_hashes if h not in self.snaps]
        for h in block_hashes:
            if h in self.blocks:
                lru.move_to_end((False, h))
        for h in snapshot_hashes:
            if h in self.snaps:
                lru.move_to_end((True, h))
        for h in new_b:
            lru[(False, h)] = 1.0
            self.blocks.add(h)
        for h in new_s:
            lru[(True, h)] = self.snapshot_blocks
            self.snaps.add(h)
        self.used += len(new_b) + len(new_s) * self.snapshot_blocks
        self.puts += len(new_b) + len(new_s)
        if new_b:
            self.log.append("stored", new_b, False)
        if new_s:
            self.log.append("stored", new_s, True)
        self._evict()

    def _evict(self) -> None:
        gone_b: list[str] = []
        gone_s: list[str] = []
        while self.used > self.capacity and self._lru:
            (snap, h), size = self._lru.popitem(last=False)
            self.used -= size
            (self.snaps if snap else self.blocks).discard(h)
            (gone_s if snap else gone_b).append(h)
        self.evictions += len(gone_b) + len(gone_s)
        if gone_b:
            self.log.append("removed", gone_b, False)
        if gone_s:
            self.log.append("removed", gone_s, True)

    def usable_depth(self, hashes: Sequence[str], max_blocks: int,
                     local_has_block: Callable[[str], bool]) -> int:
        """Deepest boundary ``j ≤ max_blocks`` (blocks) loadable with the store's help.

        Every block before ``j`` is in the store or in the worker's own cache
        (``local_has_block``), and the store holds a snapshot at ``j``.
        """
        best = 0
        blocks, snaps = self.blocks, self.snaps
        for i in range(min(max_blocks, len(hashes))):
            h = hashes[i]
            if h not in blocks and not local_has_block(h):
                break
            if h in snaps:
                best = i + 1
        return best

    def load(self, hashes: Sequence[str], start: int, end: int) -> None:
        """Record a load of blocks ``[start, end)`` and the snapshot at ``end`` (refreshes LRU)."""
        self.gets += 1
        for h in hashes[start:end]:
            if h in self.blocks:
                self._lru.move_to_end((False, h))
        if end > 0 and hashes[end - 1] in self.snaps:
            self._lru.move_to_end((True, hashes[end - 1]))

    def cache_state(self) -> dict:
        """The ``/internal/cache_state``-shaped dump for ``GlobalIndex.load_state``."""
        return make_state(self.log.epoch, self.log.last_seq, sorted(self.blocks),
                          sorted(self.snaps))

    def events_since(self, after: int) -> dict:
        """The ``/internal/cache_events``-shaped answer for ``GlobalIndex.apply_events``."""
        return self.log.since(after)
