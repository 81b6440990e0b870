"""Continuous batching with chunked prefill, a per-step token budget and preemption.

One :meth:`Scheduler.schedule` call plans one engine step::

    budget = max_num_batched_tokens
    1. running sequences, oldest admission first:
         decode  → 1 token
         prefill → min(budget, chunk_end - num_computed)   (chunks end on snapshot points)
       no page for it → preempt the newest preemptible running sequence (recompute later),
       retry; if the sequence itself is the newest, it is preempted.
    2. waiting sequences, FCFS, while budget and slots last (none after a preemption) and,
       with ``max_prefill_backlog`` set, while the running prefills have fewer than that many
       tokens left to compute:
         hit = prefix match; first chunk = min(budget, chunk_end - hit); admit or stop
         (pages for the chunk; a hook may ask for more, e.g. the whole prompt).

Chunks end on snapshot points (log-spaced: small ones early in a prompt), so the oldest
prefill seldom fills a step and the rest of the budget admits the next waiting sequences:
without a backlog cap, every waiting prompt that finds a slot is admitted and all of them
share the steps, each one's time from admission to token #1 growing with the queue
(processor sharing). A prefill worker sets the cap: a request's sender starts at admission
under a deadline, so an admitted prefill must finish in about (cap + its own tokens) of
compute, whatever the queue behind it (which waits unadmitted, FCFS).

A preempted sequence releases its slot and pages (its computed full blocks stay cached) and
goes back to the head of the queue with prompt := all its tokens; re-admission matches the
prefix cache again, so recompute is cheap when its blocks and a snapshot survived.

The scheduler sees only :class:`~k3serve.cache.manager.CacheManager` predicates, never pools,
and knows nothing of disaggregation: a :class:`SchedulerHook` (the engine's connector, see
:mod:`k3serve.engine.connector`) may enlarge an admission and exempt sequences from preemption.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from k3serve.cache.manager import CacheManager
from k3serve.cache.types import Admission
from k3serve.engine.sequence import SeqStatus, Sequence


class SchedulerHook(Protocol):
    """The scheduler's one plug point (the engine's
    :class:`~k3serve.engine.connector.KVConnector` implements it).

    Neither method may mutate the scheduler or the cache manager.
    """

    def admit_tokens(self, seq: Sequence, num_new: int, num_to_target: int) -> int:
        """Tokens to allocate pages for when ``seq`` is admitted.

        Args:
            seq: the waiting sequence being admitted.
            num_new: its first chunk (tokens computed this step).
            num_to_target: tokens from its prefix hit to the end of its known tokens.

        Returns:
            An int in ``[num_new, num_to_target]`` (``num_new``: pages grow chunk by chunk).
        """
        ...

    def preemptible(self, seq: Sequence) -> bool:
        """Whether a running ``seq`` may be preempted (its pages freed) to make room."""
        ...


@dataclass
class ScheduledSeq:
    """One sequence's share of a step.

    Attributes:
        seq: the sequence.
        num_new: tokens computed this step, positions ``[num_computed, num_computed + num_new)``.
        admission: set when admitted this step: the engine zeroes or loads its slot first.
    """

    seq: Sequence
    num_new: int
    admission: Admission | None = None


@dataclass
class SchedulerOutput:
    """A step's plan: multi-token chunks and single-token rows go to separate forwards."""

    prefills: list[ScheduledSeq] = field(default_factory=list)
    decodes: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new for s in self.prefills) + len(self.decodes)

    @property
    def empty(self) -> bool:
        return not self.prefills and not self.decodes


