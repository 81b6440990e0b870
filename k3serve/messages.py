"""Typed messages: one pydantic model per hop of the request path (torch-free).

Every body that crosses a process boundary — router ↔ workers, prefill kvstore ↔ decode
kvstore, the SSE events of a decode stream, the transfer's completion metadata — is one of
these models. Servers validate incoming bodies with them (FastAPI answers a bad body with a
4xx naming the field), clients parse replies with them (``Model.model_validate(json)``), and
nobody parses these dicts by hand. The request lifecycle that uses them is numbered in
:mod:`k3serve.protocol`; docs/ARCHITECTURE.md maps who sends which.

Hop by hop (``→`` request body, ``←`` answer)::

    router → decode    POST /internal/reserve    ReserveRequest      ← ReserveResponse
    router → prefill   POST /internal/prefill    PrefillRequest      ← PrefillResponse (token #1)
    router → decode    POST /internal/stream     StreamRequest       ← SSE of StreamEvent
    router → decode    POST /internal/channel    ChannelRequest      ← SSE of StreamEvent,
                                                                       each tagged with its
                                                                       request id (one per
                                                                       router process)
    router → decode    POST /internal/attach     AttachRequest       ← AttachResponse (the
                                                                       stream goes on a channel)
    router → decode    POST /internal/resume     ResumeRequest       ← ResumeResponse (migration)
    router → both      POST /internal/abort      AbortRequest        ← AbortResponse
    router → both      GET  /internal/info                           ← WorkerInfo
    router → both      GET  /internal/cache_events                   ← CacheEvents
    router → both      GET  /internal/cache_state                    ← CacheState
    router → both      GET  /internal/requests                       ← RequestsDebug
    anyone → both      GET  /health                                  ← WorkerHealth
    worker → router    POST /internal/register   RegisterRequest     ← RegisterResponse
    P kvstore → D      POST /kv/pair             PairRequest         ← PairResponse | PairError
    P kvstore → D      POST /kv/status (and TE)  StatusMessage       ← StatusAck
    anyone → D kvstore GET  /kv/health                               ← KVHealth
    inside StatusMessage(kind="done"):           TransferMetadata
    any internal error                                               ← ErrorBody

Conventions: token ids are ints ≥ 0; logprobs are floats in nats, and a logprob that is not
finite (−inf for a masked token, NaN) travels as ``null`` (:func:`finite` is the one
sanitizer); ``top_logprobs`` are ``[token_id, logprob]`` pairs, most likely first. Unknown
fields are ignored (a newer peer may send more), missing required ones are a 4xx.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Iterable
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

from k3serve.sampling import SamplingParams

# ============================================================================ helpers


def finite(x: Any) -> float | None:
    """A logprob for the wire: ``None`` stays ``None``, non-finite floats become ``None``.

    Args:
        x: a number (python or numpy/torch scalar) or ``None``.

    Returns:
        ``float(x)`` when finite, else ``None``.
    """
    if x is None:
        return None
    x = float(x)
    return x if math.isfinite(x) else None


def top_pairs(top: Iterable[tuple[int, float]] | None) -> list[tuple[int, float | None]] | None:
    """``((token_id, logprob), ...)`` → ``[(token_id, logprob | None), ...]`` or ``None``."""
    if top is None:
        return None
    return [(int(t), finite(lp)) for t, lp in top]


def same_secret(got: str | None, want: str) -> bool:
    """Constant-time comparison of a presented secret (API key, cluster token) with the
    expected one. Compares UTF-8 bytes (with ``surrogateescape``), so a non-ASCII header value is
    a plain mismatch, never an exception.

    Args:
        got: the presented value (``None``: nothing presented).
        want: the expected value.

    Returns:
        True when equal.
    """
    if got is None:
        return False
    return secrets.compare_digest(got.encode("utf-8", "surrogateescape"),
                                  want.encode("utf-8", "surrogateescape"))


class Message(BaseModel):
    """Base of every internal message: unknown fields ignored, instances immutable."""

    model_config = ConfigDict(extra="ignore", frozen=True)


TokenId = StrictInt
Logprob = float | None
TopLogprobs = list[tuple[StrictInt, float | None]] | None
FinishReason = Literal["stop", "length", "abort"]
Role = Literal["prefill", "decode"]

# ============================================================================ errors


class ErrorBody(Message):
    """Every internal error answer: ``{"error": CODE, "message": TEXT}``.

    Codes (HTTP status): ``invalid_request`` / ``invalid_sampling`` (400), ``forbidden`` (403),
    ``unknown_request`` (404), ``fingerprint_mismatch`` / ``ticket_refused`` / ``aborted`` /
    ``stream_taken`` (409), ``transfer_pairing_failed`` / ``transfer_setup_failed`` (502),
    ``busy`` (503: no cache for a reservation now, retry elsewhere), ``draining`` (503: the
    worker is shutting down, place the request elsewhere), ``timeout`` (504),
    ``internal_error`` / ``engine_error`` (500).
    """

    error: str
    message: str = ""


# ============================================================================ sampling


class SamplingSpec(Message):
    """:class:`~k3serve.sampling.SamplingParams` on the wire (same names and defaults).

    Only the types are checked here; the ranges are checked by :meth:`to_params`, which
    raises ``ValueError("SamplingParams.<field>: ...")``.
    """

    n: StrictInt = 1
    max_tokens: StrictInt | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: StrictInt = -1
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: StrictInt | None = None
    stop: list[str] = Field(default_factory=list)
    stop_token_ids: list[StrictInt] = Field(default_factory=list)
    ignore_eos: StrictBool = False
    logprobs: StrictInt | None = None
    include_stop_str_in_output: StrictBool = False
    skip_special_tokens: StrictBool = True
    grammar: str | None = None  # structured output (SamplingParams.grammar)

    @classmethod
    def of(cls, params: SamplingParams) -> SamplingSpec:
        """The wire form of ``params``."""
        return cls.model_validate(params.to_dict())

    def to_params(self, require_single: bool = True) -> SamplingParams:
        """The validated :class:`SamplingParams`.

        Args:
            require_single: refuse ``n != 1`` (the router splits ``n > 1`` into sub-requests
                with derived seeds before any internal call).

        Raises:
            ValueError: a field out of range (the message names it).
        """
        params = SamplingParams.from_dict(self.model_dump())
        if require_single and params.n != 1:
            raise ValueError("sampling.n: must be 1 (the router splits n > 1 into sub-requests)")
        return params


# ============================================================================ router ↔ decode


class ReserveRequest(Message):
    """``POST /internal/reserve`` (router → decode): take a state slot and pages for the prompt."""

    request_id: str = Field(min_length=1)
    prompt_token_ids: list[TokenId] = Field(min_length=1)
    sampling: SamplingSpec = Field(default_factory=SamplingSpec)
    n: StrictInt = Field(default=1, ge=1, le=1)
    cache_salt: str | None = None


class ReserveResponse(Message):
    """Answer to :class:`ReserveRequest`: the transfer ticket and where to pair for it
    (the decode kvstore's bootstrap ``host:port``; no memory addresses)."""

    request_id: str
    ticket: str
    bootstrap_addr: str


class StreamRequest(Message):
    """``POST /internal/stream`` (router → decode): open the token stream of a reserved request.

    ``token_id`` / ``logprob``: token #1 as the prefill worker answered it; after a failed
    transfer the decode worker continues from exactly this token.
    """

    request_id: str = Field(min_length=1)
    token_id: TokenId = Field(ge=0)
    logprob: Logprob = None


#: A decode channel with nothing to send writes an SSE comment this often (s): a keep-alive
#: that also lets the router tell a live channel from a silent one (it gives up on a channel
#: that sent nothing for 3 × this).
CHANNEL_PING_S = 15.0

#: A decode channel's id, and a request id sent on one: an SSE ``event:`` field (no CR/LF).
ChannelId = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._:-]+$")]


