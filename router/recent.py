"""The router's record of where it just sent prompts (pending prefix hits, own-chain load).

Placement reads the global index (:mod:`router.index`) for what every worker caches; this
module covers the gap between sending a prompt and that worker's cache events reporting it
(:class:`RecentPlacements`). Plain bookkeeping: no I/O, no clock of its own.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple

from router.index import PrefixMatch


class RecentPlacement(NamedTuple):
    """One prompt the router sent to a worker (an entry of :class:`RecentPlacements`).

    Attributes:
        worker_id: Where it went.
        hashes: Its chained block hashes (full blocks only), in order.
        snapshot_blocks: Boundaries (blocks, ascending, each ≥ 1) where the worker keeps a
            KDA snapshot once it has computed the prompt: the prompt end ``⌊(L−1)/B⌋`` and
            the placement's ``snapshot_at`` (tokens ÷ B).
        tokens: Uncached prompt tokens it was sent to compute (the placement's prediction).
        at: When it was sent, seconds on the caller's clock.
    """

    worker_id: str
    hashes: tuple[str, ...]
    snapshot_blocks: tuple[int, ...]
    tokens: float
    at: float


class RecentPlacements:
    """Where the router just sent prompts, before the workers' cache events report them.

    A prompt sent to a worker is computed and cached there a prefill later, and the index
    learns of it only from that worker's cache events (the prefill's answer or the next
    poll). Until then a prompt that extends it — an agent's next step, a repeat — would see
    no holder and be placed blind. This record answers for that gap, from the router's own
    sends::

        send P to w ──record(w, P)──▶  match(P+x) → w: usable at P's end (a pending hit)
                                       extended(P+x) → w: P's uncached tokens, decayed

    Entries live ``ttl_s`` seconds after they were sent (long enough for the prefill and
    the events that report it; the index then holds the same blocks and the max of the two
    is what placement reads). A pending hit is a prediction: the worker may have evicted
    the blocks, or the prefill may fail; the worker computes what it does not find.

    Chained hashes make every lookup a walk over the request's hashes: ``hashes[i]`` equal
    means the whole prefix up to block ``i`` is equal, so a worker holds the prefix up to
    the deepest ``i`` it recorded.

    Not thread-safe (the router's event loop). Cost: one dict probe per prompt block up to
    the deepest recorded one; memory: one entry per block of each live record.

    Args:
        ttl_s: Seconds an entry counts after it was sent (> 0).

    Raises:
        ValueError: ``ttl_s`` ≤ 0.
    """

    def __init__(self, ttl_s: float = 30.0) -> None:
        if not ttl_s > 0:
            raise ValueError(f"ttl_s: must be > 0, got {ttl_s!r}")
        self.ttl_s = float(ttl_s)
        self._entries: deque[RecentPlacement] = deque()
        self._blocks: dict[str, dict[str, int]] = {}  # hash → worker → records holding it
        self._snaps: dict[str, dict[str, int]] = {}  # hash before a boundary → same
        self._ends: dict[str, list[RecentPlacement]] = {}  # last full block's hash → records
        self._latest: dict[str, RecentPlacement] = {}  # worker → the last record sent there

    def __len__(self) -> int:
        return len(self._entries)

    def record(self, worker_id: str, hashes: Sequence[str], snapshot_blocks: Iterable[int],
               tokens: float, now: float) -> None:
        """Count a prompt as sent to ``worker_id`` at ``now``.

        Args:
            worker_id: The chosen worker.
            hashes: The prompt's chained block hashes.
            snapshot_blocks: Boundaries (blocks) it will snapshot; those outside
                ``[1, len(hashes)]`` are ignored.
            tokens: Uncached tokens it computes there (≥ 0).
            now: Seconds, non-decreasing across calls.
        """
        self.expire(now)
        if not hashes:  # nothing to reuse; still the worker's latest work
            self._latest.pop(worker_id, None)
            return
        hs = tuple(hashes)
        snaps = tuple(sorted({b for b in snapshot_blocks if 1 <= b <= len(hs)}))
        e = RecentPlacement(worker_id, hs, snaps, float(tokens), now)
        self._entries.append(e)
        for h in hs:
            _count(self._blocks, h, worker_id, 1)
        for b in snaps:
            _count(self._snaps, hs[b - 1], worker_id, 1)
        self._ends.setdefault(hs[-1], []).append(e)
        self._latest[worker_id] = e

    def expire(self, now: float) -> None:
        """Drop the entries sent more than ``ttl_s`` before ``now``."""
        q = self._entries
        while q and q[0].at < now - self.ttl_s:
            self._drop(q.popleft())

    def forget(self, worker_id: str, before: float | None = None) -> None:
        """Drop the entries of a worker (it left, or restarted with an empty cache).

        Args:
            worker_id: The worker.
            before: Drop only the entries sent before this time (seconds, the clock of
                :meth:`record`): those sent to the worker's previous process; ``None``: all.
        """
        keep: deque[RecentPlacement] = deque()
        for e in self._entries:
            if e.worker_id == worker_id and (before is None or e.at < before):
                self._drop(e)
            else:
                keep.append(e)
        self._entries = keep

    def _drop(self, e: RecentPlacement) -> None:
        for h in e.hashes:
            _count(self._blocks, h, e.worker_id, -1)
        for b in e.snapshot_blocks:
            _count(self._snaps, e.hashes[b - 1], e.worker_id, -1)
        if self._latest.get(e.worker_id) is e:
            del self._latest[e.worker_id]
        ends = self._ends[e.hashes[-1]]
        ends.remove(e)
        if not ends:
            del self._ends[e.hashes[-1]]

    def match(self, hashes: Sequence[str], max_blocks: int | None = None,
              now: float | None = None) -> dict[str, PrefixMatch]:
        """Pending prefix match of a prompt on every worker it was recently sent to.

        Args:
            hashes: The prompt's chained block hashes.
            max_blocks: Deepest boundary that may count as usable (blocks; ``⌊(L−1)/B⌋``).
            now: Seconds (``None``: no expiry first).

        Returns:
            ``worker_id → PrefixMatch(mla_blocks, usable_blocks)`` of the recorded prompts:
            MLA depth = deepest block of the prompt some record holds; usable = deepest
            recorded snapshot boundary within it and within ``max_blocks``.
        """
        if now is not None:
            self.expire(now)
        limit = len(hashes) if max_blocks is None else min(max_blocks, len(hashes))
        mla: dict[str, int] = {}
        usable: dict[str, int] = {}
        for i, h in enumerate(hashes):
            held = self._blocks.get(h)
            if not held:
                break
            for w in held:
                mla[w] = i + 1
            if i < limit:
                for w in self._snaps.get(h, ()):
                    usable[w] = i + 1
        return {w: PrefixMatch(d, usable.get(w, 0)) for w, d in mla.items()}

    def extended(self, hashes: Sequence[str], now: float, horizon_s: float,
                 rates: Mapping[str, float] | None = None) -> dict[str, float]:
        """Per worker, the decayed uncached tokens of the recent prompt this one extends.

        A record is extended when its whole chain is a prefix of ``hashes`` (equal included:
        a repeat). A worker answers only when the last prompt the router sent it is such a
        record (P, then P + a few tokens; an agent's previous step with nothing sent there
        since): then the work it did last is the prefix this prompt reuses.
        Its tokens decay as ``tokens · exp(−(now − at) / horizon_s)``, the decay of
        :class:`router.policies.load.RecentLoad`, so the figure is the part of that account
        (``util`` · rate · H) the computation of that prompt put there. With the worker's
        prefill rate given, the decay starts when that computation ended,
        ``at + tokens / rate``: an account fed from the worker's reports of computed tokens
        (:class:`router.policies.load.PoolLoad`) holds the prompt's tokens from then on
        (a long prefill on a slow worker ends many seconds after it was sent).

        Args:
            hashes: The prompt's chained block hashes.
            now: Seconds.
            horizon_s: The load account's time constant (> 0).
            rates: Prefill tokens/s by worker (> 0; a worker missing: decay from ``at``).
        """
        self.expire(now)
        out: dict[str, float] = {}
        for h in hashes:
            for e in self._ends.get(h, ()):
                if self._latest.get(e.worker_id) is e:
                    rate = rates.get(e.worker_id, 0.0) if rates else 0.0
                    done = e.at + (e.tokens / rate if rate > 0 else 0.0)
                    out[e.worker_id] = e.tokens * math.exp(-max(0.0, now - done) / horizon_s)
        return out


def _count(table: dict[str, dict[str, int]], h: str, worker_id: str, delta: int) -> None:
    """Add ``delta`` to ``table[h][worker_id]``, dropping entries that reach 0."""
    per = table.setdefault(h, {})
    n = per.get(worker_id, 0) + delta
    if n > 0:
        per[worker_id] = n
    else:
        per.pop(worker_id, None)
        if not per:
            del table[h]
