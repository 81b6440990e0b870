"""EngineCore: one engine step over the engine's parts — schedule → run → sample → outputs.

One :meth:`EngineCore.step`::

    plan = schedule()                 scheduler admits / allocates / preempts (ids only); the
                                      runner zeroes or loads admitted slots; connector.on_admit
    for group in (prefill chunks, decodes):          two forwards at most
        logits = runner.execute(RunBatch)            raises part-way → the group is recomputed
        commit: index full blocks, save snapshots    (cm.commit → runner.save_snapshots)
        sample rows that computed their last known token (n > 1: fork the choices);
        detokenize, stop checks; finished → cm.finish (end-of-request snapshot)
    outputs

With speculative decoding on (``spec``), the decode group may instead run one verify step
(:meth:`EngineCore._speculate`): rows carry the last token and the proposed ones, the KDA
states are replayed over the accepted tokens only (:mod:`k3serve.model.capture`).

A connector (:class:`~k3serve.engine.connector.KVConnector`, ``None`` for an offline or
colocated engine) is called at the points its docstring lists. :class:`~k3serve.engine.engine.LLMEngine`
builds the parts and adds the request and connector API.
"""

from __future__ import annotations

from typing import Any

import torch

from k3serve.cache.manager import CacheManager
from k3serve.engine.config import EngineConfig, EngineStats
from k3serve.engine.connector import KVConnector
from k3serve.engine.processor import InputProcessor, request_output
from k3serve.engine.runner import ModelRunner, Row, RunBatch
from k3serve.engine.sampler import SampleResult, SamplingRow, sample
from k3serve.engine.scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from k3serve.engine.sequence import Request, SeqStatus
from k3serve.engine.sequence import Sequence as Seq
from k3serve.engine.spec.speculator import Draft, Speculator
from k3serve.model.capture import KDACapture
from k3serve.protocol import RequestOutput