class ChannelRequest(Message):
    """``POST /internal/channel`` (router → decode): open a decode channel, one long-lived
    SSE body that carries the token streams of every request the router attaches to it
    (:class:`AttachRequest`): each event is one of those streams' events (a
    :class:`StreamEvent`, or ``[DONE]``) with the request id as its SSE ``event:`` field, and
    the events ready together, of any requests, go out in one write. One router process
    opens one per decode worker: the router reads one connection per worker instead of one
    per request (issue 19). Opening a channel of an id that is open replaces it."""

    channel: ChannelId


class AttachRequest(StreamRequest):
    """``POST /internal/attach`` (router → decode): what ``POST /internal/stream`` opens, sent
    on the open decode channel ``channel`` instead of in the answer (which is an
    :class:`AttachResponse` at once). 409 ``unknown_channel``: no such channel is open (the
    router opens it again)."""

    request_id: ChannelId
    channel: ChannelId


class AttachResponse(Message):
    """Answer to :class:`AttachRequest`: the request's events follow on the channel."""

    request_id: str
    channel: str


class TokenLogprob(Message):
    """Logprob of one generated token and, when asked for, its top alternatives."""

    logprob: Logprob = None
    top_logprobs: TopLogprobs = None


class StreamEvent(Message):
    """One SSE ``data:`` event of a decode stream (one per engine step, from token #2 on).

    ``logprobs`` is aligned with ``token_ids``. The stream ends after the event whose
    ``finish_reason`` is set (then ``data: [DONE]``). ``error`` set: the request failed on the
    worker (``finish_reason`` is ``abort``).
    """

    token_ids: list[TokenId] = Field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprob] = Field(default_factory=list)
    finish_reason: FinishReason | None = None
    error: str | None = None

    @classmethod
    def failure(cls, message: str) -> StreamEvent:
        """The final event of a request that failed on the worker."""
        return cls(error=message, finish_reason="abort")


