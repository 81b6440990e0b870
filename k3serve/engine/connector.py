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

A connector calls back only through :class:`EngineAPI` (``LLMEngine`` implements it): submit a
request (with given outputs), reserve / resume / free a cache that arrives from elsewhere,
hold / release a sampled request, and the cache manager's read side; what it learns of a
sequence comes as :class:`~k3serve.engine.sequence.Sequence` metadata in the calls above.

:class:`DisaggConnector` is the prefill/decode implementation the workers use
(``DisaggConnector.of(engine)``: ``add_prefill_request`` / ``release`` on a prefill worker,
``reserve`` / ``admit`` on a decode worker); the lifecycle they take part in is in
:mod:`k3serve.protocol`::

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
from typing import TYPE_CHECKING, Protocol

from k3serve.cache.reader import CacheReader
from k3serve.engine.sequence import SeqStatus
from k3serve.engine.sequence import Sequence as Seq
from k3serve.protocol import CacheHandle, FirstToken, RequestOutput
from k3serve.sampling import SamplingParams

if TYPE_CHECKING:
    from k3serve.engine.sampler import SampleResult
    from k3serve.engine.scheduler import ScheduledSeq


@dataclass(frozen=True)
class CacheReservation:
    """A slot and pages taken for a cache that arrives from elsewhere
    (``EngineAPI.reserve_cache``); the request is not in the engine until ``resume``.

    Attributes:
        seq_id: the cache manager's id of the reserved sequence.
        prompt: the checked prompt ``[L]``.
        num_tokens: tokens whose cache arrives (``≥ L``).
        cache_salt: the request's tenant salt.
        slot: its KDA/conv state slot (zeroed). pages: pages covering ``[0, num_tokens)``.
    """

    seq_id: int
    prompt: tuple[int, ...]
    num_tokens: int
    cache_salt: str | None
    slot: int
    pages: tuple[int, ...]


class EngineAPI(Protocol):
    """What a connector may use of the engine (``LLMEngine`` implements it; its methods'
    docstrings have Args / Returns / Raises); nothing else. Engine thread only."""

    connector: KVConnector | None

    @property
    def cache(self) -> CacheReader:
        """The cache manager's read side (no call on it changes the cache)."""
        ...

    def attach(self, connector: KVConnector) -> None:
        """Mutates: puts ``connector`` at the engine's edge (ValueError if another is there)."""
        ...

    def check_request(self, request_id: str, prompt_token_ids: Sequence[int]) -> list[int]:
        """Read-only: the checked prompt of a new request (ValueError naming the field)."""
        ...

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams | None = None,
        *,
        cache_salt: str | None = None,
        snapshot_at: Iterable[int] = (),
        output_token_ids: Sequence[int] = (),
        output_logprobs: Sequence[float] | None = None,
        snapshot_on_finish: bool = True,
    ) -> RequestOutput | None:
        """Mutates: queues a request (after ``output_token_ids`` sampled elsewhere)."""
        ...

    def reserve_cache(
        self, request_id: str, token_ids: list[int], num_tokens: int | None, cache_salt: str | None
    ) -> CacheReservation:
        """Mutates: takes a zeroed slot and pages for a cache that arrives (CacheFullError)."""
        ...

    def free_cache(self, reservation: CacheReservation) -> None:
        """Mutates: gives a reservation's slot and pages back."""
        ...

    def resume(
        self,
        request_id: str,
        reservation: CacheReservation,
        output_token_ids: Sequence[int],
        params: SamplingParams,
        output_logprobs: Sequence[float] | None = None,
    ) -> RequestOutput | None:
        """Mutates: runs the request on its landed cache after the given outputs."""
        ...

    def hold(self, seq: Seq, handle: CacheHandle) -> None:
        """Mutates: takes a sampled sequence off the scheduler, ``HELD`` with ``handle``."""
        ...

    def release_held(self, request_id: str) -> bool:
        """Mutates: frees a held request (False: it is not held, nothing done)."""
        ...

    def abort_request(self, request_id: str) -> bool:
        """Mutates: stops a request anywhere (True when it was live)."""
        ...


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


