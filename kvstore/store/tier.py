"""A worker's use of the shared store: write-through after each step, fetch before a prefill.

::

    engine thread, every tick      StoreBridge.export_new → KVStore.put_* (enqueue only)
    POST /internal/prefill         1. engine thread: StoreBridge.view (what is local)
      (before the request is       2. executor thread: KVStore.lookup, fetch_plan, KVStore.get_*
       added to the engine)        3. engine thread: StoreBridge.import_prefix → the request's
                                      ordinary prefix match finds the deeper hit

A store that is down or full only costs misses (:mod:`kvstore.store.client` logs the change
once).
What the store takes and what this worker learns has gone from it (evicted, lost) reach the
router as this worker's cache events with ``source: "store"`` (:func:`store_events`), so the
router's index stops pricing an evicted prefix as a store hit.
The hit a request reports counts as ``source="store"`` for the tokens beyond what the worker
held locally before the import.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from k3serve.cache.prefix import fetch_plan
from kvstore.store.bridge import LocalView, StoreBridge
from kvstore.store.client import KVStore, StoreConfig

log = logging.getLogger("k3serve.worker")


def store_events(changes: list[tuple[str, bool, bool]]) -> list[tuple[str, list[str], bool]]:
    """:meth:`KVStore.drain_changes` as cache events ``(type, block_hashes, snapshot)``:
    consecutive changes of one kind share an event, and the order is kept (a value that went
    and came back ends ``stored``)."""
    out: list[tuple[str, list[str], bool]] = []
    for h, snap, stored in changes:
        type_ = "stored" if stored else "removed"
        if out and out[-1][0] == type_ and out[-1][2] == snap:
            out[-1][1].append(h)
        else:
            out.append((type_, [h], snap))
    return out


class StoreTier:
    """One worker's use of the shared store (module docstring).

    Args:
        config: the store client settings (``url`` set).
        engine: the worker's engine (touched on the engine thread only).
        loop: the worker's engine loop (``worker.loop.EngineLoop``: ``await loop.call(fn, ...)``
            runs ``fn`` on the engine thread).
        labels: metric labels (``worker``, ``role``).
    """

    def __init__(self, config: StoreConfig, engine: Any, loop: Any, labels: dict[str, str]):
        self.engine = engine
        self.loop = loop
        self.block_size = engine.config.block_size
        self.store = KVStore(config, engine.fingerprint)
        self.bridge = StoreBridge(engine.cm, engine.pools)
        self.labels = labels
        #: request id → tokens held locally before its import (engine thread)
        self.local_before: dict[str, int] = {}

    def start(self) -> None:
        self.store.start()

    def close(self) -> None:
        self.store.close()

    # ------------------------------------------------------------------ engine thread
    def export(self) -> bool:
        """Hand what the last step stored to the store's writer. Returns False (never keeps
        the loop busy: the writer runs on its own thread)."""
        if self.store.available:
            self.bridge.export_new(self.store)
        else:  # skip what was stored while down: the log moves on, nothing is queued
            self.bridge.export_new(None)
        log_ = self.engine.cm.log
        for type_, hs, snap in store_events(self.store.drain_changes()):
            log_.append(type_, hs, snapshot=snap, source="store")  # the router's store holder
        return False

    def _import(self, rid: str, view: LocalView, fetched: tuple) -> bool:
        prefix, blocks, snap = fetched
        try:
            ok = self.bridge.import_prefix(prefix, blocks, snap)
        except ValueError as e:
            log.warning("store import for %s refused: %s", rid, e)
            return False
        if ok:
            self.local_before[rid] = view.num_tokens
        return ok

    def source(self, rid: str, num_cached: int) -> tuple[str, int, int]:
        """``(cached_source, local tokens, store tokens)`` of a request's hit; forgets it."""
        before = self.local_before.pop(rid, None)
        if before is None or num_cached <= before:
            return "local", num_cached, 0
        return "store", before, num_cached - before

    # ------------------------------------------------------------------ request path
    async def fetch(self, rid: str, token_ids: list[int], cache_salt: str | None) -> int:
        """Bring a deeper usable prefix of ``token_ids`` from the store into the pools.

        Returns:
            Tokens of the usable prefix now held (0: nothing imported).
        """
        if not self.store.available or not self.engine.config.enable_prefix_caching:
            return 0
        view = await self.loop.call(self.bridge.view, token_ids, cache_salt)
        if not view.hashes or view.num_tokens >= len(view.hashes) * self.block_size:
            return 0
        fetched = await asyncio.get_running_loop().run_in_executor(None, self._fetch, view)
        if fetched is None:
            return 0
        ok = await self.loop.call(self._import, rid, view, fetched)
        return len(fetched[0]) * self.block_size if ok else 0

    def _fetch(self, view: LocalView) -> tuple | None:
        """Executor thread: which deeper prefix the store completes, and its bytes."""
        hs = list(view.hashes)
        B = self.block_size
        depth = view.num_tokens // B
        need_b = [h for h in hs if h not in view.blocks]
        need_s = [h for h in hs[depth:] if h not in view.snapshots]
        sb, ss = self.store.lookup(need_b, need_s)
        j, blocks, snap = fetch_plan(hs, len(hs), view.blocks.__contains__,
                                     view.snapshots.__contains__, sb.__contains__,
                                     ss.__contains__)
        if j <= depth:
            return None
        data: dict[str, bytes] = {}
        for h in blocks:
            b = self.store.get_block(h)
            if b is None:  # evicted between lookup and get: take what the local part gives
                return None
            data[h] = b
        snap_data = None
        if snap is not None:
            s = self.store.get_snapshot(snap)
            if s is None:
                return None
            snap_data = (snap, s)
        return hs[:j], data, snap_data

    # ------------------------------------------------------------------ metrics
    def collect(self) -> list:
        """Prometheus families of the store client (a custom collector's ``collect``)."""
        st, lab = self.store.stats, self.labels
        names = ["worker", "role"]
        vals = [lab["worker"], lab["role"]]
        ops = CounterMetricFamily("k3serve:store_operations",
                                  "Store operations by kind (put, get, skipped: key present, "
                                  "dropped: queue full or store down, failed, gone: a "
                                  "reported value found evicted or lost).",
                                  labels=names + ["op"])
        for op, v in (("put", st.puts), ("get", st.gets), ("skipped", st.put_skipped),
                      ("dropped", st.put_dropped), ("failed", st.failures),
                      ("gone", st.gone)):
            ops.add_metric(vals + [op], v)
        by = CounterMetricFamily("k3serve:store_bytes", "Bytes written to / read from the store.",
                                 labels=names + ["direction"])
        by.add_metric(vals + ["put"], st.put_bytes)
        by.add_metric(vals + ["get"], st.get_bytes)
        up = GaugeMetricFamily("k3serve:store_up", "1 while the store answers.", labels=names)
        up.add_metric(vals, 1.0 if self.store.available else 0.0)
        return [ops, by, up]


__all__ = ["StoreTier", "store_events"]