class GenerateRequest(Message):
    """``POST /internal/generate`` (router → a monolithic worker): prefill here AND decode
    here, no hand-off. Answered with token #1 as a :class:`PrefillResponse` (TTFT); the
    request keeps running and ``POST /internal/stream`` (a :class:`StreamRequest` carrying that
    token #1) then yields tokens #2… exactly as after a transfer.

    ``snapshot_at``: block boundaries (tokens) where a KDA snapshot should be kept (the
    router's branch points), as in :class:`PrefillRequest`.
    """

    request_id: str = Field(min_length=1)
    prompt_token_ids: list[TokenId] = Field(min_length=1)
    sampling: SamplingSpec = Field(default_factory=SamplingSpec)
    snapshot_at: list[StrictInt] = Field(default_factory=list)
    cache_salt: str | None = None


class ResumeRequest(Message):
    """``POST /internal/resume`` (router → another decode worker): continue a request whose
    decode worker failed mid-stream (request migration). The worker recomputes the prefill of
    ``prompt_token_ids + output_token_ids`` and samples the next token at position
    ``len(prompt) + len(outputs)``; the outputs count as output — ``max_tokens``, stop
    tokens, the penalties — and are never sampled again. ``sampling.seed`` must be the seed
    the request was sampled with (:attr:`PrefillResponse.seed`), so seeded sampling continues
    exactly. Answered with :class:`ResumeResponse`; then ``POST /internal/stream`` (a
    :class:`StreamRequest` carrying the last output token) yields the tokens after the outputs.

    ``output_logprobs``: the outputs' logprobs (aligned with ``output_token_ids``; missing or
    ``null`` entries are unknown).
    """

    request_id: str = Field(min_length=1)
    prompt_token_ids: list[TokenId] = Field(min_length=1)
    output_token_ids: list[TokenId] = Field(min_length=1)
    output_logprobs: list[Logprob] = Field(default_factory=list)
    sampling: SamplingSpec
    cache_salt: str | None = None


class ResumeResponse(Message):
    """Answer to :class:`ResumeRequest`: the request is queued; the next token is sampled at
    ``position`` (tokens)."""

    request_id: str
    position: StrictInt


# ============================================================================ router ↔ prefill


