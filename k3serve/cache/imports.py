"""Importing a prefix fetched from the shared store into one worker's pools (ids only).

:meth:`PrefixImporter.begin` takes fresh pages (and a snapshot id) for the fetched entries and
pins the local entries of the same prefix, so taking the new ids cannot evict them; the caller
copies the bytes in, then :meth:`PrefixImporter.end` indexes them (``stored`` events follow) or
:meth:`PrefixImporter.abort` gives the ids back. Pure Python, no torch.
"""

from __future__ import annotations

from collections.abc import Sequence

from k3serve.cache.allocator import RefPool
from k3serve.cache.prefix import PrefixIndex
from k3serve.cache.types import ImportPlan


class PrefixImporter:
    """Ids for store imports over a worker's page / snapshot pools and prefix index.

    Args:
        pages: the page pool. snapshots: the snapshot pool. index: their prefix index.
    """

    def __init__(self, pages: RefPool, snapshots: RefPool, index: PrefixIndex):
        self.pages = pages
        self.snapshots = snapshots
        self.index = index

    def begin(
        self, prefix: Sequence[str], blocks: Sequence[str], snapshot: str | None
    ) -> ImportPlan | None:
        """Take pages (and a snapshot id) for blocks fetched from the store.

        Args:
            prefix: hashes of the whole prefix ``[0, j)`` the import completes.
            blocks: the hashes of ``prefix`` fetched (not indexed here).
            snapshot: boundary hash of the fetched snapshot (``prefix[-1]``), or ``None``.

        Returns:
            :class:`ImportPlan`, or ``None`` when the pools cannot take it now (nothing taken;
            the prefix is then computed as usual) or a needed local entry went missing.
        """
        idx = self.index
        fetched = set(blocks)
        if not prefix or any(h not in fetched and not idx.has_block(h) for h in prefix):
            return None
        if snapshot is None and not idx.has_snapshot(prefix[-1]):
            return None
        pinned = tuple(idx.page_of(h) for h in prefix if idx.has_block(h))  # type: ignore[misc]
        new_blocks = [h for h in prefix if not idx.has_block(h)]
        want_snap = snapshot is not None and not idx.has_snapshot(snapshot)
        pinned_snap = None if want_snap else idx.snapshot_of(prefix[-1])
        # ids about to be pinned leave the LRU: count only what stays free
        free_pages = self.pages.num_free - sum(1 for p in pinned if self.pages.in_lru(p))
        free_snaps = self.snapshots.num_free - (
            1 if pinned_snap is not None and self.snapshots.in_lru(pinned_snap) else 0)
        if len(new_blocks) > free_pages or (want_snap and free_snaps < 1):
            return None
        for p in pinned:
            self.pages.incref(p)
        if pinned_snap is not None:
            self.snapshots.incref(pinned_snap)
        pages = tuple((h, self.pages.allocate()) for h in new_blocks)
        snap = (snapshot, self.snapshots.allocate()) if want_snap else None  # type: ignore[arg-type]
        new = dict(pages)
        order = tuple(new[h] if h in new else idx.page_of(h) for h in prefix)
        return ImportPlan(pages, snap, pinned, pinned_snap, order)  # type: ignore[arg-type]

    def end(self, plan: ImportPlan) -> None:
        """Index an import whose bytes the engine has written (``stored`` events follow); the
        new entries become unreferenced cached (LRU), deepest first to go."""
        if plan.pages:
            self.index.register_blocks([h for h, _ in plan.pages], [p for _, p in plan.pages])
        if plan.snapshot is not None:
            self.index.register_snapshot(*plan.snapshot)
        self._unpin(plan)

    def abort(self, plan: ImportPlan) -> None:
        """Give an import's ids back without indexing them (a fetch failed)."""
        self._unpin(plan)

    def _unpin(self, plan: ImportPlan) -> None:
        for p in reversed(plan.order):
            self.pages.decref(p)
        if plan.snapshot is not None:
            self.snapshots.decref(plan.snapshot[1])
        if plan.pinned_snapshot is not None:
            self.snapshots.decref(plan.pinned_snapshot)


__all__ = ["PrefixImporter"]
