"""Values the cache manager hands out (ids only, no tensors): hits, admissions, the copies
the engine must make, pool usage and counters. Frozen where they cross modules."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PrefixHit:
    """A usable prefix hit for a waiting sequence (from :meth:`CacheManager.match`).

    Attributes:
        num_tokens: reused tokens, a multiple of ``B`` (0: none).
        pages: pages of the reused blocks, ``num_tokens / B`` of them.
        snapshot: snapshot id to load into the slot (``None`` when ``num_tokens == 0``).
        hashes: hashes of the reused blocks (re-checked by :meth:`CacheManager.admit`).
        chunk_end: the first chunk must end at or before this position (a snapshot point or
            the prompt's end).
    """

    num_tokens: int
    pages: tuple[int, ...] = ()
    snapshot: int | None = None
    hashes: tuple[str, ...] = ()
    chunk_end: int = 0


@dataclass(frozen=True)
class Admission:
    """What the engine must do before the sequence's first forward.

    Attributes:
        slot: the sequence's KDA/conv state slot.
        load_snapshot: copy this snapshot into ``slot``; ``None``: zero the slot.
        num_cached: tokens reused (``num_computed`` starts here).
    """

    slot: int
    load_snapshot: int | None
    num_cached: int


@dataclass(frozen=True)
class SnapshotSave:
    """Copy the state in ``slot`` into ``snapshot`` now (it is the state at ``position``).

    Apply saves in the order returned, right after the forward that reached ``position``.
    """

    slot: int
    snapshot: int
    position: int


@dataclass(frozen=True)
class ForkPlan:
    """Tensor copies for a forked choice (``n > 1``).

    Attributes:
        src_slot: the parent's state slot (copy all KDA layers' state + conv state).
        dst_slot: the child's slot.
        page_copies: ``(src_page, dst_page)`` for the partial last block (its first
            ``num_computed % B`` rows matter); full blocks are shared, not copied.
    """

    src_slot: int
    dst_slot: int
    page_copies: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class ImportPlan:
    """Ids taken for a prefix fetched from the shared store (:meth:`PrefixImporter.begin`).

    The engine copies the fetched bytes into ``pages`` / ``snapshot``, then calls
    :meth:`PrefixImporter.end` (index them) or :meth:`PrefixImporter.abort`.

    Attributes:
        pages: ``(block hash, page)`` to fill, in prefix order.
        snapshot: ``(boundary hash, snapshot id)`` to fill, or ``None`` (held locally).
        pinned: local pages of the same prefix, referenced meanwhile so that taking the new
            ids cannot evict them.
        pinned_snapshot: the local snapshot at the boundary, if one exists (pinned likewise).
    """

    pages: tuple[tuple[str, int], ...]
    snapshot: tuple[str, int] | None
    pinned: tuple[int, ...] = ()
    pinned_snapshot: int | None = None
    order: tuple[int, ...] = ()  # every page above, in prefix order (released deepest first)


@dataclass(frozen=True)
class CacheUsage:
    """Pool occupancy. ``*_used`` = referenced; ``*_cached`` = unreferenced but indexed."""

    num_pages: int
    pages_used: int
    pages_cached: int
    num_slots: int
    slots_used: int
    num_snapshots: int
    snapshots_used: int
    snapshots_cached: int

    @property
    def usage_ratio(self) -> float:
        """Referenced pages / all pages (``k3serve:cache_usage_ratio``)."""
        return self.pages_used / self.num_pages if self.num_pages else 0.0


@dataclass
class CacheStats:
    """Counters (monotonic) for metrics.

    Attributes:
        num_queries: prefix-cache lookups: a sequence's first admission (not a decode-side
            reservation, whose cache arrives by transfer, nor a re-admission after preemption,
            which recomputes a prompt already counted).
        query_tokens: prompt tokens of those lookups.
        hit_tokens: tokens they reused (``k3serve:prefix_cache_hits_total``).
        snapshots_saved: snapshots taken at planned points.
        snapshots_skipped: planned snapshots not taken (no evictable snapshot).
        snapshots_missed: planned points a chunk jumped over (scheduler bug indicator).
        end_snapshots: end-of-request snapshots indexed by :meth:`CacheManager.finish`.
        rolling_skipped: boundaries where a decoding sequence took no rolling snapshot because
            ``max_rolling_snapshots`` were pinned already.
    """

    num_queries: int = 0
    query_tokens: int = 0
    hit_tokens: int = 0
    snapshots_saved: int = 0
    snapshots_skipped: int = 0
    snapshots_missed: int = 0
    end_snapshots: int = 0
    rolling_skipped: int = 0


__all__ = [
    "Admission",
    "CacheStats",
    "CacheUsage",
    "ForkPlan",
    "ImportPlan",
    "PrefixHit",
    "SnapshotSave",
]
