"""router ↔ both roles: abort, cache events and state, info, health, the debug view,
registration, and the router's own health."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, StrictInt

from k3serve.messages.base import Message, Role

# ============================================================================ both roles


class AbortRequest(Message):
    """``POST /internal/abort``: end a request wherever it is (idempotent)."""

    request_id: str = Field(min_length=1)


class AbortResponse(Message):
    """Answer to :class:`AbortRequest`; ``found``: the worker knew the request."""

    ok: bool = True
    found: bool


class CacheEvent(Message):
    """One change of a worker's prefix index (:class:`k3serve.cache.events.EventLog`).

    ``snapshot: false``: MLA blocks stored/removed; ``snapshot: true``: a KDA snapshot at the
    boundary after the named block(s). ``source: "store"``: the worker put these into the
    shared store (the router indexes them under the store, not under the worker).
    """

    seq: StrictInt = Field(ge=1)
    type: Literal["stored", "removed"]
    block_hashes: list[str] = Field(min_length=1)
    snapshot: bool = False
    source: Literal["local", "store"] = "local"


class SpecCounters(Message):
    """A decode worker's speculative-decoding counters since it started (reset with its event
    epoch), as its ``k3serve:spec_*`` counters on ``/metrics``; the router sums them over
    the workers (``router.spec_metrics``).

    Attributes:
        verify_steps: verify forwards. verify_rows: sequence-steps verified.
        proposed_tokens: proposals verified. accepted_tokens: proposals accepted.
        emitted_tokens: tokens the verify steps appended.
        accepted_per_position: ``[j]``: verified rows whose proposal at position ``j``
            (0-based) was accepted.
    """

    verify_steps: StrictInt = Field(default=0, ge=0)
    verify_rows: StrictInt = Field(default=0, ge=0)
    proposed_tokens: StrictInt = Field(default=0, ge=0)
    accepted_tokens: StrictInt = Field(default=0, ge=0)
    emitted_tokens: StrictInt = Field(default=0, ge=0)
    accepted_per_position: list[Annotated[StrictInt, Field(ge=0)]] = Field(default_factory=list)


class WorkerLoad(Message):
    """The load a worker reports with its cache events (``CacheEvents.load``), counted on the
    worker, so that router replicas that do not talk to each other balance on the same
    figures (each one's own account covers only the requests it sent).

    Attributes:
        queued_prefill_tokens: prompt tokens admitted and not computed yet (prefill).
        running: requests in the decode batch plus those reserved and not admitted yet.
        free_pages: free + evictable cache pages (``block_size`` tokens each).
        free_slots: free state slots.
        prefills: prefill requests admitted since the worker started (a counter, reset with
            its event epoch; ``None``: not counted — a decode worker, an older worker).
        prefill_tokens: their uncached prompt tokens (prompt minus the reused prefix: the
            tokens it computes), a counter like ``prefills``. With both, every router replica
            accounts the worker's recent work and request rate over all replicas' requests
            (``router.policies.load.PoolLoad``), as one router counts its own.
        prefill_rate: measured prefill throughput, tokens per second (> 0): prompt tokens
            computed over the seconds of the engine steps that computed them, over its recent
            such steps (``worker.loop.PrefillMeter``; decode-only steps excluded). ``None``:
            no prefill measured yet. The router prices the worker's queue at it in place of
            its static ``--prefill-rate``.
        spec: the speculative-decoding counters (:class:`SpecCounters`); ``None``: the
            worker does not speculate.
    """

    queued_prefill_tokens: StrictInt = Field(default=0, ge=0)
    running: StrictInt = Field(default=0, ge=0)
    free_pages: StrictInt | None = Field(default=None, ge=0)
    free_slots: StrictInt | None = Field(default=None, ge=0)
    prefills: StrictInt | None = Field(default=None, ge=0)
    prefill_tokens: StrictInt | None = Field(default=None, ge=0)
    prefill_rate: float | None = Field(default=None, gt=0)
    spec: SpecCounters | None = None


class CacheEvents(Message):
    """``GET /internal/cache_events?after=SEQ``: events with ``seq > after``.

    A reader that sees another ``epoch`` or a gap in ``seq`` reloads :class:`CacheState`.
    ``load``: the worker's load now (:class:`WorkerLoad`; ``None`` from a worker that does
    not report it).
    """

    epoch: str
    last_seq: StrictInt = Field(ge=0)
    events: list[CacheEvent] = Field(default_factory=list)
    load: WorkerLoad | None = None


#: Most cache events a token-#1 answer carries (``PrefillRequest.events_after``); a router
#: further behind pulls the rest.
ANSWER_EVENTS_LIMIT = 256



class CacheState(Message):
    """``GET /internal/cache_state``: the whole index (after a gap or a new epoch)."""

    epoch: str
    last_seq: StrictInt = Field(ge=0)
    blocks: list[str] = Field(default_factory=list)
    snapshots: list[str] = Field(default_factory=list)


class Capacity(Message):
    """Cache capacity of a worker (pages of ``block_size`` tokens, state slots, snapshots)."""

    num_pages: StrictInt = Field(ge=0)
    num_slots: StrictInt = Field(default=1 << 30, ge=0)
    num_snapshots: StrictInt = Field(default=0, ge=0)


class WorkerUsage(Message):
    """Occupancy of a worker now (pages, slots, snapshots, requests); decode workers add their
    ticket counts. Counts, not bytes."""

    pages_used: StrictInt = 0
    pages_cached: StrictInt = 0
    slots_used: StrictInt = 0
    snapshots_used: StrictInt = 0
    snapshots_cached: StrictInt = 0
    num_running: StrictInt = 0
    num_waiting: StrictInt = 0
    num_engine_requests: StrictInt = 0
    num_reserved: StrictInt = 0
    open_tickets: StrictInt | None = None
    unreleased_tickets: StrictInt | None = None
    num_transfers_pending: StrictInt | None = None
    num_requests_tracked: StrictInt | None = None


class WorkerInfo(Message):
    """``GET /internal/info``: what a worker is, so the router hashes exactly as it does.

    Attributes:
        role: ``prefill`` or ``decode``.
        model: served model name (must equal the router's).
        fingerprint: layout fingerprint = the block-hash salt base (model layout, block size,
            pool dtypes, weights identity); equal fingerprints = interchangeable caches.
        weights_id: identity of the loaded weights.
        block_size: tokens per cache block.
        capacity: cache capacity.
        max_model_len: longest sequence (prompt + output) in tokens.
        worker_id: the worker's own name (metric label).
        enable_prefix_caching: whether it reuses prefixes.
        kv_layout_hash: hash of the kvstore transfer layout.
        bootstrap_addr: decode only: the kvstore bootstrap ``host:port``.
        prefill_rate: prefill throughput in tokens/s when known (TTFT estimate).
        usage: occupancy now.
        tp: tensor-parallel ranks of the instance (a prefill/decode pair must agree).
        ep: expert-parallel ranks of the instance.
        channels: decode only: it serves decode channels (:class:`ChannelRequest`,
            :class:`AttachRequest`); older workers leave it False and the router opens one
            stream per request.
    """

    role: Role
    model: str
    fingerprint: str = Field(min_length=1)
    weights_id: str = ""
    block_size: StrictInt = Field(ge=1)
    capacity: Capacity
    max_model_len: StrictInt | None = Field(default=None, ge=1)
    worker_id: str | None = None
    enable_prefix_caching: bool = True
    kv_layout_hash: str = ""
    bootstrap_addr: str | None = None
    prefill_rate: float | None = Field(default=None, gt=0)
    usage: WorkerUsage = Field(default_factory=WorkerUsage)
    tp: StrictInt = Field(default=1, ge=1)
    ep: StrictInt = Field(default=1, ge=1)
    channels: bool = False

    @property
    def capacity_tokens(self) -> int:
        """MLA cache capacity in tokens."""
        return self.capacity.num_pages * self.block_size


class WorkerHealth(Message):
    """``GET /health`` of a worker: 200 ``ok``, 503 ``engine_stopped`` (its engine thread died)
    or ``draining`` (SIGTERM: it admits nothing new, finishes what runs, then exits)."""

    status: Literal["ok", "engine_stopped", "draining"]
    role: Role
    worker_id: str


class RequestState(Message):
    """One tracked request in ``GET /internal/requests`` (debugging; fields by role)."""

    phase: str | None = None
    sender_state: str | None = None
    ticket_state: str | None = None
    ticket_error: str | None = None
    fallback: bool | None = None
    held: bool | None = None
    answered: bool | None = None
    aborting: bool | None = None
    reservation_open: bool | None = None
    tokens_sent: StrictInt | None = None
    num_cached_tokens: StrictInt | None = None


class RequestsDebug(Message):
    """``GET /internal/requests[?request_id=ID]``: the requests a worker tracks."""

    requests: dict[str, RequestState] = Field(default_factory=dict)


class RegisterRequest(Message):
    """``POST {router}/internal/register`` (worker → router), again after a router restart."""

    url: str = Field(pattern=r"^https?://")


class RegisterResponse(Message):
    """Answer to :class:`RegisterRequest`."""

    ok: bool = True
    worker_id: str
    role: Role
    url: str


class RouterWorkerStatus(Message):
    """One worker as the router sees it (``GET /health?detail=1`` of the router)."""

    url: str
    name: str
    role: Role
    healthy: bool  # in placement: polls answer, liveness probe answers, breaker not open
    queued_tokens: StrictInt = 0
    running: StrictInt = 0
    blocks: StrictInt = 0
    snapshots: StrictInt = 0
    resyncs: StrictInt = 0


class StoreHealth(Message):
    """The shared store's master as the router sees it (``RouterHealth.store``): ``up`` while
    its RPC port accepts a connection, ``down`` while not, ``unknown`` before the first check;
    ``since``: Unix seconds of the last change, ``for_s``: seconds since; ``url`` only with
    ``?detail=1``."""

    status: Literal["up", "down", "unknown"]
    since: float
    for_s: float = 0.0
    url: str | None = None


class RouterHealth(Message):
    """``GET /health`` of the router: 200 when at least one prefill and one decode worker are
    healthy, else 503; ``workers`` only with ``?detail=1``; ``store`` when the router knows
    the store's master (``--store-url``; a store down keeps the status: requests are served
    without it)."""

    status: Literal["ok", "unavailable"]
    model: str
    num_workers: StrictInt
    num_workers_healthy: StrictInt
    num_prefill_healthy: StrictInt
    num_decode_healthy: StrictInt
    workers: list[RouterWorkerStatus] | None = None
    store: StoreHealth | None = None


__all__ = [name for name, obj in list(globals().items())
           if isinstance(obj, type) and issubclass(obj, Message) and obj.__module__ == __name__] + ["ANSWER_EVENTS_LIMIT"]