class DisaggConnector(KVConnector):
    """Prefill/decode disaggregation for one engine (module docstring).

    Holds the prefill-only requests' hooks (those requests are never preempted, take pages for
    their whole prompt at admission and stop HELD after token #1) and the decode side's
    reservations (a slot and pages taken before the request exists in the engine).

    Args:
        engine: the engine it is attached to (through :class:`EngineAPI` only).
    """

    def __init__(self, engine: EngineAPI):
        self.engine = engine
        self._prefill: dict[str, _PrefillHooks] = {}
        self._reserved: dict[str, CacheReservation] = {}

    @classmethod
    def of(cls, engine: EngineAPI) -> DisaggConnector:
        """The engine's disaggregation connector, attached now if the engine has none.

        Raises:
            TypeError: the engine's connector is not a :class:`DisaggConnector`.
        """
        if engine.connector is None:
            engine.attach(cls(engine))
        conn = engine.connector
        if not isinstance(conn, DisaggConnector):
            raise TypeError(
                f"connector: {type(conn).__name__} does not serve the disaggregation "
                "API (reserve / admit / add_prefill_request / release)"
            )
        return conn

    # ================================================================== prefill side
    def add_prefill_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams | None = None,
        *,
        cache_salt: str | None = None,
        snapshot_at: Iterable[int] = (),
        on_admit: Callable[[CacheHandle], None] | None = None,
        layer_hook: Callable[[int, int], None] | None = None,
    ) -> None:
        """Queue a prefill-only request; it stops after token #1 and holds its cache.

        Args:
            on_admit: called once with the :class:`CacheHandle` (slot, pages of the whole
                prompt) before its first forward.
            layer_hook: ``hook(layer_idx, upto_tokens)`` after each layer of each forward that
                computed its tokens: that layer's cache holds tokens ``[0, upto_tokens)``; the
                KDA state is final when ``upto_tokens == L`` (``KVSender.layer_ready``).
            Others as ``LLMEngine.add_request``.

        The step that samples token #1 returns a :class:`RequestOutput` with ``handle`` (with
        :class:`~k3serve.protocol.FirstToken`); the slot and pages stay until :meth:`release`.

        Raises:
            ValueError: as ``LLMEngine.add_request``; ``params.n != 1``.
        """
        if isinstance(params, SamplingParams) and params.n != 1:
            raise ValueError(
                f"SamplingParams.n: must be 1 for a disaggregated request, got {params.n}"
            )
        self.engine.add_request(request_id, prompt_token_ids, params, cache_salt=cache_salt,
                                snapshot_at=snapshot_at, snapshot_on_finish=False)
        self._prefill[request_id] = _PrefillHooks(on_admit, layer_hook)

    def release(self, request_id: str) -> None:
        """The transfer is done: free a held prefill request's slot and pages.

        Raises:
            ValueError: not a held prefill-only request.
        """
        if request_id not in self._prefill or not self.engine.release_held(request_id):
            raise ValueError(f"request_id: {request_id!r} is not a held prefill request")
        del self._prefill[request_id]

    def _handle(self, seq: Seq, res: SampleResult | None) -> CacheHandle:
        cache, req = self.engine.cache, seq.request
        L = len(req.prompt_token_ids)
        first = None
        if res is not None:
            first = FirstToken(res.token_id, res.logprob, res.top_logprobs, L, req.seed)
        pages = cache.block_table(seq.seq_id)[: -(-L // cache.block_size)]
        return CacheHandle(
            req.request_id,
            cache.slot(seq.seq_id),  # type: ignore[arg-type]
            pages,
            L,
            cache.block_size,
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
        self.engine.hold(seq, self._handle(seq, result))
        return True

    def has_request(self, request_id: str) -> bool:
        return request_id in self._reserved

    def on_abort(self, request_id: str) -> bool:
        self._prefill.pop(request_id, None)
        r = self._reserved.pop(request_id, None)
        if r is None:
            return False
        self.engine.free_cache(r)
        return True

    # ================================================================== decode side
    @property
    def num_reserved(self) -> int:
        """Reservations waiting for their cache (:meth:`reserve` not yet admitted or aborted)."""
        return len(self._reserved)

    def can_reserve(self, num_tokens: int) -> bool:
        """Whether a slot and pages for ``num_tokens`` tokens are free now."""
        return self.engine.cache.can_reserve(num_tokens)

    def reserve(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        *,
        num_tokens: int | None = None,
        cache_salt: str | None = None,
    ) -> CacheHandle:
        """Take a slot and pages for a request whose cache will arrive.

        Args:
            request_id: the request.
            prompt_token_ids: its prompt (indexed in this worker's cache once admitted).
            num_tokens: tokens whose cache arrives (default ``L``).
            cache_salt: the request's tenant salt.

        Returns:
            :class:`CacheHandle` (slot, pages covering ``[0, num_tokens)``).

        Raises:
            ValueError: as ``LLMEngine.add_request``; ``num_tokens`` outside
                ``[L, max_model_len)``.
            CacheFullError: no slot or pages now (try later / elsewhere).
        """
        eng = self.engine
        ids = eng.check_request(request_id, prompt_token_ids)
        r = eng.reserve_cache(request_id, ids, num_tokens, cache_salt)
        self._reserved[request_id] = r
        return CacheHandle(request_id, r.slot, r.pages, r.num_tokens, eng.cache.block_size)

    def admit(
        self,
        request_id: str,
        output_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        output_logprobs: Sequence[float] | None = None,
    ) -> RequestOutput | None:
        """The cache arrived; continue the request after ``output_token_ids``.

        Args:
            request_id: a reserved request.
            output_token_ids: tokens sampled elsewhere (token #1, …); the reservation covers
                ``prompt + output_token_ids[:-1]`` (``num_tokens`` at :meth:`reserve`).
            params: the request's params with its seed (the sampler continues at position
                ``num_tokens + 1``).
            output_logprobs: their logprobs (for the outputs; NaN when absent).

        Returns:
            The request's output if it is already finished (a stop in the given tokens or
            ``max_tokens`` reached), else ``None`` (it streams from ``LLMEngine.step``).

        Raises:
            ValueError: not reserved, token count disagreeing with the reservation, bad ids or
                params, ``params.n != 1`` (the reservation stays until aborted).
        """
        r = self._reserved.get(request_id)
        if r is None:
            raise ValueError(f"request_id: {request_id!r} is not reserved")
        out = self.engine.resume(request_id, r, output_token_ids, params, output_logprobs)
        del self._reserved[request_id]
        return out


__all__ = ["CacheReservation", "DisaggConnector", "EngineAPI", "KVConnector"]