class PrefillRequest(Message):
    """``POST /internal/prefill`` (router → prefill): compute the prompt, answer token #1, send
    the cache to the decode worker behind ``ticket``.

    ``snapshot_at``: block boundaries (tokens) where a KDA snapshot should be kept (the router's
    branch points). ``debug_fail_transfer_n``: test hook (accepted with
    ``K3SERVE_TEST_HOOKS=1`` only): the first n write submissions of this transfer fail.
    ``events_after``: the last ``seq`` of this worker's cache events the router has applied
    (its cursor in the worker's current epoch): the answer then carries the worker's events
    after it (``PrefillResponse.cache_events``, at most :data:`ANSWER_EVENTS_LIMIT`), the
    prompt's new blocks among them, so the router indexes them without a pull of
    ``GET /internal/cache_events``; ``None``: none wanted.
    """

    request_id: str = Field(min_length=1)
    prompt_token_ids: list[TokenId] = Field(min_length=1)
    sampling: SamplingSpec = Field(default_factory=SamplingSpec)
    ticket: str = Field(min_length=1)
    bootstrap_addr: str = Field(min_length=1)
    snapshot_at: list[StrictInt] = Field(default_factory=list)
    cache_salt: str | None = None
    debug_fail_transfer_n: StrictInt = Field(default=0, ge=0)
    events_after: StrictInt | None = Field(default=None, ge=0)


class PrefillResponse(Message):
    """Token #1 of a prefill (the answer to :class:`PrefillRequest`; TTFT is measured here).

    Attributes:
        token_id: token #1.
        logprob / top_logprobs: its logprob and alternatives.
        num_cached_tokens: prompt tokens reused from the prefix cache (what ``usage.
            prompt_tokens_details.cached_tokens`` reports), a multiple of the block size.
        cached_source: where the reused prefix came from (``local`` pools or the shared
            ``store``).
        text: token #1 decoded alone (a courtesy; the router detokenizes incrementally).
        position: the position token #1 takes (= prompt length L).
        seed: the resolved sampling seed.
        cache_events: the worker's cache events after the request's ``events_after``, as
            ``GET /internal/cache_events?after=...&limit=ANSWER_EVENTS_LIMIT`` would answer
            them at the time of this answer (the prompt's stored blocks included, and the
            worker's load); ``None`` when none were asked for (or from a worker that does
            not send them: the router then pulls them).
    """

    request_id: str
    token_id: TokenId
    logprob: Logprob = None
    top_logprobs: TopLogprobs = None
    num_cached_tokens: StrictInt = 0
    cached_source: Literal["local", "store"] = "local"
    text: str = ""
    position: StrictInt
    seed: StrictInt
    cache_events: CacheEvents | None = None


class TransferMetadata(Message):
    """What the prefill kvstore sends with its ``done`` status, after the cache itself: the
    decode worker admits the request from it at token #2.

    ``sampling`` carries the resolved seed; ``position`` = prompt length (D samples token #2
    at ``position + 1``).
    """

    request_id: str
    prompt_token_ids: list[TokenId]
    token_id: TokenId
    logprob: Logprob = None
    top_logprobs: TopLogprobs = None
    sampling: SamplingSpec
    position: StrictInt
    num_cached_tokens: StrictInt = 0


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
    """

    queued_prefill_tokens: StrictInt = Field(default=0, ge=0)
    running: StrictInt = Field(default=0, ge=0)
    free_pages: StrictInt | None = Field(default=None, ge=0)
    free_slots: StrictInt | None = Field(default=None, ge=0)
    prefills: StrictInt | None = Field(default=None, ge=0)
    prefill_tokens: StrictInt | None = Field(default=None, ge=0)


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

PrefillResponse.model_rebuild()  # its ``cache_events`` field is defined above


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


class RouterHealth(Message):
    """``GET /health`` of the router: 200 when at least one prefill and one decode worker are
    healthy, else 503; ``workers`` only with ``?detail=1``."""

    status: Literal["ok", "unavailable"]
    model: str
    num_workers: StrictInt
    num_workers_healthy: StrictInt
    num_prefill_healthy: StrictInt
    num_decode_healthy: StrictInt
    workers: list[RouterWorkerStatus] | None = None


# ============================================================================ kvstore ↔ kvstore


class CacheRefMsg(Message):
    """Where one request's cache lives in a pool: state slot, latent pages, tokens covered."""

    slot: StrictInt = Field(ge=0)
    pages: list[StrictInt]
    num_tokens: StrictInt = Field(ge=0)


