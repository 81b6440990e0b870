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
   reservation (``abort_request``) and runs the request itself from P's token #1 (which the
   router passes when it opens D's stream): ``add_request(request_id, prompt, params,
   output_token_ids=[token #1])`` prefills prompt + token #1 and samples from position
   ``L + 1`` on, token #1 counted as output #1 and never re-sampled — the client's token #1
   and D's continuation always agree, and no request is lost.
9. Finish (stop token, stop string, ``max_tokens``, model length) or ``abort_request`` at any
   point frees the slot and pages; a finished request's end-of-request KDA snapshot (prompt +
   answer, minus the last sampled token, rounded down to a block) is indexed so the
   conversation's next turn hits on this worker (not when the request found the rolling
   snapshot cap, ``EngineConfig.rolling_snapshot_fraction`` of the snapshot budget, taken at
   its last block boundary); every index change becomes a cache event.
10. **router/app** streams token #1 then D's tokens (SSE); ``usage.prompt_tokens_details.
    cached_tokens`` is P's :attr:`RequestOutput.num_cached_tokens`. When D's stream ends
    before the router's detokenizer finished, its held-back text is released
    (``IncrementalDetokenizer.finish``) and the choice ends with D's reason, else ``length``
    at D's model length, else ``abort`` (``router.app.Router.run_choice``).

Offline (one process, both roles): ``k3serve.LLM(...).generate(prompts, params)`` runs
steps 4–9 without the hand-off (``LLMEngine.add_request``).

