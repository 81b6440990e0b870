"""Engine-thread side of the shared store: cache-manager ids ↔ bytes in the pools.

:meth:`StoreBridge.export_new` replays the cache manager's ``stored`` events and hands each
entry's bytes to a :class:`StoreSink` (the store client's put queue); :meth:`StoreBridge.view`
says what the local cache holds of a prompt's reusable prefix, and
:meth:`StoreBridge.import_prefix` writes fetched bytes into fresh pages / a snapshot and indexes
them (:class:`~k3serve.cache.imports.PrefixImporter`). Called on the engine thread only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from k3serve.cache.manager import CacheManager
from k3serve.cache.pools import KVPools


class StoreSink(Protocol):
    """Where :meth:`StoreBridge.export_new` hands bytes (:class:`kvstore.store.client.KVStore`);
    both calls must return at once (enqueue)."""

    def put_block(self, h: str, data: Any) -> bool: ...

    def put_snapshot(self, h: str, data: Any) -> bool: ...


@dataclass(frozen=True)
class LocalView:
    """What a worker's cache holds of one prompt's reusable prefix (:meth:`StoreBridge.view`).

    Attributes:
        hashes: hashes of the first ``cap = ⌊(L-1)/B⌋`` blocks.
        blocks: those of ``hashes`` indexed here; snapshots: boundaries with a snapshot here.
        num_tokens: the usable local hit now (tokens).
    """

    hashes: tuple[str, ...]
    blocks: frozenset[str]
    snapshots: frozenset[str]
    num_tokens: int


class StoreBridge:
    """Engine-thread side of the shared store (DESIGN.md §3): moves bytes between the engine's
    pools and the store client (:mod:`kvstore.store.client`), through the cache manager's ids.

    * write-through: :meth:`export_new` replays the cache manager's ``stored`` events since the
      last call (blocks indexed at commit, snapshots saved at planned points, a decode side's
      end-of-answer snapshot at finish) and hands each entry's bytes to the sink — called
      from the worker's tick, after the step that wrote them; the sink only enqueues.
    * read: :meth:`view` (what is local) → the worker fetches the rest off the engine thread →
      :meth:`import_prefix` writes it into fresh pages / a snapshot and indexes it, so the
      request's ordinary prefix match finds a deeper hit.

    Entries it imported are not exported again. Tensor copies go through
    :class:`~k3serve.cache.pools.KVPools` (``block_bytes`` / ``load_block`` / …); the cache
    manager only hands out ids.

    Args:
        cm: the engine's cache manager (its events, index and :attr:`importer`).
        pools: the engine's :class:`~k3serve.cache.pools.KVPools`.
    """

    def __init__(self, cm: CacheManager, pools: KVPools):
        self.cm = cm
        self.pools = pools
        self._epoch: str | None = None
        self._after = 0
        self._imported: set[tuple[str, bool]] = set()
        self.num_exported = 0
        self.num_imported_blocks = 0
        self.num_imported_snapshots = 0

    def export_new(self, sink: StoreSink | None) -> int:
        """Hand every block / snapshot stored since the last call to ``sink`` (``None``: skip
        them — the store is down; nothing is copied).

        Returns:
            Entries handed over.
        """
        cm, pools = self.cm, self.pools
        batch = cm.events_since(self._after)
        if batch["epoch"] != self._epoch:  # first call: from the start of the log
            self._epoch, self._after = batch["epoch"], 0
            batch = cm.events_since(0)
        n = 0
        if sink is None:
            self._after = batch["events"][-1]["seq"] if batch["events"] else self._after
            return 0
        for ev in batch["events"]:
            self._after = ev["seq"]
            if ev["type"] != "stored" or ev.get("source") == "store":  # not ours to put again
                continue
            snap = bool(ev["snapshot"])
            for h in ev["block_hashes"]:
                if (h, snap) in self._imported:
                    self._imported.discard((h, snap))
                    continue
                if snap:
                    sid = cm.index.snapshot_of(h)
                    if sid is not None:  # evicted since: nothing to send
                        sink.put_snapshot(h, pools.snapshot_bytes(sid).numpy())
                        n += 1
                else:
                    page = cm.index.page_of(h)
                    if page is not None:
                        sink.put_block(h, pools.block_bytes(page).numpy())
                        n += 1
        self.num_exported += n
        return n

    def view(self, token_ids: Sequence[int], cache_salt: str | None) -> LocalView:
        """The local part of a prompt's reusable prefix (read-only)."""
        cm = self.cm
        hashes, _cap = cm.prefix_hashes(token_ids, cache_salt)
        idx = cm.index
        return LocalView(
            tuple(hashes),
            frozenset(h for h in hashes if idx.has_block(h)),
            frozenset(h for h in hashes if idx.has_snapshot(h)),
            cm.lookup(token_ids, cache_salt) if hashes else 0,
        )

    def import_prefix(
        self,
        prefix: Sequence[str],
        blocks: dict[str, bytes],
        snapshot: tuple[str, bytes] | None,
    ) -> bool:
        """Write fetched blocks / a snapshot into the pools and index them.

        Args:
            prefix: the prefix hashes ``[0, j)`` the fetch completes.
            blocks: fetched latents by block hash (``KVPools.block_bytes`` layout).
            snapshot: ``(prefix[-1], bytes)`` or ``None`` when the snapshot is local.

        Returns:
            True when the prefix is now usable here; False (nothing changed) when the pools
            could not take it or a local part went missing meanwhile.

        Raises:
            ValueError: bytes of the wrong size (a layout mismatch behind equal keys).
        """
        cm, pools = self.cm, self.pools
        plan = cm.importer.begin(prefix, list(blocks), snapshot[0] if snapshot else None)
        if plan is None:
            return False
        try:
            for h, page in plan.pages:
                pools.load_block(page, blocks[h])
            if plan.snapshot is not None and snapshot is not None:
                pools.load_snapshot_bytes(plan.snapshot[1], snapshot[1])
        except BaseException:
            cm.importer.abort(plan)
            raise
        self._imported.update((h, False) for h, _ in plan.pages)
        if plan.snapshot is not None:
            self._imported.add((plan.snapshot[0], True))
        cm.importer.end(plan)
        self.num_imported_blocks += len(plan.pages)
        self.num_imported_snapshots += plan.snapshot is not None
        return True


__all__ = ["LocalView", "StoreBridge", "StoreSink"]