class RegionLayoutMsg(Message):
    """One registered pool region (:class:`kvstore.descriptors.RegionLayout`): base address,
    strides and item size in bytes, per-layer entries."""

    name: str
    kind: Literal["slot", "page"]
    base: StrictInt
    layers: list[StrictInt]
    layer_stride: StrictInt
    item_stride: StrictInt
    num_items: StrictInt
    item_bytes: StrictInt
    tokens_per_item: StrictInt
    dtype: str
    item_shape: list[StrictInt]


class PoolLayoutMsg(Message):
    """A worker's transfer layout (:class:`kvstore.descriptors.PoolLayout`)."""

    model: str = ""
    extra: dict[str, Any] = Field(default_factory=dict)
    regions: list[RegionLayoutMsg]


class PairRequest(Message):
    """``POST /kv/pair`` (prefill kvstore → decode kvstore): pair a sender with a ticket.

    ``fingerprint``: the sender's layout fingerprint (compared field by field; a mismatch is
    refused naming every differing field). ``quiesce_by_s``: the sender writes nothing after
    this many seconds. ``sender_session``: the sender's Transfer Engine session
    (``host:rpc_port`` in P2P mode): a failed ticket whose sender's port refuses connections
    (its process is gone) is released without waiting for ``quiesce_by_s``.
    """

    ticket: str = Field(min_length=1)
    sender: str = Field(min_length=1)
    fingerprint: dict[str, Any] = Field(default_factory=dict)
    quiesce_by_s: float = Field(default=60.0, gt=0)
    sender_session: str | None = None


class PairResponse(Message):
    """Answer to :class:`PairRequest`: the destination (TE session, layout, slot and pages)."""

    session_id: str
    notify_addr: str
    layout: PoolLayoutMsg
    fingerprint: dict[str, Any]
    dst: CacheRefMsg


class PairError(Message):
    """A refused pairing: 404 ``unknown_ticket``, 409 ``already_paired`` /
    ``fingerprint_mismatch`` (``diffs`` + the server's ``fingerprint``), 410 ``ticket_closed``."""

    error: str
    detail: str = ""
    state: str | None = None
    diffs: list[str] | None = None
    fingerprint: dict[str, Any] | None = None


class StatusMessage(Message):
    """A sender's status about one ticket (TE notification named ``k3kv``, or ``POST /kv/status``).

    ``kind``: ``layer`` (progress: ``layers`` = {layer: bytes} of layers whose writes all
    completed since the previous message), ``done`` (everything landed: ``layers`` = the full
    manifest, ``runs``, ``attempts``, ``metadata``), ``failed`` / ``aborted`` (``error``;
    ``layers`` = what did land; ``quiesced`` = the sender will write nothing more).
    """

    ticket: str
    sender: str
    kind: Literal["layer", "done", "failed", "aborted"]
    layers: dict[int, StrictInt] = Field(default_factory=dict)
    runs: StrictInt = 0
    attempts: StrictInt = 0
    elapsed_s: float = 0.0
    error: str = ""
    quiesced: bool = True
    metadata: TransferMetadata | None = None


class StatusAck(Message):
    """Answer to ``POST /kv/status``: 200 accepted, 409 refused (``state`` says why), 400 bad."""

    accepted: bool
    state: str = ""
    error: str | None = None


class KVHealth(Message):
    """``GET /kv/health`` of a decode kvstore bootstrap server."""

    ok: bool
    session_id: str
    fingerprint_hash: str
    open_tickets: StrictInt


__all__ = [name for name, obj in list(globals().items())
           if isinstance(obj, type) and issubclass(obj, Message)] + [
    "finite", "same_secret", "top_pairs"]
