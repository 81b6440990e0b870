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
from dataclasses import dataclass, field
from typing import Any

from k3serve.cache.allocator import CacheFullError, RefPool, SlotPool
from k3serve.cache.events import EventLog, make_state
from k3serve.cache.hashing import block_hashes, make_salt
from k3serve.cache.prefix import PrefixIndex, log_snapshot_points, max_hit_blocks
from k3serve.cache.specs import CacheConfig


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
    """Ids taken for a prefix fetched from the shared store (:meth:`CacheManager.begin_import`).

    The engine copies the fetched bytes into ``pages`` / ``snapshot``, then calls
    :meth:`CacheManager.end_import` (index them) or :meth:`CacheManager.abort_import`.

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


@dataclass
class _Seq:
    salt: str
    num_prompt: int  # L: tokens known at (re)admission; caps the hit, sets p0
    snapshot_at: tuple[int, ...]
    snapshot_on_finish: bool
    plan_snapshots: bool = True
    lookup: bool = True  # its first admission counts as a prefix-cache query
    hashes: list[str] = field(default_factory=list)  # full blocks known so far
    block_table: list[int] = field(default_factory=list)
    slot: int | None = None
    num_computed: int = 0
    num_cached: int = 0
    num_registered: int = 0  # leading blocks already offered to the index
    load_snapshot: int | None = None  # pinned until the first commit
    plan: list[int] = field(default_factory=list)  # pending snapshot positions, ascending
    rolling: int | None = None
    rolling_pos: int = 0


class CacheManager:
    """Allocator + prefix index + per-sequence bookkeeping of one worker.

    Args:
        config: capacities and policy.
        fingerprint: the layout fingerprint (hash salt base; ``specs.layout_fingerprint``).
        log: event log (a fresh one when ``None``).

    Attributes:
        log: the :class:`EventLog` (``/internal/cache_events``).
        stats: :class:`CacheStats`.
    """

    def __init__(self, config: CacheConfig, fingerprint: str, log: EventLog | None = None):
        make_salt(fingerprint)  # validates
        self.config = config
        self.block_size = config.block_size
        self.fingerprint = fingerprint
        self.caching = config.enable_prefix_caching
        self.pages = RefPool(config.num_pages, "page")
        self.snapshots = RefPool(config.num_snapshots, "snapshot")
        self.slots = SlotPool(config.num_slots)
        self.log = log if log is not None else EventLog()
        self.index = PrefixIndex(self.pages, self.snapshots, self.log)
        self.stats = CacheStats()
        self._seqs: dict[Hashable, _Seq] = {}
        self._num_rolling = 0  # sequences holding a rolling snapshot

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
        s = _Seq(
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

    def has(self, seq_id: Hashable) -> bool:
        return seq_id in self._seqs

    def _seq(self, seq_id: Hashable) -> _Seq:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise ValueError(f"seq_id: {seq_id!r} is not registered") from None

    def _extend_hashes(self, s: _Seq, token_ids: Sequence[int], num_blocks: int) -> None:
        if not self.caching or num_blocks <= len(s.hashes):
            return
        B = self.block_size
        start = len(s.hashes) * B
        parent = s.hashes[-1] if s.hashes else None
        s.hashes.extend(block_hashes(token_ids[start : num_blocks * B], B, s.salt, parent=parent))

    # ================================================================== admission
    def match(self, seq_id: Hashable) -> PrefixHit:
        """The usable prefix hit for a waiting sequence now (read-only).

        Returns:
            :class:`PrefixHit`; ``num_tokens ≤ ⌊(L-1)/B⌋·B``.
        """
        s = self._seq(seq_id)
        if s.slot is not None:
            raise ValueError(f"seq {seq_id!r}: already admitted")
        j, pages, snap = 0, [], None
        if self.caching:
            j, pages, snap = self.index.match(
                s.hashes, max_hit_blocks(s.num_prompt, self.block_size)
            )
        hit = j * self.block_size
        plan = self._plan(s, hit)
        return PrefixHit(
            hit, tuple(pages), snap, tuple(s.hashes[:j]), plan[0] if plan else s.num_prompt
        )

    def lookup(self, token_ids: Sequence[int], cache_salt: str | None = None) -> int:
        """Reusable tokens for a prompt that is not registered (read-only; metrics, tests)."""
        if not self.caching or len(token_ids) == 0:
            return 0
        cap = max_hit_blocks(len(token_ids), self.block_size)
        hashes = block_hashes(
            token_ids[: cap * self.block_size],
            self.block_size,
            make_salt(self.fingerprint, cache_salt),
        )
        return self.index.match(hashes, cap)[0] * self.block_size

    def _plan(self, s: _Seq, hit: int) -> list[int]:
        """Snapshot positions in ``(hit, L]`` for this admission, ascending."""
        if not self.caching or self.config.num_snapshots == 0 or not s.plan_snapshots:
            return []
        B, L = self.block_size, s.num_prompt
        p0 = (L - 1) // B * B
        pts = {p0} if p0 > 0 else set()
        pts.update(q for q in (p // B * B for p in s.snapshot_at) if 0 < q <= L)
        k = self.config.snapshot_interval_blocks
        if k:
            pts.update(range(k * B, p0 + 1, k * B))
        pts.update(log_snapshot_points(p0, B, self.config.dense_snapshot_blocks))
        return sorted(q for q in pts if q > hit)

    def _pages_needed(self, s: _Seq, num_tokens: int) -> int:
        return max(0, -(-num_tokens // self.block_size) - len(s.block_table))

    def can_admit(self, seq_id: Hashable, hit: PrefixHit, num_new: int) -> bool:
        """Whether :meth:`admit` would find a slot and pages for ``hit + num_new`` tokens.

        Hit pages that now sit in the LRU stop being evictable once taken: not counted free.
        """
        s = self._seq(seq_id)
        if not self.slots.can_allocate():
            return False
        need = max(0, -(-(hit.num_tokens + num_new) // self.block_size) - len(hit.pages))
        reclaimed = sum(1 for p in hit.pages if self.pages.in_lru(p))
        return s.slot is None and need <= self.pages.num_free - reclaimed

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

    # ================================================================== shared store
    def prefix_hashes(
        self, token_ids: Sequence[int], cache_salt: str | None = None
    ) -> tuple[list[str], int]:
        """Hashes of a prompt's reusable blocks and the cap (read-only; store lookups).

        Returns:
            ``(hashes of the first ⌊(L-1)/B⌋ blocks, that cap)``; ``([], 0)`` without caching.
        """
        if not self.caching or len(token_ids) == 0:
            return [], 0
        cap = max_hit_blocks(len(token_ids), self.block_size)
        salt = make_salt(self.fingerprint, cache_salt)
        return block_hashes(token_ids[: cap * self.block_size], self.block_size, salt), cap

    def begin_import(
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

    def end_import(self, plan: ImportPlan) -> None:
        """Index an import whose bytes the engine has written (``stored`` events follow); the
        new entries become unreferenced cached (LRU), deepest first to go."""
        if plan.pages:
            self.index.register_blocks([h for h, _ in plan.pages], [p for _, p in plan.pages])
        if plan.snapshot is not None:
            self.index.register_snapshot(*plan.snapshot)
        self._unpin(plan)

    def abort_import(self, plan: ImportPlan) -> None:
        """Give an import's ids back without indexing them (a fetch failed)."""
        self._unpin(plan)

    def _unpin(self, plan: ImportPlan) -> None:
        for p in reversed(plan.order):
            self.pages.decref(p)
        if plan.snapshot is not None:
            self.snapshots.decref(plan.snapshot[1])
        if plan.pinned_snapshot is not None:
            self.snapshots.decref(plan.pinned_snapshot)

    # ================================================================== running
    def chunk_end(self, seq_id: Hashable) -> int:
        """The next prefill chunk must end at or before this position.

        Returns:
            The next pending snapshot point, else the prompt length ``L``.
        """
        s = self._seq(seq_id)
        return s.plan[0] if s.plan else s.num_prompt

    def can_allocate(self, seq_id: Hashable, num_new: int) -> bool:
        """Whether pages for ``num_new`` more tokens (past ``num_computed``) are available."""
        s = self._seq(seq_id)
        return self._pages_needed(s, s.num_computed + num_new) <= self.pages.num_free

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

    def _grow(self, s: _Seq, num_tokens: int) -> None:
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

    def _save(self, s: _Seq, pos: int, saves: list[SnapshotSave]) -> None:
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
    def can_fork(self, seq_id: Hashable) -> bool:
        """Whether a slot (and a page for a partial last block) are available for a child."""
        s = self._seq(seq_id)
        partial = 1 if s.num_computed % self.block_size else 0
        return self.slots.can_allocate() and self.pages.can_allocate(partial)

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
        c = _Seq(
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

    # ================================================================== views
    def block_table(self, seq_id: Hashable) -> tuple[int, ...]:
        """Pages of the sequence, ``block_table[i]`` covers positions ``[i·B, (i+1)·B)``."""
        return tuple(self._seq(seq_id).block_table)

    def slot(self, seq_id: Hashable) -> int | None:
        return self._seq(seq_id).slot

    def num_computed(self, seq_id: Hashable) -> int:
        """Tokens whose latents and state are in the cache."""
        return self._seq(seq_id).num_computed

    def num_cached(self, seq_id: Hashable) -> int:
        """Tokens reused from the prefix cache at the last admission."""
        return self._seq(seq_id).num_cached

    def num_prompt(self, seq_id: Hashable) -> int:
        return self._seq(seq_id).num_prompt

    def seq_ids(self) -> list[Hashable]:
        return list(self._seqs)

    def usage(self) -> CacheUsage:
        return CacheUsage(
            self.pages.num_ids,
            self.pages.num_used,
            self.pages.num_cached_free,
            self.slots.num_slots,
            self.slots.num_used,
            self.snapshots.num_ids,
            self.snapshots.num_used,
            self.snapshots.num_cached_free,
        )

    def cache_state(self) -> dict[str, Any]:
        """``/internal/cache_state`` body: epoch, last_seq, indexed blocks and snapshots."""
        return make_state(
            self.log.epoch,
            self.log.last_seq,
            self.index.block_hashes(),
            self.index.snapshot_hashes(),
        )

    def events_since(self, after: int = 0, limit: int | None = None) -> dict[str, Any]:
        """``/internal/cache_events`` body (see :meth:`EventLog.since`)."""
        return self.log.since(after, limit)

    def check(self) -> None:
        """Full consistency check (tests): pools, index, and ref counts == references held.

        Raises:
            AssertionError: a bookkeeping bug.
        """
        self.pages.check()
        self.snapshots.check()
        self.index.check()
        rolling = sum(1 for s in self._seqs.values() if s.rolling is not None)
        if rolling != self._num_rolling or rolling > self.config.max_rolling_snapshots:
            raise AssertionError(
                f"rolling snapshots: {rolling} held, {self._num_rolling} counted, "
                f"cap {self.config.max_rolling_snapshots}"
            )
        page_refs = [0] * self.pages.num_ids
        snap_refs = [0] * self.snapshots.num_ids
        slots = set()
        for s in self._seqs.values():
            for p in s.block_table:
                page_refs[p] += 1
            for x in (s.load_snapshot, s.rolling):
                if x is not None:
                    snap_refs[x] += 1
            if s.slot is not None:
                if s.slot in slots:
                    raise AssertionError(f"slot {s.slot} held twice")
                slots.add(s.slot)
        for i, r in enumerate(page_refs):
            if self.pages.ref_count(i) != r:
                raise AssertionError(f"page {i}: ref {self.pages.ref_count(i)} != {r} held")
        for i, r in enumerate(snap_refs):
            if self.snapshots.ref_count(i) != r:
                raise AssertionError(f"snapshot {i}: ref {self.snapshots.ref_count(i)} != {r} held")
        if slots != {i for i in range(self.slots.num_slots) if self.slots.is_used(i)}:
            raise AssertionError("slots in use differ from slots held")


__all__ = [
    "Admission",
    "CacheFullError",
    "CacheManager",
    "CacheStats",
    "CacheUsage",
    "ForkPlan",
    "ImportPlan",
    "PrefixHit",
    "SnapshotSave",
]
