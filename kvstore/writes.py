"""The write side of one sender: which layer's cache is ready, which runs are in flight, what
landed — and the retries of failed writes (non-blocking; the budget is the sender's).

:class:`LayerWrites` is driven by :class:`kvstore.sender.KVSender`: the sender marks layers
ready (``mark``: one part per newly ready token range; with host staging its copy to the
mirror starts here), submits the parts that are ready once it knows the destination
(``submit_ready``) and collects completions (``check``). A layer is complete when its paged
tokens ``[0, num_tokens)`` and its slot state were marked and every write of it landed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvstore.descriptors import CacheRef, PoolLayout, Run, layer_runs
from kvstore.engine import KVEngine, TransferHandle
from kvstore.errors import TransferError
from kvstore.retry import RetryBudget

log = logging.getLogger(__name__)

_BAD_ADDR = 8  # never registered by anyone: a write there fails inside Mooncake (test hook)


@dataclass
class _Part:
    """Tokens ``[start, upto)`` of one layer (and its slot state when ``with_state``)."""

    layer: int
    start: int
    upto: int
    with_state: bool
    ready: Callable[[], bool] | None = None  # staging copy landed? (None: nothing to wait for)
    runs: list[Run] | None = None  # set at submission (needs the destination)
    handle: TransferHandle | None = None  # None: not submitted (yet)
    retry_at: float | None = None  # scheduled resubmission time (monotonic s)
    finished: bool = False


class LayerWrites:
    """Per-layer write progress of one request's cache.

    Args:
        layout: the sender's pool layout.
        src: the request's slot/pages there.
        engine: the process's :class:`KVEngine`.
        budget: the sender's retry budget (shared with pairing and the completion message).
        fail_first_n: test hook: the first n submissions go to an unregistered address and
            fail inside Mooncake.
        tag: log prefix.
        staging: the engine's host staging (:mod:`kvstore.staging`; default
            ``engine.staging``): each layer's bytes are copied device → pinned mirror when
            the layer is marked (on the marking thread's CUDA stream, so after the kernels
            that wrote it) and its writes are submitted once that copy landed; ``layout`` is
            then the mirror's.
    """

    def __init__(
        self,
        layout: PoolLayout,
        src: CacheRef,
        engine: KVEngine,
        budget: RetryBudget,
        fail_first_n: int = 0,
        tag: str = "",
        staging: Any = None,
    ) -> None:
        self.layout, self.src, self.engine, self.budget = layout, src, engine, budget
        self.staging = staging if staging is not None else getattr(engine, "staging", None)
        self.layers = layout.layers
        self._inject_left = int(fail_first_n)
        self._tag = tag
        self._marked: dict[int, int] = {}  # layer -> tokens marked ready (parts exist for them)
        self._state_marked: set[int] = set()
        self._parts: list[_Part] = []
        self.layer_bytes: dict[int, int] = {}  # layer -> bytes landed

    def mark(self, layer: int, upto_tokens: int | None = None) -> None:
        """Tokens ``[0, upto_tokens)`` of ``layer`` are final (default: all, and its state);
        with staging their device → mirror copy is enqueued now.

        Raises:
            ValueError: the layer has no cache in the layout; ``upto_tokens`` out of range.
        """
        if layer not in self.layers:
            raise ValueError(f"layer {layer} has no cache in this layout")
        n_total = self.src.num_tokens
        n = n_total if upto_tokens is None else int(upto_tokens)
        if not 0 <= n <= n_total:
            raise ValueError(f"upto_tokens {n} outside [0, {n_total}]")
        start = self._marked.get(layer, 0)
        with_state = n == n_total and layer not in self._state_marked
        if n <= start and not with_state:
            return
        upto = max(n, start)
        self._marked[layer] = upto
        if with_state:
            self._state_marked.add(layer)
        ready = None
        if self.staging is not None:
            ready = self.staging.stage_out(self.src, layer, start, upto, with_state)
        self._parts.append(_Part(layer, start, upto, with_state, ready))

    def mark_all(self) -> None:
        for l in self.layers:
            self.mark(l)

    def submit_ready(self, peer: str, dst_layout: PoolLayout, dst: CacheRef) -> bool:
        """Submit the writes of every marked part whose staging copy (if any) landed; True if
        any was submitted."""
        submitted = False
        for p in self._parts:
            if p.handle is not None or p.finished or (p.ready is not None and not p.ready()):
                continue
            p.ready = None
            p.runs = layer_runs(self.layout, self.src, dst_layout, dst, p.layer, p.start,
                                p.upto, with_state=p.with_state)
            if not p.runs:
                p.finished = True
                self.layer_bytes.setdefault(p.layer, 0)
                continue
            p.handle = self._submit(peer, p.runs)
            submitted = True
        return submitted

    def pending_staging(self) -> bool:
        """Some marked part waits for its device → mirror copy."""
        return any(p.ready is not None and not p.finished for p in self._parts)

    def _submit(self, peer: str, runs: list[Run]) -> TransferHandle:
        if self._inject_left > 0:
            self._inject_left -= 1
            r = runs[0]
            return self.engine.submit(peer, [(r.src, _BAD_ADDR, min(8, r.length))])
        return self.engine.submit(peer, runs)

    def check(self, now: float, peer: str, failing: bool) -> tuple[list[int], TransferError | None]:
        """Collect completions and resubmit failed writes whose backoff passed.

        Args:
            now: ``time.monotonic()``.
            peer: the destination session.
            failing: the sender is failing: no retries, only wait for writes to settle.

        Returns:
            ``(layers that became complete, the error when a write failed with the budget
            spent)``.
        """
        completed: list[int] = []
        for p in self._parts:
            if p.finished:
                continue
            if p.handle is None:  # not submitted yet (staging copy, or not paired)
                if failing:
                    p.finished = True
                continue
            h = p.handle
            if h.error is not None:
                if failing:
                    if h.settled:
                        p.finished = True
                    continue
                if p.retry_at is None:
                    if not self.budget.take():
                        return completed, TransferError(
                            h.error.op,
                            h.error.code,
                            h.peer,
                            f"layer {p.layer}: {h.error.detail}; retries exhausted "
                            f"({self.budget.max_retries})",
                        )
                    p.retry_at = now + self.budget.backoff()
                    log.info(
                        "%s: layer %d write failed (%s), retry %d",
                        self._tag,
                        p.layer,
                        h.error,
                        self.budget.used,
                    )
                if now >= p.retry_at and h.settled and p.runs:
                    p.handle, p.retry_at = self._submit(peer, p.runs), None
                continue
            if h.done:
                p.finished = True
                self.layer_bytes[p.layer] = self.layer_bytes.get(p.layer, 0) + h.total_bytes
                if self.complete(p.layer):
                    completed.append(p.layer)
        return completed, None

    def complete(self, layer: int) -> bool:
        """Every token and the state of ``layer`` were marked, submitted and landed."""
        return (
            self._marked.get(layer, 0) == self.src.num_tokens
            and layer in self._state_marked
            and all(
                p.finished and (p.handle.done if p.handle is not None else not p.runs)
                for p in self._parts
                if p.layer == layer
            )
        )

    def all_written(self) -> bool:
        return all(self.complete(l) for l in self.layers)

    def settled(self) -> bool:
        """No write of ours is queued or in flight (the source may be reused)."""
        return all(p.handle is None or p.handle.settled for p in self._parts)

    def in_flight(self) -> bool:
        """Some submitted write is not settled yet."""
        return any(p.handle is not None and not p.handle.settled for p in self._parts)

    @property
    def num_runs(self) -> int:
        """Runs of the latest submission of each part (what the destination got)."""
        return sum(len(p.runs or ()) for p in self._parts)


__all__ = ["LayerWrites"]