Internal HTTP API (router ↔ workers; prefill/worker.py, decode/worker.py, router/workers.py)
──────────────────────────────────────────────────────────────────────────────────────────────
JSON over HTTP. Every ``/internal/*`` call carries ``X-K3serve-Cluster-Token:
$K3SERVE_CLUSTER_TOKEN`` when the cluster has a token (403 otherwise); ``/health`` and
``/metrics`` are open. Worker errors answer ``{"error": CODE, "message": TEXT}`` with 400 (bad
body or ids: ``invalid_request``, ``invalid_sampling``), 403, 404 ``unknown_request``, 409
(``fingerprint_mismatch``, ``ticket_refused``, ``aborted``, ``stream_taken``), 502
(``transfer_pairing_failed``, ``transfer_setup_failed``), 503 ``busy`` (no cache for a
reservation now: retry elsewhere), 504 ``timeout``, 500 ``internal_error`` (a bug) or
``engine_error`` (the prefill engine's step failed). ``sampling`` is
``SamplingParams.to_dict()`` with ``n == 1`` (the router splits ``n > 1`` into sub-requests
with derived seeds; set ``seed``: a decode-side fallback then samples tokens #2… exactly as
after a successful transfer). Logprobs that are not finite travel as ``null``.

Both roles::

    GET  /internal/info → {role: "prefill"|"decode", model, fingerprint (hash salt base:
            model layout, block size, pool dtypes and weights identity; equal fingerprints =
            interchangeable caches), weights_id, block_size, capacity: {num_pages,
            num_slots, num_snapshots}, max_model_len, worker_id, enable_prefix_caching,
            kv_layout_hash,
            usage: {pages_used, pages_cached, slots_used, snapshots_used, snapshots_cached,
                    num_running, num_waiting, num_engine_requests, num_reserved, ...}}
            (decode adds bootstrap_addr and usage.{open_tickets, unreleased_tickets,
            num_transfers_pending, num_requests_tracked}; prefill adds
            num_transfers_pending)
    GET  /internal/cache_events?after=SEQ[&limit=N] → {epoch, last_seq, events: [{seq, type:
            "stored"|"removed", block_hashes, snapshot}]}   (LLMEngine.cache_events)
    GET  /internal/cache_state → {epoch, last_seq, blocks, snapshots}   (on a gap / new epoch)
    GET  /internal/requests[?request_id=ID] → {requests: {ID: {...state...}}}   (debugging)
    POST /internal/abort {request_id} → {ok: true, found: bool}   (idempotent)
    GET  /health → 200 {status: "ok", role, worker_id} | 503 when the engine thread died
    GET  /metrics → Prometheus text (DESIGN.md §6 worker names, labels worker + role)

Decode worker::

    POST /internal/reserve {request_id, prompt_token_ids: [L ints], sampling, n: 1,
            cache_salt: str|null}
        → 200 {request_id, ticket, bootstrap_addr: "host:port"}      503 busy · 400
        Takes a slot + pages for L tokens and registers them behind the ticket with the
        kvstore bootstrap server (the prefill worker's kvstore pairs there; only kvstore sees
        addresses). The ticket waits up to K3SERVE_KV_PAIR_TIMEOUT_S (default 600 s) for
        the prefill worker to pair (it pairs when it admits the request, which may queue
        there first), then times out K3SERVE_KV_RECEIVER_TIMEOUT_S (default 60 s) after
        pairing. The router aborts the reservation when its prefill call fails.
    POST /internal/stream {request_id, token_id: int, logprob: float|null}
        token_id / logprob: token #1 as the prefill worker answered it (the router has it
        before it opens the stream). After a failed transfer the decode worker continues
        from exactly this token (never from one it samples itself); with a successful
        transfer the transferred metadata's token #1 is used (they agree).
        → text/event-stream, one ``data: {json}`` per engine step from token #2 on:
            {"token_ids": [int], "text": str, "logprobs": [{"logprob": float|null,
             "top_logprobs": [[id, logprob], ...]|null}] (aligned with token_ids),
             "finish_reason": null|"stop"|"length"|"abort"}
          a failure is {"error": str, "token_ids": [], "finish_reason": "abort"}; the stream
          ends after the event with a finish_reason with ``data: [DONE]``. One stream per
          request (409 for a second one); 404 for an unknown request. Closing the stream
          early aborts the request.
        Token #1 is never streamed (the router has it from the prefill worker). The decode
        worker's own stop checks use the same params, so it stops no later than the router.
    Transfer failure (after the sender's retries, or the ticket's timeout): the decode worker
    recomputes the prefill itself — ``add_request`` with the reserved prompt and params and
    ``output_token_ids=[token_id]`` from the stream request, so it continues from the
    prefill worker's token #1; counted in ``k3serve:kv_transfer_fallbacks_total`` — and
    streams from token #2 as usual. A failure before the stream is opened waits for it
    (holding nothing; given up after ``decode.worker.FIRST_TOKEN_TTL_S``). The reservation
    is freed once no sender can still write into it.

Prefill worker::

    POST /internal/prefill {request_id, prompt_token_ids, sampling, ticket, bootstrap_addr,
            snapshot_at: [int], cache_salt: str|null}
        → 200 {request_id, token_id, logprob, top_logprobs: [[id, logprob]]|null,
               num_cached_tokens, cached_source: "local", text, position (= L), seed}
          answered as soon as token #1 is sampled and the sender has paired (at most 2 s
          more while pairing is slow); the cache keeps flowing to the decode worker after the
          answer, then the metadata {request_id, prompt_token_ids, token_id, logprob,
          top_logprobs, sampling (seed resolved), position, num_cached_tokens} (kvstore
          ``KVSender.finish``); the slot and pages are released when the send ended.
        → 409 fingerprint_mismatch (message names every differing field: block_size, dtypes,
          shapes, layers, model, ``extra.*``: the model's cache-layout fields and weights) ·
          409 ticket_refused (unknown / closed ticket: the decode side aborted) · 502
          transfer_pairing_failed (decode bootstrap unreachable): nothing was kept. A transfer
          that fails after pairing still answers token #1 (the decode worker falls back).
        Test hook (only with K3SERVE_TEST_HOOKS=1): ``debug_fail_transfer_n: int`` makes the
        first n write submissions of this request's sender fail (kvstore ``fail_first_n``);
        K3SERVE_KV_FAIL_FIRST_N does the same for every request.

Registration: a worker started with ``--router-url`` POSTs ``{router}/internal/register
{"url": "http://host:port"}`` (with the cluster token) and, every 2 s, re-registers when the
router's ``GET /health?detail=1`` no longer lists its URL (router restart).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

CLUSTER_TOKEN_HEADER = "X-K3serve-Cluster-Token"
"""Header carrying the cluster token on every internal call (both directions)."""
CLUSTER_TOKEN_ENV = "K3SERVE_CLUSTER_TOKEN"
"""Environment variable the launcher passes the cluster token in."""
API_KEY_ENV = "K3SERVE_API_KEY"
"""Environment variable the router reads its public API key from (when ``--api-key`` is unset)."""


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
    "API_KEY_ENV",
    "CLUSTER_TOKEN_ENV",
    "CLUSTER_TOKEN_HEADER",
    "CacheHandle",
    "CompletionOutput",
    "FirstToken",
    "RequestOutput",
]
