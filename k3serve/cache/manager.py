"""CacheManager: the scheduler's one handle on the hybrid cache (pages + slots + snapshots).

Pure Python bookkeeping (the simulator runs it at K3 scale). The scheduler sees sequences by
id and asks predicates (:meth:`can_admit`, :meth:`can_allocate`, :meth:`can_fork`); it never
sees pools or the index. The engine does the tensor work the manager asks for: load a snapshot
into a slot (:class:`Admission`), copy a slot into a snapshot (:class:`SnapshotSave`), copy a
slot and a partial page for ``n > 1`` (:class:`ForkPlan`).

One sequence's positions (prompt of ``L`` tokens, ``B`` tokens per block)::

    0          num_cached            num_computed         L         len(tokens)
    |<-cache hit->|<--- computed here ---->|<-- next chunk -->|<-- decode -->|
    |  pages from |  pages allocated for this sequence (block_table[i] covers
    |  the index  |  positions [i·B, (i+1)·B)); full blocks get indexed at commit
                        ^ snapshot points: ⌊(L-1)/B⌋·B, snapshot_at, every interval
                          (a chunk never crosses one: it ends on it; see chunk_end)

Snapshots (DESIGN.md §3) are taken

* at planned prompt points (above), when the chunk ending there is committed;
* at the end of a finished request: while decoding, every boundary the sequence reaches past
  ``⌊(L-1)/B⌋·B`` overwrites the sequence's own *rolling* snapshot; :meth:`finish` indexes it
  if it sits at ``⌊num_computed/B⌋·B`` (prompt + answer minus the last sampled token, rounded
  down to a block), so the conversation's next turn hits there. Rolling snapshots are pinned
  until the sequence ends, so at most ``CacheConfig.max_rolling_snapshots`` of them exist at
  once (a fraction of the budget; the rest stays for prompt snapshots): a sequence that
  reaches a boundary while the cap is taken takes none there (it tries again at its next
  boundary), and one that holds none at its end publishes no end-of-request snapshot
  (counted in ``CacheStats.rolling_skipped``).

Life of a sequence: ``add`` → (``match`` → ``can_admit`` → ``admit``) → repeat
(``chunk_end``, ``can_allocate`` → ``allocate`` → forward → ``commit``) → ``finish`` |
``release`` (preempted; ``set_tokens`` then admit again) | ``remove`` (aborted).
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence

from k3serve.cache.allocator import CacheFullError
from k3serve.cache.events import EventLog
from k3serve.cache.hashing import block_hashes, make_salt
from k3serve.cache.imports import PrefixImporter
from k3serve.cache.reader import CacheReader, SeqCache
from k3serve.cache.specs import CacheConfig
from k3serve.cache.types import Admission, ForkPlan, PrefixHit, SnapshotSave


class CacheManager(CacheReader):
    """Allocator + prefix index + per-sequence bookkeeping of one worker: the writes over the
    state and queries of :class:`~k3serve.cache.reader.CacheReader`.

    Args:
        config: capacities and policy.
        fingerprint: the layout fingerprint (hash salt base; ``specs.layout_fingerprint``).
        log: event log (a fresh one when ``None``).

    Attributes:
        importer: :class:`~k3serve.cache.imports.PrefixImporter` (prefixes fetched from the
            shared store).
    """

    def __init__(self, config: CacheConfig, fingerprint: str, log: EventLog | None = None):
        super().__init__(config, fingerprint, log)
        self.importer = PrefixImporter(self.pages, self.snapshots, self.index)

    # ================================================================== registry
    def add(
        self,
        seq_id: Hashable,
        token_ids: Sequence[int],
        cache_salt: str | None = None,
        snapshot_at: Iterable[int] = (),
        snapshot_on_finish: bool = True,
        plan_snapshots: bool = True,
        lookup: bool = True,
    ) -> None:
        """Register a waiting sequence (no memory taken yet).

        Args:
            seq_id: unique id.
            token_ids: ``[L]`` prompt tokens.
            cache_salt: tenant salt (``None``: shared).
            snapshot_at: positions (tokens) where a snapshot is wanted; rounded down to a block
                multiple; those outside ``(0, L]`` are ignored.
            snapshot_on_finish: keep a rolling snapshot while decoding and index it at
                :meth:`finish` (the next turn's hit). Off for prefill-only requests.
            plan_snapshots: take the prompt's snapshots (⌊(L-1)/B⌋·B, ``snapshot_at``,
                intervals). Off for a decode-side reservation, whose state arrives at ``L``.
            lookup: the first admission is a prefix-cache lookup, counted in :attr:`stats`.
                Off for a decode-side reservation (admitted with ``PrefixHit(0)``).

        Raises:
            ValueError: duplicate ``seq_id``, empty ``token_ids``, bad ``cache_salt``, a
                negative or non-int ``snapshot_at`` entry.
        """
        if seq_id in self._seqs:
            raise ValueError(f"seq_id: {seq_id!r} already registered")
        if len(token_ids) == 0:
            raise ValueError("token_ids: empty prompt")
        pts = tuple(snapshot_at)
        if any(not isinstance(p, int) or isinstance(p, bool) or p < 0 for p in pts):
            raise ValueError(f"snapshot_at: positions must be ints ≥ 0, got {list(pts)}")
        s = SeqCache(
            make_salt(self.fingerprint, cache_salt),
            len(token_ids),
            pts,
            snapshot_on_finish,
            plan_snapshots,
            lookup,
        )
        self._extend_hashes(s, token_ids, len(token_ids) // self.block_size)
        self._seqs[seq_id] = s

    def set_tokens(self, seq_id: Hashable, token_ids: Sequence[int]) -> None:
        """Grow a released (preempted) sequence's prompt to ``token_ids`` (prompt + outputs).

        Raises:
            ValueError: the sequence holds memory, or ``token_ids`` is shorter than before.
        """
        s = self._seq(seq_id)
        if s.slot is not None:
            raise ValueError(f"seq {seq_id!r}: set_tokens on an admitted sequence")
        if len(token_ids) < s.num_prompt:
            raise ValueError("token_ids: shorter than the registered prompt")
        s.num_prompt = len(token_ids)
        self._extend_hashes(s, token_ids, len(token_ids) // self.block_size)

    def _extend_hashes(self, s: SeqCache, token_ids: Sequence[int], num_blocks: int) -> None:
        if not self.caching or num_blocks <= len(s.hashes):
            return
        B = self.block_size
        start = len(s.hashes) * B
        parent = s.hashes[-1] if s.hashes else None
        s.hashes.extend(block_hashes(token_ids[start : num_blocks * B], B, s.salt, parent=parent))

    # ================================================================== admission
    def admit(self, seq_id: Hashable, hit: PrefixHit, num_new: int) -> Admission:
        """Take a slot, the hit's pages and snapshot, and pages for ``num_new`` more tokens.

        Args:
            seq_id: a waiting sequence.
            hit: from :meth:`match` with nothing allocated in between (or ``PrefixHit(0)``:
                no reuse, e.g. the decode side's ``reserve``).
            num_new: tokens of the first chunk (pages are allocated to cover them).

        Returns:
            :class:`Admission`: the engine loads ``load_snapshot`` into ``slot`` (or zeroes it).

        Raises:
            ValueError: already admitted, or ``hit`` went stale (its pages were evicted).
            CacheFullError: not enough memory (check :meth:`can_admit` first); nothing is taken.
        """
        s = self._seq(seq_id)
        if s.slot is not None:
            raise ValueError(f"seq {seq_id!r}: already admitted")
        if hit.num_tokens:
            ok = (
                all(self.index.page_of(h) == p for h, p in zip(hit.hashes, hit.pages, strict=True))
                and self.index.snapshot_of(hit.hashes[-1]) == hit.snapshot
            )
            if not ok:
                raise ValueError(f"seq {seq_id!r}: stale prefix hit (call match again)")
        if not self.can_admit(seq_id, hit, num_new):
            raise CacheFullError(
                f"seq {seq_id!r}: no slot or pages for {hit.num_tokens + num_new} tokens"
            )
        for p in hit.pages:
            self.pages.incref(p)
        if hit.snapshot is not None:
            self.snapshots.incref(hit.snapshot)
        s.slot = self.slots.allocate()
        s.block_table = list(hit.pages)
        s.num_computed = s.num_cached = hit.num_tokens
        s.num_registered = len(hit.pages)
        s.load_snapshot = hit.snapshot
        s.plan = self._plan(s, hit.num_tokens)
        self._grow(s, hit.num_tokens + num_new)
        if self.caching and s.lookup:
            s.lookup = False  # a re-admission (after preemption) is not a new query
            self.stats.num_queries += 1
            self.stats.query_tokens += s.num_prompt
            self.stats.hit_tokens += hit.num_tokens
        return Admission(s.slot, hit.snapshot, hit.num_tokens)

    # ================================================================== running
    def allocate(self, seq_id: Hashable, num_new: int) -> None:
        """Grow the block table to cover ``num_computed + num_new`` tokens.

        Raises:
            ValueError: not admitted.
            CacheFullError: not enough pages (nothing is taken).
        """
        s = self._seq(seq_id)
        if s.slot is None:
            raise ValueError(f"seq {seq_id!r}: not admitted")
        self._grow(s, s.num_computed + num_new)

    def _grow(self, s: SeqCache, num_tokens: int) -> None:
        need = self._pages_needed(s, num_tokens)
        if need > self.pages.num_free:
            raise CacheFullError(f"need {need} pages, {self.pages.num_free} free")
        for _ in range(need):
            s.block_table.append(self.pages.allocate())

    def commit(
        self, seq_id: Hashable, token_ids: Sequence[int], num_new: int
    ) -> list[SnapshotSave]:
        """Record that a forward computed ``num_new`` more tokens of the sequence.

        Indexes the blocks that became full, and says which snapshots to take now.

        Args:
            seq_id: an admitted sequence.
            token_ids: all its known tokens (at least ``num_computed + num_new``).
            num_new: tokens the forward computed (their latents and state are written).

        Returns:
            Snapshot copies for the engine to apply now, in order.

        Raises:
            ValueError: not admitted; the block table or ``token_ids`` is too short.
        """
        s = self._seq(seq_id)
        if s.slot is None:
            raise ValueError(f"seq {seq_id!r}: not admitted")
        nc = s.num_computed + num_new
        if num_new < 0 or nc > len(s.block_table) * self.block_size or nc > len(token_ids):
            raise ValueError(
                f"num_new: {num_new} tokens past {s.num_computed} exceed the block table "
                f"({len(s.block_table)} pages) or token_ids ({len(token_ids)})"
            )
        s.num_computed = nc
        if s.load_snapshot is not None:  # loaded before this forward: unpin
            self.snapshots.decref(s.load_snapshot)
            s.load_snapshot = None
        saves: list[SnapshotSave] = []
        if not self.caching:
            return saves
        B = self.block_size
        full = nc // B
        if full > s.num_registered:
            self._extend_hashes(s, token_ids, full)
            self.index.register_blocks(
                s.hashes[s.num_registered : full], s.block_table[s.num_registered : full]
            )
            s.num_registered = full
        while s.plan and s.plan[0] <= nc:
            p = s.plan.pop(0)
            if p == nc:
                self._save(s, p, saves)
            else:
                self.stats.snapshots_missed += 1
        p0 = (s.num_prompt - 1) // B * B
        if (
            s.snapshot_on_finish
            and nc % B == 0
            and nc > p0
            and not self.index.has_snapshot(s.hashes[full - 1])
        ):
            if s.rolling is None:
                if self._num_rolling >= self.config.max_rolling_snapshots:
                    self.stats.rolling_skipped += 1  # leave the rest to prompt snapshots
                elif self.snapshots.can_allocate():
                    s.rolling = self.snapshots.allocate()
                    self._num_rolling += 1
            if s.rolling is not None:
                s.rolling_pos = nc
                saves.append(SnapshotSave(s.slot, s.rolling, nc))
        return saves

    def _save(self, s: SeqCache, pos: int, saves: list[SnapshotSave]) -> None:
        h = s.hashes[pos // self.block_size - 1]
        if self.index.has_snapshot(h):
            return
        if not self.snapshots.can_allocate():
            self.stats.snapshots_skipped += 1
            return
        snap = self.snapshots.allocate()
        self.index.register_snapshot(h, snap)
        self.snapshots.decref(snap)  # unreferenced + cached: LRU
        saves.append(SnapshotSave(s.slot, snap, pos))  # type: ignore[arg-type]
        self.stats.snapshots_saved += 1

    # ================================================================== n > 1
    def fork(self, parent_id: Hashable, child_id: Hashable) -> ForkPlan:
        """Register ``child_id`` as a copy of an admitted parent (another choice, ``n > 1``).

        Full blocks of ``[0, num_computed)`` are shared (ref count +1); the partial last block
        gets a fresh page to copy into; the state is copied into a fresh slot.

        Returns:
            :class:`ForkPlan` for the engine's copies.

        Raises:
            ValueError: ``child_id`` taken, parent not admitted or its snapshot not loaded yet.
            CacheFullError: no slot or page (check :meth:`can_fork`).
        """
        s = self._seq(parent_id)
        if child_id in self._seqs:
            raise ValueError(f"seq_id: {child_id!r} already registered")
        if s.slot is None or s.load_snapshot is not None:
            raise ValueError(f"seq {parent_id!r}: fork needs an admitted, committed parent")
        if not self.can_fork(parent_id):
            raise CacheFullError(f"seq {parent_id!r}: no slot/page to fork")
        B, nc = self.block_size, s.num_computed
        full = nc // B
        c = SeqCache(
            s.salt, s.num_prompt, (), s.snapshot_on_finish, False, False, hashes=list(s.hashes)
        )
        c.block_table = s.block_table[:full]
        for p in c.block_table:
            self.pages.incref(p)
        copies: tuple[tuple[int, int], ...] = ()
        if nc % B:
            dst = self.pages.allocate()
            copies = ((s.block_table[full], dst),)
            c.block_table.append(dst)
        c.slot = self.slots.allocate()
        c.num_computed, c.num_cached = nc, s.num_cached
        c.num_registered = min(s.num_registered, full)
        self._seqs[child_id] = c
        return ForkPlan(s.slot, c.slot, copies)

    # ================================================================== ending
    def finish(self, seq_id: Hashable) -> int | None:
        """End a sequence normally: index its end-of-request snapshot, free and forget it.

        Returns:
            The position of the end-of-request snapshot when one was indexed, else ``None``.
        """
        s = self._seq(seq_id)
        pos = None
        if s.rolling is not None and s.slot is not None:
            q = s.num_computed // self.block_size * self.block_size
            if (
                s.rolling_pos == q
                and q > 0
                and self.index.register_snapshot(s.hashes[q // self.block_size - 1], s.rolling)
            ):
                pos = q
                self.stats.end_snapshots += 1
        self.remove(seq_id)
        return pos

    def run_prefill(
        self,
        seq_id: Hashable,
        token_ids: Sequence[int],
        cache_salt: str | None = None,
        snapshot_at: Iterable[int] = (),
    ) -> int:
        """The cache bookkeeping of one whole prefill-only request, without tensors: register,
        look up the prefix, admit, then commit the rest in chunks that end at the snapshot
        points (as the engine's chunked prefill does), and finish.

        For the simulator and the fake workers of the tests: what a prefill worker's cache
        holds afterwards is what a real one would hold.

        Args:
            seq_id: unique id.
            token_ids: ``[L]`` prompt tokens.
            cache_salt: tenant salt.
            snapshot_at: extra snapshot positions (tokens), as in :meth:`add`.

        Returns:
            The reused prefix in tokens (the request's ``cached_tokens``).

        Raises:
            CacheFullError: the pools cannot hold the request.
        """
        self.add(seq_id, token_ids, cache_salt=cache_salt, snapshot_at=snapshot_at,
                 snapshot_on_finish=False)
        hit = self.match(seq_id)
        first = hit.chunk_end - hit.num_tokens
        self.admit(seq_id, hit, first)
        self.commit(seq_id, token_ids, first)
        while self.num_computed(seq_id) < len(token_ids):
            n = self.chunk_end(seq_id) - self.num_computed(seq_id)
            self.allocate(seq_id, n)
            self.commit(seq_id, token_ids, n)
        self.finish(seq_id)
        return hit.num_tokens

    def release(self, seq_id: Hashable) -> None:
        """Free every page, slot and snapshot the sequence holds; keep it registered (preempted).

        Pages go back in reverse order, so a prefix's deeper blocks are evicted before its
        first ones. Computed full blocks stay indexed (reusable on re-admission).
        """
        s = self._seq(seq_id)
        for p in reversed(s.block_table):
            self.pages.decref(p)
        if s.slot is not None:
            self.slots.free(s.slot)
        if s.load_snapshot is not None:
            self.snapshots.decref(s.load_snapshot)
        if s.rolling is not None:
            self.snapshots.decref(s.rolling)
            self._num_rolling -= 1
        s.block_table, s.slot, s.load_snapshot, s.rolling = [], None, None, None
        s.num_computed = s.num_cached = s.num_registered = s.rolling_pos = 0
        s.plan = []

    def remove(self, seq_id: Hashable) -> None:
        """Release and forget a sequence (abort, or the end of :meth:`finish`)."""
        self.release(seq_id)
        del self._seqs[seq_id]

    def reset_prefix_cache(self) -> int:
        """Forget every unreferenced cached block and snapshot (``removed`` events follow).

        Returns:
            Entries forgotten.
        """
        return self.index.clear()


__all__ = ["CacheFullError", "CacheManager"]
