"""prefill kvstore ↔ decode kvstore: pairing, status (with the transfer's completion
metadata), health."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, StrictInt

from k3serve.messages.base import Logprob, Message, TokenId, TopLogprobs
from k3serve.sampling import SamplingParams

# ============================================================================ kvstore ↔ kvstore

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
    sampling: SamplingParams
    position: StrictInt
    num_cached_tokens: StrictInt = 0



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
           if isinstance(obj, type) and issubclass(obj, Message) and obj.__module__ == __name__]
