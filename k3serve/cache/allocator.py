"""Id allocators for the cache pools: pages, state slots, snapshots. No tensors.

Pure bookkeeping sized from the specs (the simulator runs it at K3 scale). An id is an index
into one pool tensor (``mla_latent[:, page]``, ``kda_state[:, slot]``, ``snap_state[:, id]``).

:class:`RefPool` (pages and snapshots) — every id is in exactly one of three states::

                allocate()                     decref() → 0, cached
     FREE ────────────────────▶ IN USE ───────────────────────────▶ CACHED (LRU)
      ▲       (ref_count ≥ 1)    ▲  │ decref() → 0, not cached        │   │
      │                          │  └─────────────▶ FREE              │   │
      │                          └──────── incref() (a prefix hit) ───┘   │
      └──────── allocate() evicts the least recently used: on_evict(id) ──┘

"cached" means the prefix index maps a hash to the id (its content is reusable). Unreferenced
cached ids count as available: :meth:`RefPool.allocate` takes a free id first, else evicts the
least recently released cached one and calls ``on_evict`` so the index forgets it.

:class:`SlotPool` — KDA state slots of running sequences: free or in use, nothing cached.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable


class CacheFullError(RuntimeError):
    """An allocation found no free or evictable id. Callers check ``can_allocate`` first."""


class RefPool:
    """``num_ids`` ids with ref counts, a free list and an LRU queue of unreferenced cached ids.

    Args:
        num_ids: pool size (pages ``P`` or snapshots ``N_snap``); may be 0.
        name: for messages (``"page"``, ``"snapshot"``).
        on_evict: called with an id when :meth:`allocate` evicts it from the LRU, before reuse.

    Raises:
        ValueError: ``num_ids`` < 0.
    """

    def __init__(
        self, num_ids: int, name: str = "id", on_evict: Callable[[int], None] | None = None
    ):
        if num_ids < 0:
            raise ValueError(f"num_ids: must be ≥ 0, got {num_ids}")
        self.name = name
        self.num_ids = num_ids
        self.on_evict = on_evict
        self._ref = [0] * num_ids
        self._cached = [False] * num_ids
        self._free: deque[int] = deque(range(num_ids))
        self._lru: OrderedDict[int, None] = OrderedDict()  # oldest first
        self.num_evictions = 0

    # ------------------------------------------------------------------ queries
    @property
    def num_free(self) -> int:
        """Ids an allocation can take now: free + unreferenced cached (evictable)."""
        return len(self._free) + len(self._lru)

    @property
    def num_cached_free(self) -> int:
        """Unreferenced cached ids (the LRU queue)."""
        return len(self._lru)

    @property
    def num_used(self) -> int:
        """Ids with ``ref_count ≥ 1``."""
        return self.num_ids - self.num_free

    def can_allocate(self, n: int = 1) -> bool:
        """Whether ``n`` allocations would succeed now."""
        return n <= self.num_free

    def ref_count(self, i: int) -> int:
        return self._ref[i]

    def is_cached(self, i: int) -> bool:
        return self._cached[i]

    def in_lru(self, i: int) -> bool:
        """Unreferenced and cached (would be reclaimed by an allocation)."""
        return i in self._lru

    # ------------------------------------------------------------------ mutation
    def allocate(self) -> int:
        """Take an id with ``ref_count = 1`` and no cached content.

        Returns:
            The id: a free one if any, else the least recently released cached one (evicted:
            ``on_evict(id)`` is called first).

        Raises:
            CacheFullError: every id is referenced.
        """
        if self._free:
            i = self._free.popleft()
        elif self._lru:
            i, _ = self._lru.popitem(last=False)
            self._cached[i] = False
            self.num_evictions += 1
            if self.on_evict is not None:
                self.on_evict(i)
        else:
            raise CacheFullError(f"no free {self.name}: all {self.num_ids} referenced")
        self._ref[i] = 1
        return i

    def incref(self, i: int) -> None:
        """Take one more reference (a prefix hit or a fork); leaves the LRU if it was there.

        Raises:
            ValueError: ``i`` is free (nothing to share).
        """
        if self._ref[i] == 0:
            if i not in self._lru:
                raise ValueError(f"{self.name} {i}: incref of a free id")
            del self._lru[i]
        self._ref[i] += 1

    def decref(self, i: int) -> None:
        """Drop a reference; at zero the id becomes LRU-cached (if cached) or free.

        Raises:
            ValueError: ``i`` has no reference.
        """
        if self._ref[i] <= 0:
            raise ValueError(f"{self.name} {i}: decref below zero")
        self._ref[i] -= 1
        if self._ref[i] == 0:
            if self._cached[i]:
                self._lru[i] = None  # most recently used end
            else:
                self._free.append(i)

    def set_cached(self, i: int, cached: bool) -> None:
        """Mark whether the index maps a hash to ``i``. Uncaching an unreferenced id frees it.

        Raises:
            ValueError: caching a free id (it holds no content).
        """
        if cached == self._cached[i]:
            return
        if cached:
            if self._ref[i] == 0:
                raise ValueError(f"{self.name} {i}: cannot cache a free id")
            self._cached[i] = True
        else:
            self._cached[i] = False
            if i in self._lru:
                del self._lru[i]
                self._free.append(i)

    def lru_ids(self) -> list[int]:
        """Unreferenced cached ids, least recently released first."""
        return list(self._lru)

    def check(self) -> None:
        """Invariants: each id in exactly one state; ref counts ≥ 0.

        Raises:
            AssertionError: a broken invariant (a bookkeeping bug).
        """
        free = set(self._free)
        lru = set(self._lru)
        if len(free) != len(self._free) or free & lru:
            raise AssertionError(f"{self.name}: id both free and LRU, or free twice")
        for i in range(self.num_ids):
            r = self._ref[i]
            if r < 0:
                raise AssertionError(f"{self.name} {i}: ref {r}")
            if r == 0 and (i in free) == (i in lru):
                raise AssertionError(
                    f"{self.name} {i}: unreferenced but not exactly one of free/LRU"
                )
            if r > 0 and (i in free or i in lru):
                raise AssertionError(f"{self.name} {i}: referenced but queued")
            if i in lru and not self._cached[i]:
                raise AssertionError(f"{self.name} {i}: in LRU but not cached")
            if i in free and self._cached[i]:
                raise AssertionError(f"{self.name} {i}: free but cached")


class SlotPool:
    """KDA/conv state slots: one per running sequence. Free or in use.

    Args:
        num_slots: ``S``.

    Raises:
        ValueError: ``num_slots`` < 0.
    """

    def __init__(self, num_slots: int):
        if num_slots < 0:
            raise ValueError(f"num_slots: must be ≥ 0, got {num_slots}")
        self.num_slots = num_slots
        self._free: deque[int] = deque(range(num_slots))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def can_allocate(self, n: int = 1) -> bool:
        return n <= len(self._free)

    def allocate(self) -> int:
        """Take a slot.

        Raises:
            CacheFullError: no free slot.
        """
        if not self._free:
            raise CacheFullError(f"no free state slot: all {self.num_slots} in use")
        s = self._free.popleft()
        self._used.add(s)
        return s

    def free(self, s: int) -> None:
        """Return a slot.

        Raises:
            ValueError: ``s`` is not in use.
        """
        if s not in self._used:
            raise ValueError(f"slot {s}: not in use")
        self._used.remove(s)
        self._free.append(s)

    def is_used(self, s: int) -> bool:
        return s in self._used


__all__ = ["CacheFullError", "RefPool", "SlotPool"]
