"""router ↔ prefill worker: the prefill request and its answer (token #1)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, StrictInt

from k3serve.messages.base import FinishReason, Logprob, Message, TokenId, TopLogprobs
from k3serve.messages.control import CacheEvents
from k3serve.sampling import SamplingParams

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
    sampling: SamplingParams = Field(default_factory=SamplingParams)
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
        text: the text token #1 released, by the worker's detokenizer (as
            :attr:`StreamEvent.text`: text that may start a stop string held back).
        finish_reason: set when token #1 finished the request (a stop token or string,
            ``max_tokens`` 1): the decode stream then carries nothing more.
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
    finish_reason: FinishReason | None = None
    position: StrictInt
    seed: StrictInt
    cache_events: CacheEvents | None = None


__all__ = [name for name, obj in list(globals().items())
           if isinstance(obj, type) and issubclass(obj, Message) and obj.__module__ == __name__]
