"""The engine's edge: a KV connector carries disaggregation, the core path does not.

:class:`KVConnector` is the one object through which anything outside a plain
"prompt → finish" request reaches the engine (as vLLM v1's ``KVConnectorBase_V1`` does). The
engine calls it at six points of a step and the scheduler at two; with no connector
(``LLMEngine.connector is None``) none of these calls happen::

    Scheduler.schedule  admit waiting seq   → admit_tokens(seq, num_new, num_to_target)
                        pick a victim       → preemptible(seq)
    LLMEngine.step      slots prepared      → on_admit(admitted seqs)          (may abort)
                        each forward        → layer_hook(group) → hook(layer)  (may abort)
                        forward raised      → on_forward_failed(seq)
                        token sampled       → on_sampled(seq, result)  True: HELD, not decoded
    add / abort         a live id?          → has_request(rid);  abort → on_abort(rid)

:class:`DisaggConnector` is the prefill/decode implementation the workers use through the
``LLMEngine`` facade (``add_prefill_request`` / ``release`` on a prefill worker, ``reserve`` /
``admit`` on a decode worker); the lifecycle they take part in is in :mod:`k3serve.protocol`:

    prefill worker: add_prefill_request ─▶ admitted: on_admit(handle)  (pages of the WHOLE
        prompt: a sender's source must not move, and the request is never preempted)
        ─▶ each layer of each forward: layer_hook(layer, upto) ─▶ token #1 sampled: HELD,
        ``RequestOutput.handle.first_token`` ─▶ release (transfer done) | abort
    decode worker: reserve (slot + pages, no request yet) ─▶ the cache arrives ─▶
        admit(token #1, params) ─▶ decodes from token #2 like any request | abort
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from k3serve.cache.allocator import CacheFullError
from k3serve.cache.manager import PrefixHit
from k3serve.engine.sequence import Request, SeqStatus, as_token_ids
from k3serve.engine.sequence import Sequence as Seq
from k3serve.protocol import CacheHandle, FirstToken, RequestOutput
from k3serve.sampling import SamplingParams

if TYPE_CHECKING:
    from k3serve.engine.engine import LLMEngine
    from k3serve.engine.sampler import SampleResult
    from k3serve.engine.scheduler import ScheduledSeq


class KVConnector:
    """Plug point at the engine's edge; every method's default is what the engine does alone.

    Subclass and override what you need. Methods are called from the engine thread only, in
    the order of the module docstring; those marked *may abort* may call
    ``LLMEngine.abort_request`` (the engine then skips the aborted request's remaining work).
    """

    # ------------------------------------------------------------------ scheduler hook
    def admit_tokens(self, seq: Seq, num_new: int, num_to_target: int) -> int:
        """Tokens to allocate pages for at ``seq``'s admission (``SchedulerHook``).

        Returns:
            An int in ``[num_new, num_to_target]``; default ``num_new`` (chunk by chunk).
        """
        return num_new

    def preemptible(self, seq: Seq) -> bool:
        """Whether running ``seq`` may be preempted to make room (default True)."""
        return True

    # ------------------------------------------------------------------ step
    def on_admit(self, seqs: Sequence[Seq]) -> None:
        """Sequences admitted this step, their slots zeroed or loaded, before any forward.
        *May abort.*"""

    def layer_hook(self, group: Sequence[ScheduledSeq]) -> Callable[[int], None] | None:
        """The ``hook(layer_idx)`` for the forward over ``group`` (run after each layer wrote
        its cache), or ``None`` (default). *The hook may abort.*"""
        return None

    def on_forward_failed(self, seq: Seq) -> bool:
        """A forward over ``seq`` raised part-way. Returns True when the connector dealt with
        it (e.g. aborted it); False (default): the engine preempts it (recompute)."""
        return False

    def on_sampled(self, seq: Seq, result: SampleResult) -> bool:
        """``seq`` got a token (appended, detokenized, stop checks done). Returns True when the
        connector keeps the sequence (it set ``seq.status = HELD`` and took it off the
        scheduler); False (default): the engine finishes it or decodes on."""
        return False

    # ------------------------------------------------------------------ request table
    def has_request(self, request_id: str) -> bool:
        """Whether the connector holds ``request_id`` outside ``LLMEngine.requests`` (default
        False); such ids are refused by ``add_request``."""
        return False

    def on_abort(self, request_id: str) -> bool:
        """``LLMEngine.abort_request`` is running: drop the connector's state for the id.
        Returns True when the request lived only in the connector (the engine stops there)."""
        return False


@dataclass(frozen=True)
class _PrefillHooks:
    on_admit: Callable[[CacheHandle], None] | None
    layer_hook: Callable[[int, int], None] | None


@dataclass(frozen=True)
class _Reservation:
    seq_id: int
    prompt: list[int]
    num_tokens: int
    cache_salt: str | None


class DisaggConnector(KVConnector):
    """Prefill/decode disaggregation for one engine (module docstring).

    Holds the prefill-only requests' hooks (those requests are never preempted, take pages for
    their whole prompt at admission and stop HELD after token #1) and the decode side's
    reservations (a slot and pages taken before the request exists in the engine).

    Args:
        engine: the engine it is attached to (``LLMEngine.connector``); the connector uses
            its cache manager, scheduler, runner and request table.
    """

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._prefill: dict[str, _PrefillHooks] = {}
        self._reserved: dict[str, _Reservation] = {}

    # ================================================================== prefill side
    def add_prefill_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams | None,
        cache_salt: str | None,
        snapshot_at: Iterable[int],
        on_admit: Callable[[CacheHandle], None] | None,
        layer_hook: Callable[[int, int], None] | None,
    ) -> None:
        """``LLMEngine.add_prefill_request`` (its docstring has the contract)."""
        if isinstance(params, SamplingParams) and params.n != 1:
            raise ValueError(
                f"SamplingParams.n: must be 1 for a disaggregated request, got {params.n}"
            )
        self.engine._add(
            request_id, prompt_token_ids, params, cache_salt, snapshot_at, snapshot_on_finish=False
        )
        self._prefill[request_id] = _PrefillHooks(on_admit, layer_hook)

    def release(self, request_id: str) -> None:
        """``LLMEngine.release``: free a HELD prefill request's slot and pages.

        Raises:
            ValueError: not a held prefill request.
        """
        eng = self.engine
        req = eng.requests.get(request_id)
        if (
            req is None
            or request_id not in self._prefill
            or req.seqs[0].status is not (SeqStatus.HELD)
        ):
            raise ValueError(f"request_id: {request_id!r} is not a held prefill request")
        del eng.requests[request_id], self._prefill[request_id]
        seq = req.seqs[0]
        eng.cm.remove(seq.seq_id)
        seq.status = SeqStatus.FINISHED

    def _handle(self, seq: Seq, res: SampleResult | None) -> CacheHandle:
        eng, req = self.engine, seq.request
        L = len(req.prompt_token_ids)
        first = None
        if res is not None:
            first = FirstToken(res.token_id, res.logprob, res.top_logprobs, L, req.seed)
        pages = eng.cm.block_table(seq.seq_id)[: -(-L // eng.config.block_size)]
        return CacheHandle(
            req.request_id,
            eng.cm.slot(seq.seq_id),  # type: ignore[arg-type]
            pages,
            L,
            eng.config.block_size,
            req.num_cached_tokens or 0,
            first,
        )

    # ---------------------------------------------------------------- KVConnector
    def admit_tokens(self, seq: Seq, num_new: int, num_to_target: int) -> int:
        # prefill-only: pages for the whole prompt now (the sender's source must not move)
        return num_to_target if seq.request.request_id in self._prefill else num_new

    def preemptible(self, seq: Seq) -> bool:
        return seq.request.request_id not in self._prefill  # a sender may read its pages

    def on_admit(self, seqs: Sequence[Seq]) -> None:
        for seq in seqs:
            hooks = self._prefill.get(seq.request.request_id)
            # an earlier callback may have aborted this one
            if (
                hooks is not None
                and hooks.on_admit is not None
                and seq.status is (SeqStatus.RUNNING)
            ):
                hooks.on_admit(self._handle(seq, None))

    def layer_hook(self, group: Sequence[ScheduledSeq]) -> Callable[[int], None] | None:
        hooks: list[tuple[Callable[[int, int], None], int, Seq]] = []
        for s in group:
            h = self._prefill.get(s.seq.request.request_id)
            if h is not None and h.layer_hook is not None:
                hooks.append((h.layer_hook, s.seq.num_computed + s.num_new, s.seq))
        if not hooks:
            return None

        def hook(layer: int) -> None:
            for h, upto, seq in hooks:
                if seq.status is SeqStatus.RUNNING:  # aborted by an earlier hook: its pages
                    h(layer, upto)  # are free, nothing to send

        return hook

    def on_forward_failed(self, seq: Seq) -> bool:
        rid = seq.request.request_id
        if rid not in self._prefill:
            return False
        self.engine.abort_request(rid)  # a sender already holds its pages: no recompute
        return True

    def on_sampled(self, seq: Seq, result: SampleResult) -> bool:
        if seq.request.request_id not in self._prefill:
            return False
        self.engine.scheduler.remove(seq)
        seq.status = SeqStatus.HELD
        seq.request.handle = self._handle(seq, result)
        return True

    def has_request(self, request_id: str) -> bool:
        return request_id in self._reserved

    def on_abort(self, request_id: str) -> bool:
        self._prefill.pop(request_id, None)
        r = self._reserved.pop(request_id, None)
        if r is None:
            return False
        self.engine.cm.remove(r.seq_id)
        return True

    # ================================================================== decode side
    @property
    def num_reserved(self) -> int:
        return len(self._reserved)

    def can_reserve(self, num_tokens: int) -> bool:
        """``LLMEngine.can_reserve``."""
        cm = self.engine.cm
        return cm.slots.can_allocate() and cm.pages.can_allocate(
            -(-num_tokens // self.engine.config.block_size)
        )

    def reserve(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        num_tokens: int | None,
        cache_salt: str | None,
    ) -> CacheHandle:
        """``LLMEngine.reserve`` (its docstring has the contract)."""
        eng = self.engine
        ids = eng._check_new(request_id, prompt_token_ids)
        n = len(ids) if num_tokens is None else num_tokens
        # admit() continues after ≥ 1 output token: the cache covers at least the prompt
        if not isinstance(n, int) or not len(ids) <= n < eng.max_model_len:
            raise ValueError(
                f"num_tokens: must lie in [len(prompt_token_ids) = {len(ids)}, "
                f"{eng.max_model_len}), got {n!r}"
            )
        sid = eng._next_seq_id()
        eng.cm.add(sid, ids, cache_salt, plan_snapshots=False, lookup=False)
        if not eng.cm.can_admit(sid, PrefixHit(0), n):
            eng.cm.remove(sid)
            raise CacheFullError(f"reserve {request_id!r}: no slot or pages for {n} tokens")
        adm = eng.cm.admit(sid, PrefixHit(0), n)
        eng.pools.zero_slot(adm.slot)
        self._reserved[request_id] = _Reservation(sid, ids, n, cache_salt)
        pages = eng.cm.block_table(sid)[: -(-n // eng.config.block_size)]
        return CacheHandle(request_id, adm.slot, pages, n, eng.config.block_size)

    def admit(
        self,
        request_id: str,
        output_token_ids: Sequence[int],
        params: SamplingParams,
        output_logprobs: Sequence[float] | None,
    ) -> RequestOutput | None:
        """``LLMEngine.admit`` (its docstring has the contract)."""
        eng = self.engine
        r = self._reserved.get(request_id)
        if r is None:
            raise ValueError(f"request_id: {request_id!r} is not reserved")
        outs = as_token_ids(output_token_ids, eng.model_config.vocab_size, "output_token_ids")
        if not outs:
            raise ValueError("output_token_ids: need ≥ 1 token")
        if len(r.prompt) + len(outs) - 1 != r.num_tokens:
            raise ValueError(
                f"output_token_ids: {len(outs)} tokens do not follow the {r.num_tokens} reserved"
            )
        params = eng._check_params(params)
        if params.n != 1:
            raise ValueError(
                f"SamplingParams.n: must be 1 for a disaggregated request, got {params.n}"
            )
        del self._reserved[request_id]
        req = Request(request_id, r.prompt, params, params.seed, cache_salt=r.cache_salt)  # type: ignore[arg-type]
        req.num_cached_tokens = 0
        seq = eng._new_seq(req, 0, r.prompt + outs, seq_id=r.seq_id)
        eng.requests[request_id] = req
        seq.num_computed = seq.target = r.num_tokens
        eng.runner.save_snapshots(eng.cm.commit(r.seq_id, seq.token_ids, r.num_tokens))
        eng._feed_outputs(seq, outs, output_logprobs)
        if seq.detok.finished:
            eng._finish_seq(seq)
            del eng.requests[request_id]
            return eng._output(req)
        eng.scheduler.add_running(seq)
        return None


class StoreSink(Protocol):
    """Where :meth:`StoreBridge.export_new` hands bytes (``kvstore.store.KVStore``); both
    calls must return at once (enqueue)."""

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
    """Engine-thread side of the shared store (DESIGN.md §3, kvstore/store.py): moves bytes
    between the engine's pools and the store client, through the cache manager's ids.

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
        engine: the engine (its ``cm`` and ``pools``).
    """

    def __init__(self, engine: LLMEngine):
        self.engine = engine
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
        cm, pools = self.engine.cm, self.engine.pools
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
        cm = self.engine.cm
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
        cm, pools = self.engine.cm, self.engine.pools
        plan = cm.begin_import(prefix, list(blocks), snapshot[0] if snapshot else None)
        if plan is None:
            return False
        try:
            for h, page in plan.pages:
                pools.load_block(page, blocks[h])
            if plan.snapshot is not None and snapshot is not None:
                pools.load_snapshot_bytes(plan.snapshot[1], snapshot[1])
        except BaseException:
            cm.abort_import(plan)
            raise
        self._imported.update((h, False) for h, _ in plan.pages)
        if plan.snapshot is not None:
            self._imported.add((plan.snapshot[0], True))
        cm.end_import(plan)
        self.num_imported_blocks += len(plan.pages)
        self.num_imported_snapshots += plan.snapshot is not None
        return True


__all__ = ["DisaggConnector", "KVConnector", "LocalView", "StoreBridge", "StoreSink"]