class EngineCore:
    """The step loop over a cache manager, a scheduler, a runner and an input processor.

    Args:
        config: :class:`~k3serve.engine.config.EngineConfig` (``record_logits`` read here).
        cm: the cache manager. scheduler: its scheduler. runner: the model runner (or a
            multi-rank one). inputs: the input processor (sequences for forks, grammars).

    Attributes:
        connector: the attached connector or ``None`` (then the step calls none).
        spec: the :class:`~k3serve.engine.spec.speculator.Speculator` (``None``: no
            speculative decoding; the decode group then runs the plain step).
        requests: live requests by id (held ones included; reservations are the connector's).
        stats: :class:`~k3serve.engine.config.EngineStats`.
    """

    def __init__(
        self,
        config: EngineConfig,
        cm: CacheManager,
        scheduler: Scheduler,
        runner: ModelRunner,
        inputs: InputProcessor,
    ):
        self.config = config
        self.cm = cm
        self.scheduler = scheduler
        self.runner = runner
        self.inputs = inputs
        self.stats = EngineStats()
        self.requests: dict[str, Request] = {}
        self.connector: KVConnector | None = None
        self.spec: Speculator | None = None

    def attach(self, connector: KVConnector) -> None:
        """Put ``connector`` at the engine's edge (and in the scheduler's hook).

        Raises:
            ValueError: another connector is attached already.
        """
        if self.connector is not None and self.connector is not connector:
            raise ValueError("connector: the engine has a connector already")
        self.connector = connector
        self.scheduler.hook = connector

    def abort_request(self, request_id: str) -> bool:
        """Stop a request at any point (queued, prefilling, decoding, held, reserved).

        Frees its slot, pages and snapshots; computed full blocks stay cached. Callable from
        ``on_admit`` and ``layer_hook`` (the step skips the rest of the aborted request's work).

        Returns:
            True when the request was live.
        """
        if self.connector is not None and self.connector.on_abort(request_id):
            return True
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        for seq in req.seqs:
            if seq.status is not SeqStatus.FINISHED:
                self.scheduler.remove(seq)
                if self.cm.has(seq.seq_id):
                    self.cm.remove(seq.seq_id)
                if self.spec is not None:
                    self.spec.forget(seq.seq_id)
                seq.status = SeqStatus.FINISHED
        return True

    # ================================================================== step
    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0

    def step(self) -> list[RequestOutput]:
        """Run one engine step: schedule → run → sample → outputs.

        Returns:
            Outputs of the requests that changed (new tokens, finished, held); finished ones
            are dropped from the engine afterwards (held requests stay until released).

        Raises:
            whatever a forward (or a connector hook inside it) raises; the forward's sequences
            are recomputed later (or handed to the connector), the engine stays consistent.
        """
        plan = self._schedule()
        for decode, group in ((False, plan.prefills), (True, plan.decodes)):
            group = [s for s in group if s.seq.status is SeqStatus.RUNNING]  # aborted by a hook
            if group and not (decode and self._speculate(group, plan)):
                self._sample(self._run(group))
        return self._collect()

    def _schedule(self) -> SchedulerOutput:
        """The scheduler's plan, with the admitted slots zeroed or loaded from a snapshot and
        the connector told (``on_admit`` may abort requests: the step skips them)."""
        plan = self.scheduler.schedule()
        self.stats.num_steps += 1
        self.stats.num_mixed_steps += bool(plan.prefills and plan.decodes)
        admitted = [s for s in plan.prefills if s.admission is not None]
        for s in admitted:
            req = s.seq.request
            if s.seq.choice == 0 and req.num_cached_tokens is None:
                req.num_cached_tokens = s.admission.num_cached  # type: ignore[union-attr]
        self.runner.prepare_slots(s.admission for s in admitted)  # type: ignore[misc]
        if self.connector is not None and admitted:
            self.connector.on_admit([s.seq for s in admitted])
        return plan

    def _run(self, group: list[ScheduledSeq]) -> list[tuple[Seq, torch.Tensor]]:
        """One forward over ``group`` through the runner's seam, then the commit (index full
        blocks, save snapshots).

        Returns:
            ``(seq, [V] logits)`` of the rows that computed their last known token (to sample).
        """
        hook = self.connector.layer_hook(group) if self.connector is not None else None
        try:
            logits = self.runner.execute(RunBatch(tuple(self._row(s) for s in group), hook))
        except BaseException:
            self._drop_failed_forward(group)
            raise
        self.stats.num_forwards += 1
        to_sample: list[tuple[Seq, torch.Tensor]] = []
        for k, s in enumerate(group):
            seq = s.seq
            if seq.status is not SeqStatus.RUNNING:  # aborted by a layer hook: skip
                continue
            if seq.is_prefill:
                self.stats.prompt_tokens_computed += s.num_new
            seq.num_computed += s.num_new
            self.runner.save_snapshots(self.cm.commit(seq.seq_id, seq.token_ids, s.num_new))
            if seq.num_computed == len(seq.token_ids):
                to_sample.append((seq, logits[k]))
        # the caller samples each group right after its forward: if the next forward raises,
        # these rows are done (left unsampled they would never be scheduled again)
        return to_sample

    def _drop_failed_forward(self, group: list[ScheduledSeq]) -> None:
        """A forward over ``group`` raised part-way (a hook, an interrupt): the KDA/conv states
        of its slots are advanced in some layers and not in others, and nothing was committed.
        Re-running the chunk from there would compute (and index) wrong latents and snapshots,
        so every such sequence is recomputed from the cache instead (preempted), unless the
        connector takes it (a prefill-only request, whose pages a sender holds, is aborted)."""
        for s in group:
            seq = s.seq
            if seq.status is not SeqStatus.RUNNING:
                continue
            if self.connector is None or not self.connector.on_forward_failed(seq):
                self.scheduler.preempt(seq)

    def _row(self, s: ScheduledSeq) -> Row:
        """The new tokens ``[num_computed, num_computed + num_new)`` of one sequence."""
        seq, start = s.seq, s.seq.num_computed
        slot = self.cm.slot(seq.seq_id)
        assert slot is not None  # scheduled sequences are admitted
        table = self.cm.block_table(seq.seq_id)
        return Row(seq.token_ids[start : start + s.num_new], start, slot, table)

    def _sample(self, items: list[tuple[Seq, torch.Tensor]]) -> None:
        if not items:
            return
        rows: list[SamplingRow] = []
        meta: list[tuple[Seq, int, torch.Tensor]] = []
        for seq, lg in items:
            req = seq.request
            forking = req.needs_fork and seq.choice == 0
            prompt_ids = req.prompt_token_ids if req.params.repetition_penalty != 1.0 else ()
            for c in range(req.params.n) if forking else (seq.choice,):
                outs = seq.output_token_ids if c == seq.choice else []
                rows.append(
                    SamplingRow(req.params, req.seed, len(seq.token_ids), c, outs, prompt_ids)
                )
                meta.append((seq, c, lg))
        allowed, matchers = self.inputs.grammar.masks([(m[0].request, m[1]) for m in meta], rows)
        results = sample(torch.stack([m[2] for m in meta]), rows, allowed)
        for m, res in zip(matchers, results):
            if m is not None:
                m.consume(res.token_id)
        # forks first: the children copy the parent's slot before anything can finish it
        pending: list[tuple[Seq, SampleResult, torch.Tensor]] = []
        for (seq, c, lg), res in zip(meta, results):
            if c == seq.choice:
                pending.append((seq, res, lg))
                continue
            child = self.inputs.new_seq(seq.request, c, seq.token_ids[: len(seq.token_ids)])
            if self.cm.can_fork(seq.seq_id):
                self.runner.fork(self.cm.fork(seq.seq_id, child.seq_id))
                child.num_computed = child.target = seq.num_computed
                self.scheduler.add_running(child)
            else:
                child.status = SeqStatus.WAITING  # registered and queued after its token
            pending.append((child, res, lg))
        for seq, res, lg in pending:
            self._append(seq, res, lg)

    def _append(self, seq: Seq, res: SampleResult, lg: torch.Tensor) -> None:
        self._after_sampled(seq, [res], self._record(seq, res, lg))

    def _record(self, seq: Seq, res: SampleResult, lg: torch.Tensor) -> bool:
        """Append a sampled token (logprobs, logits, detokenizer); True when it finishes."""
        req = seq.request
        req.dirty = True
        seq.token_ids.append(res.token_id)
        seq.logprobs.append(res.logprob)
        if req.params.logprobs is not None:
            seq.top_logprobs.append(res.top_logprobs or ())
        if self.config.record_logits:
            seq.logits.append(lg.detach().clone())
        self.stats.generation_tokens += 1
        return seq.detok.step(res.token_id).finished

    def _after_sampled(self, seq: Seq, results: list[SampleResult], finished: bool) -> None:
        """The connector sees each recorded token; then finish, or queue an unforked child."""
        req = seq.request
        if self.connector is not None:
            for res in results:
                if self.connector.on_sampled(seq, res):
                    return  # HELD: the connector owns what happens next
        if finished:
            self._finish_seq(seq)
        elif not self.cm.has(seq.seq_id):  # an unforked child: recompute from the cache
            self.cm.add(seq.seq_id, seq.token_ids, req.cache_salt)
            self.scheduler.add(seq)

    def _finish_seq(self, seq: Seq) -> None:
        self.scheduler.remove(seq)
        if self.cm.has(seq.seq_id):
            self.cm.finish(seq.seq_id)
        if self.spec is not None:
            self.spec.forget(seq.seq_id)
        seq.status = SeqStatus.FINISHED
        seq.request.dirty = True

    # ================================================================== speculation
    def _speculate(self, group: list[ScheduledSeq], plan: SchedulerOutput) -> bool:
        """The decode group as one speculative verify step (:mod:`k3serve.engine.spec`)::

            proposals (policy, max_tokens, grammar) → pages for 1 + k_i tokens each
            verify forward: rows [t0, d_1 … d_k] (shorter rows padded to the longest where
              the runner replays that shape, _verify_width); logits of every token; states
              untouched
            accept → record the emitted tokens (up to a stop) → replay the m_i computed ones
            into the slots and commit them, cut at block boundaries (rolling snapshots)
            → connector / finish

        Returns:
            False (nothing done) when speculation is off or nothing was proposed: the caller
            runs the plain decode.
        """
        spec = self.spec
        if spec is None or any(s.seq.request.needs_fork for s in group):
            return False
        seqs = [s.seq for s in group]
        budget = self.scheduler.max_num_batched_tokens - plan.num_tokens
        drafts = spec.propose(seqs, budget)
        for i, seq in enumerate(seqs):  # pages for the proposals: drop what does not fit
            k = len(drafts[i].tokens)
            while k and not self.cm.can_allocate(seq.seq_id, 1 + k):
                k -= 1
            if k < len(drafts[i].tokens):
                d = drafts[i]
                drafts[i] = d._replace(tokens=d.tokens[:k],
                                       probs=d.probs[:k] if d.probs is not None else None,
                                       allowed=d.allowed[: k + 1] if d.allowed is not None
                                       else None)  # fmt: skip
            if k:
                self.cm.allocate(seq.seq_id, 1 + k)
        if not any(d.tokens for d in drafts):
            return False
        hook = self.connector.layer_hook(group) if self.connector is not None else None
        width = self._verify_width(seqs, drafts, budget) if hook is None else 0
        rows = tuple(
            Row([seq.token_ids[-1], *d.tokens] + [0] * max(width - len(d.tokens), 0),
                seq.num_computed, self.cm.slot(seq.seq_id),  # type: ignore[arg-type]
                self.cm.block_table(seq.seq_id))
            for seq, d in zip(seqs, drafts)
        )  # fmt: skip
        try:
            logits, capture = self.runner.verify(RunBatch(rows, hook))
        except BaseException:
            self._drop_failed_forward(group)
            raise
        self.stats.num_forwards += 1
        spec.stats.steps += 1
        cu = capture.cu_seqlens
        done: list[tuple[int, Seq, list[SampleResult], bool]] = []
        for i, seq in enumerate(seqs):
            if seq.status is not SeqStatus.RUNNING:  # aborted by a layer hook
                continue
            lg = logits[cu[i] : cu[i] + len(drafts[i].tokens) + 1]  # the padding's not read
            results = spec.accept(seq, drafts[i], lg)
            kept, finished = [], False
            for j, res in enumerate(results):
                kept.append(res)
                if self._record(seq, res, lg[j]):
                    finished = True
                    break
            spec.stats.emitted += len(kept)
            done.append((i, seq, kept, finished))
        self._replay_commit(capture, [(i, seq, len(kept)) for i, seq, kept, _ in done])
        for _, seq, kept, finished in done:
            self._after_sampled(seq, kept, finished)
        return True

    def _verify_width(self, seqs: list[Seq], drafts: list[Draft], budget: int) -> int:
        """Proposals per row of a verify batch whose rows proposed different numbers: the
        longest row's ``k``, the shorter rows padded after their own proposals with token 0,
        where the runner replays a captured graph of that uniform shape (one replay instead of
        the eager multi-token forward) and every row has the pages, the room under the length
        cap and the step's token budget for ``1 + k`` tokens. The padding's logits are not
        read and its KDA inputs not replayed; its latents land past the row's last accepted
        position, where the next tokens overwrite them (as a rejected proposal's do).

        Returns:
            ``k`` (the caller pads), or 0: the rows run as proposed.
        """
        ks = [len(d.tokens) for d in drafts]
        k = max(ks)
        if len(set(ks)) == 1 or not self.runner.verify_replays(len(seqs), k):
            return 0
        assert self.spec is not None
        if sum(k - x for x in ks) > budget - sum(ks) or any(
                seq.num_computed + k + 1 > self.spec.max_model_len for seq in seqs):
            return 0
        for seq, x in zip(seqs, ks):  # pages for the padding (what was taken stays the row's)
            if x < k:
                if not self.cm.can_allocate(seq.seq_id, 1 + k):
                    return 0
                self.cm.allocate(seq.seq_id, 1 + k)
        return k

    def _replay_commit(self, capture: KDACapture, items: list[tuple[int, Seq, int]]) -> None:
        """Replay each row's first ``m`` fed tokens into its slot and commit them, in rounds
        that stop at block boundaries (each boundary's rolling snapshot sees its state)."""
        B = self.cm.block_size
        pos = {i: 0 for i, _, _ in items}
        while True:
            part = []
            for i, seq, m in items:
                n = min(m - pos[i], B - seq.num_computed % B)
                if n > 0:
                    part.append((i, seq, n))
            if not part:
                return
            self.runner.replay(capture, [i for i, _, _ in part],
                               [self.cm.slot(seq.seq_id) for _, seq, _ in part],  # type: ignore[misc]
                               [pos[i] for i, _, _ in part], [n for _, _, n in part])  # fmt: skip
            for i, seq, n in part:
                pos[i] += n
                seq.num_computed += n
                self.runner.save_snapshots(self.cm.commit(seq.seq_id, seq.token_ids, n))

    # ================================================================== outputs
    def _collect(self) -> list[RequestOutput]:
        out = []
        for rid, req in list(self.requests.items()):
            if not req.dirty:
                continue
            req.dirty = False
            out.append(request_output(req, self.config.record_logits))
            if req.finished:
                del self.requests[rid]
        return out

    # ================================================================== router feeds
    def cache_events(self, after: int = 0, limit: int | None = None) -> dict[str, Any]:
        """``GET /internal/cache_events?after=SEQ`` body."""
        return self.cm.events_since(after, limit)

    def cache_state(self) -> dict[str, Any]:
        """``GET /internal/cache_state`` body."""
        return self.cm.cache_state()


__all__ = ["EngineCore"]
