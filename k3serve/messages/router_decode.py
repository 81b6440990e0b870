"""router ↔ decode worker: reserve, the stream and its channel, attach, generate (a
monolithic worker), resume (migration); the stream's events."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, StrictInt

from k3serve.messages.base import FinishReason, Logprob, Message, TokenId, TopLogprobs
from k3serve.sampling import SamplingParams

# ============================================================================ router ↔ decode


class ReserveRequest(Message):
    """``POST /internal/reserve`` (router → decode): take a state slot and pages for the prompt."""

    request_id: str = Field(min_length=1)
    prompt_token_ids: list[TokenId] = Field(min_length=1)
    sampling: SamplingParams = Field(default_factory=SamplingParams)
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
    per request. Opening a channel of an id that is open replaces it."""

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

    The decode worker detokenizes and decides every stop (stop strings, stop tokens,
    ``max_tokens``): ``text`` is the output text these tokens released (text that may still
    start a stop string is held back until it cannot, a matched stop string is cut), and the
    router relays it as is. ``texts``: the text each token released (aligned with
    ``token_ids``, ``"".join(texts) == text``), sent when the request asked for logprobs
    (completions' ``text_offset``), else ``None``. ``logprobs`` is aligned with
    ``token_ids``. The stream ends after the event whose ``finish_reason`` is set (then
    ``data: [DONE]``). ``error`` set: the request failed on the worker (``finish_reason`` is
    ``abort``).
    """

    token_ids: list[TokenId] = Field(default_factory=list)
    text: str = ""
    texts: list[str] | None = None
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
    sampling: SamplingParams = Field(default_factory=SamplingParams)
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
    sampling: SamplingParams
    cache_salt: str | None = None


class ResumeResponse(Message):
    """Answer to :class:`ResumeRequest`: the request is queued; the next token is sampled at
    ``position`` (tokens)."""

    request_id: str
    position: StrictInt


__all__ = [name for name, obj in list(globals().items())
           if isinstance(obj, type) and issubclass(obj, Message) and obj.__module__ == __name__] + ["CHANNEL_PING_S"]
