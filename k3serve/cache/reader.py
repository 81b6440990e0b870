"""The read side of one worker's cache: its state and every query that changes nothing.

:class:`CacheReader` owns the pools' ids, the prefix index, the event log and the per-sequence
entries (:class:`SeqCache`); it answers the scheduler's predicates (:meth:`~CacheReader.match`,
:meth:`~CacheReader.can_admit`, :meth:`~CacheReader.can_allocate`, :meth:`~CacheReader.can_fork`,
:meth:`~CacheReader.chunk_end`), a connector's questions (:meth:`~CacheReader.block_table`,
:meth:`~CacheReader.slot`, :meth:`~CacheReader.can_reserve`) and the router feeds
(:meth:`~CacheReader.cache_state`, :meth:`~CacheReader.events_since`).
:class:`~k3serve.cache.manager.CacheManager` adds the writes; code that must only look (a
connector, ``LLMEngine.cache``) is typed against this class. Pure Python, no torch.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

from k3serve.cache.allocator import RefPool, SlotPool
from k3serve.cache.events import EventLog, make_state
from k3serve.cache.hashing import block_hashes, make_salt
from k3serve.cache.prefix import PrefixIndex, log_snapshot_points, max_hit_blocks
from k3serve.cache.specs import CacheConfig
from k3serve.cache.types import CacheStats, CacheUsage, PrefixHit


@dataclass
class SeqCache:
    """One sequence's cache bookkeeping (the manager's entry under its ``seq_id``)."""

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


class CacheReader:
    """Pools, prefix index, event log and per-sequence entries of one worker, read-only.

    Args:
        config: capacities and policy.
        fingerprint: the layout fingerprint (hash salt base; ``specs.layout_fingerprint``).
        log: event log (a fresh one when ``None``).

    Attributes:
        log: the :class:`EventLog` (``/internal/cache_events``).
        index: the :class:`PrefixIndex` (block hash → page, boundary hash → snapshot).
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
        self._seqs: dict[Hashable, SeqCache] = {}
        self._num_rolling = 0  # sequences holding a rolling snapshot

    # ================================================================== per sequence
    def has(self, seq_id: Hashable) -> bool:
        return seq_id in self._seqs

    def _seq(self, seq_id: Hashable) -> SeqCache:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise ValueError(f"seq_id: {seq_id!r} is not registered") from None

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

    # ================================================================== predicates
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

    def _plan(self, s: SeqCache, hit: int) -> list[int]:
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

    def _pages_needed(self, s: SeqCache, num_tokens: int) -> int:
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

    def can_fork(self, seq_id: Hashable) -> bool:
        """Whether a slot (and a page for a partial last block) are available for a child."""
        s = self._seq(seq_id)
        partial = 1 if s.num_computed % self.block_size else 0
        return self.slots.can_allocate() and self.pages.can_allocate(partial)

    def can_reserve(self, num_tokens: int) -> bool:
        """Whether a free slot and pages for ``num_tokens`` tokens exist now (a decode-side
        reservation; LRU-cached pages count as free)."""
        return self.slots.can_allocate() and self.pages.can_allocate(
            -(-num_tokens // self.block_size)
        )

    # ================================================================== prompts not registered
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

    # ================================================================== pools and feeds
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


__all__ = ["CacheReader", "SeqCache"]
