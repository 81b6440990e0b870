"""Cache events (pull model, INTERFACES.md §4): the worker's log and the reader's index.

Worker side, :class:`EventLog`: every change of the prefix index appends one event numbered by
``(epoch, seq)``; ``epoch`` is a fresh uuid per log (per worker start), ``seq`` counts from 1::

    {"seq": 41, "type": "stored",  "block_hashes": ["..", ".."], "snapshot": false}
    {"seq": 42, "type": "removed", "block_hashes": [".."],       "snapshot": true}

``snapshot: false`` names MLA blocks; ``snapshot: true`` names the boundary (hash of the block
before it) where a KDA snapshot was stored / removed. ``GET /internal/cache_events?after=SEQ``
serves :meth:`EventLog.since`; ``GET /internal/cache_state`` serves the cache's full dump
``{"epoch", "last_seq", "blocks", "snapshots"}``.

Reader side, :class:`EventIndex` (the router keeps one per worker): replays events; on a new
epoch or a gap in ``seq`` it reloads the full dump. Pure Python, no torch.
"""

from __future__ import annotations

import uuid
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from k3serve.cache.prefix import max_hit_blocks, usable_prefix_blocks

EVENT_TYPES = ("stored", "removed")


class EventLog:
    """Append-only, bounded log of cache events.

    Args:
        max_events: events kept; older ones are dropped (a reader that falls behind them
            sees a gap and reloads the dump).
        epoch: log identity; a new uuid4 hex when ``None``.

    Attributes:
        epoch, last_seq: as above; ``last_seq`` is the newest event's ``seq`` (0: none yet).
        events: the kept events, oldest first (their ``seq`` runs up to ``last_seq``).

    Raises:
        ValueError: ``max_events`` < 1.
    """

    def __init__(self, max_events: int = 100_000, epoch: str | None = None):
        if max_events < 1:
            raise ValueError(f"max_events: must be ≥ 1, got {max_events}")
        self.epoch = epoch or uuid.uuid4().hex
        self.last_seq = 0
        self.events: deque[dict[str, Any]] = deque(maxlen=max_events)

    def append(
        self, type_: str, block_hashes: Sequence[str], snapshot: bool, source: str = "local"
    ) -> int:
        """Log one event (``source="store"``: put into the shared store by this worker; the
        event then carries ``"source": "store"``, and readers of the worker's own content skip
        it).

        Returns:
            Its ``seq``.

        Raises:
            ValueError: unknown type or empty ``block_hashes``.
        """
        if type_ not in EVENT_TYPES:
            raise ValueError(f"type: must be one of {EVENT_TYPES}, got {type_!r}")
        if not block_hashes:
            raise ValueError("block_hashes: empty")
        if source not in ("local", "store"):
            raise ValueError(f"source: 'local' or 'store', got {source!r}")
        self.last_seq += 1
        ev: dict[str, Any] = {
            "seq": self.last_seq,
            "type": type_,
            "block_hashes": list(block_hashes),
            "snapshot": bool(snapshot),
        }
        if source == "store":
            ev["source"] = "store"
        self.events.append(ev)
        return self.last_seq

    def since(self, after: int = 0, limit: int | None = None) -> dict[str, Any]:
        """Events with ``seq > after`` (the ``/internal/cache_events`` body).

        Args:
            after: last ``seq`` the reader applied (0: from the start).
            limit: at most this many events (oldest first); ``None``: all.

        Returns:
            ``{"epoch", "last_seq", "events"}``; ``last_seq`` is the log's newest ``seq`` (more
            may follow ``events`` when ``limit`` cut them). When ``after`` is older than the
            oldest kept event, the events start later than ``after + 1``: the reader sees the gap.
        """
        first = self.last_seq - len(self.events) + 1  # seq of events[0]
        start = max(0, after + 1 - first)
        stop = len(self.events) if limit is None else min(len(self.events), start + max(0, limit))
        events = (
            [dict(self.events[i]) for i in range(start, stop)] if start < len(self.events) else []
        )
        return {"epoch": self.epoch, "last_seq": self.last_seq, "events": events}