class Scheduler:
    """FCFS continuous batching over a cache manager.

    Args:
        cm: the cache manager (owns every page, slot and snapshot).
        max_num_batched_tokens: token budget per step (≥ 1).
        max_num_seqs: most running sequences (≤ the manager's slots).
        hook: optional :class:`SchedulerHook` (settable later: ``scheduler.hook = …``).
        max_prefill_backlog: admit no waiting sequence while the running prefills have this
            many tokens or more left to compute (tokens; ``None``: no cap; settable later).
            A sequence is always admitted when no prefill runs, whatever its length.

    Raises:
        ValueError: a limit < 1.
    """

    def __init__(
        self,
        cm: CacheManager,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        hook: SchedulerHook | None = None,
        max_prefill_backlog: int | None = None,
    ):
        if max_num_batched_tokens < 1 or max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens, max_num_seqs: must be ≥ 1")
        if max_prefill_backlog is not None and max_prefill_backlog < 1:
            raise ValueError("max_prefill_backlog: must be ≥ 1 or None")
        self.max_prefill_backlog = max_prefill_backlog
        self.cm = cm
        self.hook = hook
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    # ------------------------------------------------------------------ queues
    def add(self, seq: Sequence) -> None:
        """Queue a waiting sequence (registered with the cache manager by the caller)."""
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """Join an already admitted sequence (a fork, or a decode-side admit)."""
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Drop a sequence from whichever queue holds it (finish, abort, hold)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    # ------------------------------------------------------------------ planning
    def preempt(self, seq: Sequence) -> None:
        """Send a running sequence back to the head of the queue (recompute): its slot and
        pages are released (computed full blocks stay cached), its prompt becomes all its
        tokens. Also the engine's way out of a forward that failed part-way."""
        self.running.remove(seq)
        self.cm.release(seq.seq_id)
        self.cm.set_tokens(seq.seq_id, seq.token_ids)
        seq.num_computed = 0
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.preempt(seq)
        out.preempted.append(seq)

    def _victim(self, first: int) -> Sequence | None:
        """Newest preemptible running sequence at index ≥ ``first`` (not yet scheduled)."""
        for s in reversed(self.running[first:]):
            if self.hook is None or self.hook.preemptible(s):
                return s
        return None

    def _chunk(self, seq: Sequence, budget: int) -> int:
        if not seq.is_prefill:
            return 1 if seq.num_remaining == 1 else 0
        return min(budget, self.cm.chunk_end(seq.seq_id) - seq.num_computed)

    def schedule(self) -> SchedulerOutput:
        """Plan one step; allocates pages for it and admits sequences (mutates the manager).

        Returns:
            :class:`SchedulerOutput` (possibly empty: nothing fits and nothing runs).
        """
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = self._chunk(seq, budget)
            if n <= 0:
                i += 1
                continue
            preempted_self = False
            while not self.cm.can_allocate(seq.seq_id, n):
                victim = self._victim(i)
                if victim is None:  # none preemptible left: wait for them to finish
                    break
                self._preempt(victim, out)
                if victim is seq:
                    preempted_self = True
                    break
            if preempted_self:
                continue
            if not self.cm.can_allocate(seq.seq_id, n):
                i += 1
                continue
            self.cm.allocate(seq.seq_id, n)
            (out.decodes if n == 1 and not seq.is_prefill else out.prefills).append(
                ScheduledSeq(seq, n)
            )
            budget -= n
            i += 1

        cap = self.max_prefill_backlog
        backlog = self.prefill_backlog() if cap is not None else 0
        while (
            self.waiting
            and budget > 0
            and not out.preempted
            and len(self.running) < self.max_num_seqs
            and (cap is None or backlog < cap)
        ):
            seq = self.waiting[0]
            sid = seq.seq_id
            hit = self.cm.match(sid)
            n = min(budget, hit.chunk_end - hit.num_tokens)
            target = self.cm.num_prompt(sid)
            left = target - hit.num_tokens
            reserve = n if self.hook is None else self.hook.admit_tokens(seq, n, left)
            if not self.cm.can_admit(sid, hit, reserve):
                break
            adm = self.cm.admit(sid, hit, reserve)
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            seq.num_computed = adm.num_cached
            seq.target = target
            self.running.append(seq)
            out.prefills.append(ScheduledSeq(seq, n, adm))
            budget -= n
            backlog += target - seq.num_computed
        return out

    def prefill_backlog(self) -> int:
        """Tokens the running prefills have left to compute (chunks planned this step still
        count: they are not computed yet)."""
        return sum(s.target - s.num_computed for s in self.running if s.is_prefill)


__all__ = ["ScheduledSeq", "Scheduler", "SchedulerHook", "SchedulerOutput"]
