"""The engine's public contract: request lifecycle and the typed values that cross it.

Torch-free (dataclasses only): the router, prefill/ and decode/ import it without the model.

Request lifecycle (DESIGN.md §1), in the order the code runs:

1. **router/app** tokenizes the prompt, chain-hashes its blocks
   (:func:`k3serve.cache.hashing.block_hashes` salted with the workers' layout fingerprint and
   the request's ``cache_salt``) and marks ``snapshot_at`` where the prompt diverges from
   cached ones.
2. **router/placement** picks a prefill worker P (its cached prefix, from the cache events it
   replays with :class:`k3serve.cache.events.EventIndex`, against its queue) and a decode
   worker D; it counts the predicted hit.
3. **decode D** reserves: ``LLMEngine.reserve(request_id, prompt_token_ids)`` takes a KDA
   state slot and pages for the prompt's latents and returns a :class:`CacheHandle` (slot,
   pages, ``num_tokens``). Raises :class:`k3serve.cache.allocator.CacheFullError` when it
   cannot: D answers "busy" and the router retries or picks another D. D's kvstore registers
   the handle behind a transfer ticket.
4. **prefill P** ``LLMEngine.add_prefill_request(request_id, prompt_token_ids, params,
   cache_salt=, snapshot_at=, on_admit=, layer_hook=)``. At admission P looks up its prefix
   cache (usable hit = deepest block boundary with every MLA block AND a KDA snapshot), loads
   the snapshot into a fresh slot, allocates pages for the whole prompt and calls
   ``on_admit(CacheHandle)`` (no token yet) so the sender knows its source.
5. P computes the rest of the prompt in chunks (interleaved with other requests; chunk ends
   are placed on snapshot points) and calls ``layer_hook(layer, upto_tokens)`` after each
   layer of each chunk has written its cache, so the sender overlaps the transfer with compute.
6. P samples token #1 (randomness keyed on (seed, choice, position)); ``LLMEngine.step()``
   returns a :class:`RequestOutput` whose ``handle`` carries the slot, the pages, and
   :class:`FirstToken`; P returns token #1 to the router at once (TTFT). P keeps the slot and
   pages until ``LLMEngine.release(request_id)`` (after the transfer's last write).
7. **kvstore** moves the KDA + conv states and the prompt's MLA latents into D's reservation,
   then notifies D with the metadata: prompt ids, token #1 + logprobs, sampling params with
   the seed, position.
8. **decode D** ``LLMEngine.admit(request_id, output_token_ids=[token #1], params=...)``: the
   prompt's full blocks are indexed in D's cache, the request joins the decode batch at
   token #2; ``step()`` streams tokens #2… back. On a failed transfer D aborts the
   reservation (``abort_request``) and runs the whole request itself
   (``add_request``): no request is lost.
9. Finish (stop token, stop string, ``max_tokens``, model length) or ``abort_request`` at any
   point frees the slot and pages; a finished request's end-of-request KDA snapshot (prompt +
   answer, minus the last sampled token, rounded down to a block) is indexed so the
   conversation's next turn hits on this worker; every index change becomes a cache event.
10. **router/app** streams token #1 then D's tokens (SSE); ``usage.prompt_tokens_details.
    cached_tokens`` is P's :attr:`RequestOutput.num_cached_tokens`.

Offline (one process, both roles): ``k3serve.LLM(...).generate(prompts, params)`` runs
steps 4–9 without the hand-off (``LLMEngine.add_request``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

CLUSTER_TOKEN_HEADER = "X-K3serve-Cluster-Token"
"""Header carrying the cluster token on every internal call (same value as ``router.workers``)."""
CLUSTER_TOKEN_ENV = "K3SERVE_CLUSTER_TOKEN"
"""Environment variable the launcher passes the cluster token in."""


@dataclass(frozen=True)
class FirstToken:
    """Token #1 of a prefill-only request, with what the decode side needs to continue.

    Attributes:
        token_id: the sampled token.
        logprob: its raw log-probability.
        top_logprobs: ``(token_id, logprob)`` alternatives, most likely first, or ``None``.
        position: the position it takes (= prompt length ``L``); D samples token #2 at ``L+1``.
        seed: the resolved sampling seed (send it with the params).
    """

    token_id: int
    logprob: float
    top_logprobs: tuple[tuple[int, float], ...] | None
    position: int
    seed: int


@dataclass(frozen=True)
class CacheHandle:
    """Where one request's cache lives in one engine's pools (``KVPools`` indices).

    Attributes:
        request_id: the request.
        slot: KDA/conv state slot (``kda_state[:, slot]``, ``conv_state[:, slot]``).
        pages: latent pages covering tokens ``[0, num_tokens)`` in order (page ``i`` holds
            ``[i·B, (i+1)·B)`` in ``mla_latent[:, page]``).
        num_tokens: tokens whose latents (and, once final, state) the handle covers.
        block_size: ``B``.
        num_cached_tokens: of those, reused from the prefix cache (prefill side).
        first_token: prefill side, once sampled; ``None`` before (``on_admit``) and on the
            decode side.
    """

    request_id: str
    slot: int
    pages: tuple[int, ...]
    num_tokens: int
    block_size: int
    num_cached_tokens: int = 0
    first_token: FirstToken | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe form."""
        d: dict[str, Any] = {
            "request_id": self.request_id,
            "slot": self.slot,
            "pages": list(self.pages),
            "num_tokens": self.num_tokens,
            "block_size": self.block_size,
            "num_cached_tokens": self.num_cached_tokens,
            "first_token": None,
        }
        if self.first_token is not None:
            ft = self.first_token
            d["first_token"] = {
                "token_id": ft.token_id,
                "logprob": ft.logprob,
                "position": ft.position,
                "seed": ft.seed,
                "top_logprobs": None
                if ft.top_logprobs is None
                else [list(x) for x in ft.top_logprobs],
            }
        return d


@dataclass
class CompletionOutput:
    """One choice of a request.

    Attributes:
        index: choice index.
        text: detokenized output (stop strings cut as ``SamplingParams`` says).
        token_ids: generated tokens (a final stop token included).
        logprobs: per generated token, its raw log-probability.
        top_logprobs: per generated token, alternatives (``None`` if not asked for).
        finish_reason: ``"stop"``, ``"length"``, ``"abort"``, or ``None`` while running.
        stop_reason: the matched stop string or stop token id, else ``None``.
    """

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[Any] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


@dataclass
class RequestOutput:
    """A request's state after an engine step (or at the end of ``LLM.generate``).

    Attributes:
        request_id: the request.
        prompt_token_ids: ``[L]``.
        outputs: one :class:`CompletionOutput` per choice created so far.
        num_cached_tokens: prompt tokens reused from the prefix cache (a multiple of the
            block size, at most ``⌊(L-1)/B⌋·B``).
        finished: every choice ended.
        handle: prefill-only requests: the cache handle with token #1.
        logits: per choice, the ``[V]`` logits each token was sampled from (only with
            ``EngineConfig.record_logits``; torch tensors).
    """

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0
    finished: bool = False
    handle: CacheHandle | None = None
    logits: list[list[Any]] | None = None

    # choice 0 shortcuts (the common n = 1 case)
    @property
    def text(self) -> str:
        return self.outputs[0].text if self.outputs else ""

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids if self.outputs else []

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason if self.outputs else None


__all__ = [
    "CLUSTER_TOKEN_ENV",
    "CLUSTER_TOKEN_HEADER",
    "CacheHandle",
    "CompletionOutput",
    "FirstToken",
    "RequestOutput",
]