class EventIndex:
    """A reader's copy of one worker's cache content, kept by replaying its events.

    Attributes:
        epoch: worker log epoch this copy follows (``None`` before the first sync).
        last_seq: last applied ``seq``.
        blocks: block hashes with cached MLA latents.
        snapshots: boundary hashes with a KDA snapshot.
    """

    def __init__(self) -> None:
        self.epoch: str | None = None
        self.last_seq = 0
        self.blocks: set[str] = set()
        self.snapshots: set[str] = set()

    def apply(self, batch: Mapping[str, Any]) -> bool:
        """Apply a ``/internal/cache_events`` body.

        Returns:
            True when applied (or nothing new); False when the body is from another epoch or
            its events do not continue at ``last_seq + 1`` — the index is then unchanged and
            the caller must :meth:`load_state` from the full dump.

        Raises:
            ValueError: a malformed event (unknown type, missing fields).
        """
        if batch.get("epoch") != self.epoch:
            return False
        events = list(batch.get("events") or [])
        expect = self.last_seq + 1
        for ev in events:
            if int(ev["seq"]) < expect:  # already applied (overlapping read): skip
                continue
            if int(ev["seq"]) != expect:
                return False
            expect += 1
        if not events and int(batch.get("last_seq", self.last_seq)) > self.last_seq:
            return False  # the worker moved on but sent nothing: events were dropped
        for ev in events:
            if int(ev["seq"]) <= self.last_seq:
                continue
            self._apply_event(ev)
            self.last_seq = int(ev["seq"])
        return True

    def _apply_event(self, ev: Mapping[str, Any]) -> None:
        t = ev.get("type")
        if t not in EVENT_TYPES or "block_hashes" not in ev:
            raise ValueError(f"event: malformed {dict(ev)!r}")
        if ev.get("source", "local") == "store":  # the shared store's content, not the worker's
            return
        target = self.snapshots if ev.get("snapshot") else self.blocks
        if t == "stored":
            target.update(ev["block_hashes"])
        else:
            target.difference_update(ev["block_hashes"])

    def load_state(self, state: Mapping[str, Any]) -> None:
        """Replace the content with a ``/internal/cache_state`` dump.

        Raises:
            ValueError: the dump lacks ``epoch`` or ``last_seq``.
        """
        if "epoch" not in state or "last_seq" not in state:
            raise ValueError("cache_state: needs 'epoch' and 'last_seq'")
        self.epoch = state["epoch"]
        self.last_seq = int(state["last_seq"])
        self.blocks = set(state.get("blocks") or ())
        self.snapshots = set(state.get("snapshots") or ())

    def sync(
        self,
        fetch_events: Callable[[int], Mapping[str, Any]],
        fetch_state: Callable[[], Mapping[str, Any]],
    ) -> bool:
        """Pull once: events after ``last_seq``, or the full dump on a new epoch or a gap.

        Args:
            fetch_events: ``after -> /internal/cache_events`` body.
            fetch_state: ``() -> /internal/cache_state`` body.

        Returns:
            True when the full dump was loaded.
        """
        if self.epoch is not None and self.apply(fetch_events(self.last_seq)):
            return False
        self.load_state(fetch_state())
        # events logged between the dump and now arrive on the next sync
        return True

    # ------------------------------------------------------------------ queries
    def has_block(self, h: str) -> bool:
        return h in self.blocks

    def has_snapshot(self, h: str) -> bool:
        return h in self.snapshots

    def match(self, hashes: Sequence[str], prompt_len: int, block_size: int) -> int:
        """Predicted reusable tokens of a prompt on this worker (same rule as the worker).

        Args:
            hashes: ``block_hashes(prompt, block_size, salt)``.
            prompt_len: ``L`` in tokens.
            block_size: the worker's ``B``.

        Returns:
            Tokens: a multiple of ``B``, at most ``⌊(L-1)/B⌋·B``.
        """
        cap = max_hit_blocks(prompt_len, block_size)
        return usable_prefix_blocks(hashes, cap, self.has_block, self.has_snapshot) * block_size

    def content(self) -> tuple[frozenset[str], frozenset[str]]:
        """``(blocks, snapshots)`` as frozen sets (for comparisons)."""
        return frozenset(self.blocks), frozenset(self.snapshots)


def make_state(
    epoch: str, last_seq: int, blocks: Iterable[str], snapshots: Iterable[str]
) -> dict[str, Any]:
    """A ``/internal/cache_state`` body (lists sorted, so dumps compare equal)."""
    return {
        "epoch": epoch,
        "last_seq": last_seq,
        "blocks": sorted(blocks),
        "snapshots": sorted(snapshots),
    }


__all__ = ["EVENT_TYPES", "EventIndex", "EventLog", "make_state"]
