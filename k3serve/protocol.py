"""The request lifecycle, numbered in the order the code runs it, and the engine's values.

This is the one description of the request path; docstrings elsewhere point here. Every body
that crosses a process boundary is a model of :mod:`k3serve.messages` (named in brackets);
docs/ARCHITECTURE.md maps the packages and who owns which state. Torch-free (dataclasses
only): the router, the workers and kvstore import it without the model.

1. **router/app.py → router/preprocess.py** ``parse_request`` validates the OpenAI body
   (router/schemas.py); ``Preprocessor`` tokenizes (chat template for chat requests), splits
   ``n > 1`` into one :class:`~router.preprocess.PromptJob` choice each with derived seeds, and
   ``prompt_hashes`` chain-hashes the prompt's full blocks
   (:func:`k3serve.cache.hashing.block_hashes`, salted with the workers' layout fingerprint and
   the request's ``cache_salt``).
2. **router/pipeline.py** ``Router.place`` asks the global index
   (:class:`router.index.GlobalIndex`, fed by every worker's cache events — ``CacheEvents`` /
   ``CacheState`` — by the pollers of router/index_sync.py) which prefix each worker can reuse, and
   calls the pure cost function :func:`router.placement.place`: a prefill worker P, a decode
   worker D, the predicted hit, and ``snapshot_at`` (:func:`router.placement.branch_snapshot`:
   the boundary where this prompt diverges from cached ones). ``Worker.load(...)`` is the one
   context manager that owns the load counters of P and D for the request's lifetime.
3. **decode D** ``POST /internal/reserve`` [``ReserveRequest`` → ``ReserveResponse``]:
   decode/worker.py → ``LLMEngine.reserve`` → :meth:`k3serve.engine.connector.DisaggConnector.reserve`
   takes a KDA state slot and pages for the prompt's latents (:class:`CacheHandle`); a full cache
   raises :class:`k3serve.cache.allocator.CacheFullError` → 503 ``busy`` and the router retries
   or picks another D. D's kvstore registers the handle behind a transfer ticket
   (:class:`kvstore.receiver.KVReceiver`, kvstore/tickets.py); the answer carries the ticket and
   D's bootstrap ``host:port`` (no memory addresses).
4. **prefill P** ``POST /internal/prefill`` [``PrefillRequest``]: prefill/worker.py →
   ``LLMEngine.add_prefill_request`` → ``DisaggConnector.add_prefill_request``. At admission P
   looks up its prefix cache (usable hit = deepest block boundary with every MLA block AND a KDA
   snapshot, :func:`k3serve.cache.prefix.usable_prefix_blocks`), loads the snapshot into a fresh
   slot, takes pages for the whole prompt (``KVConnector.admit_tokens``) and hands the
   :class:`CacheHandle` to the sender (``KVConnector.on_admit``): a
   :class:`kvstore.sender.KVSender` pairs with D's bootstrap server [``PairRequest`` →
   ``PairResponse``; a layout mismatch is refused naming every differing field].
5. P computes the rest of the prompt in chunks (interleaved with other requests; chunk ends on
   snapshot points). Every forward goes through ``ModelRunner.execute(RunBatch)``
   (k3serve/engine/runner.py); ``KVConnector.layer_hook`` runs after each layer wrote its cache,
   so the sender's writes of layer l go out while layer l+1 computes.
6. P samples token #1 (randomness keyed on (seed, choice, position)); ``KVConnector.on_sampled``
   holds the request (``SeqStatus.HELD``) and ``LLMEngine.step()`` returns a
   :class:`RequestOutput` whose ``handle`` carries :class:`FirstToken`. P answers the router at
   once [``PrefillResponse``: token #1, logprobs, ``num_cached_tokens``, ``cached_source``] —
   TTFT is measured here — and keeps slot and pages until ``LLMEngine.release`` after the
   transfer's last write.
7. **kvstore** writes the KDA + conv states and the prompt's MLA latents into D's reservation
   through the Mooncake Transfer Engine (kvstore/writes.py, layer by layer), then reports
   ``done`` [``StatusMessage`` with the per-layer byte manifest and ``TransferMetadata``: prompt
   ids, token #1 + logprobs, sampling with the resolved seed, position] as a TE notification.
   D's ticket succeeds only if every layer's bytes equal what it expects.
8. **router → decode D** ``POST /internal/stream`` [``StreamRequest``: token #1 as P answered
   it]. On success D ``LLMEngine.admit`` → ``DisaggConnector.admit``: the prompt's full blocks are
   indexed in D's cache and the request joins the decode batch at token #2. On a failed or
   expired transfer D frees the reservation once no sender can still write into it and runs the
   request itself from P's token #1: ``LLMEngine.add_request(rid, prompt, params,
   output_token_ids=[token #1])`` prefills prompt + token #1 and samples from position ``L + 1``
   on (token #1 is never re-sampled; counted in ``k3serve:kv_transfer_fallbacks_total``). D
   streams tokens #2… [SSE of ``StreamEvent``, decode/stream.py]. A decode worker that serves
   decode channels (``WorkerInfo.channels``) gets ``POST /internal/attach`` instead
   [``AttachRequest``: the same body and the router's channel id] and sends the same events on
   the router process's one open channel to it (``POST /internal/channel``, each event tagged
   ``event: <request id>``; router.workers.DecodeChannel): one connection per decode worker
   and router process, and the events of many requests in one write.
9. Finish (stop token, stop string, ``max_tokens``, model length) or ``POST /internal/abort``
   [``AbortRequest``] at any point frees the slot and pages (``KVConnector.on_abort``); a
   finished request's end-of-request KDA snapshot (prompt + answer, minus the last sampled token,
   rounded down to a block) is indexed so the conversation's next turn hits on this worker (not
   when the request found the rolling snapshot cap, ``EngineConfig.rolling_snapshot_fraction``
   of the snapshot budget); every index change becomes a cache event.
10. **router/stream.py** ``stream_choice`` relays token #1 (P's answer: its text and
    whether it finished the request) then D's events; the workers' engines detokenize and
    decide the stops (stop strings, stop tokens, ``max_tokens``: the incremental detokenizer,
    k3serve/tokenizer/detok.py), the router decodes nothing. router/render.py renders OpenAI
    chunks / the full response; ``usage.prompt_tokens_details.cached_tokens`` is P's
    ``num_cached_tokens``. When D's stream ends without a finish, the choice ends with
    ``length`` at D's model length, else ``abort``.
11. **Failures.** Before token #1 (a worker unreachable or killed mid-call, an error answer
    such as 502 ``transfer_pairing_failed``) nothing reached the client: both reservations are
    aborted and the choice is placed again, on other workers where there are (router/pipeline.py,
    ``FIRST_TOKEN_ATTEMPTS``). After token #1, when D's stream fails (D killed, connection
    dropped, an error event) the request migrates (router/migrate.py): another decode worker
    gets ``POST /internal/resume`` [``ResumeRequest``: prompt + every token the client has,
    the seed] and recomputes prompt + outputs as in step 8's fallback, sampling on at position
    ``L + len(outputs)``; its detokenizer, fed the same outputs, has released the same text,
    so its stream's text goes on with no gap and no repeat. Every transfer has deadlines on both sides (the ticket's
    ``pair_timeout_s`` / ``receiver_timeout_s``, the sender's ``sender_timeout_s``; counted in
    ``k3serve:kv_transfer_expiries_total``); a failed ticket's reservation is released once its
    sender quiesced, its announced quiesce time passed, or its TE port refuses connections (the
    sender's process is gone). ``K3SERVE_KV_FAULT_FAIL_FRACTION`` / ``_HANG_FRACTION`` inject
    transfer failures and hangs (kvstore/faults.py).

Offline (one process, both roles): ``k3serve.LLM(...).generate(prompts, params)`` runs steps 4–9
without the hand-off (``LLMEngine.add_request``; ``LLMEngine.connector is None``).

Internal HTTP API: JSON over HTTP, the bodies are the models of :mod:`k3serve.messages` (its
docstring lists every route with its request and answer). Every ``/internal/*`` and ``/kv/*``
call carries ``X-K3serve-Cluster-Token`` when the cluster has a token (403 otherwise);
``/health`` and ``/metrics`` are open. Errors answer ``ErrorBody`` (codes listed there).
Workers register with ``POST {router}/internal/register`` [``RegisterRequest``] and re-register
whenever the router's ``GET /health?detail=1`` [``RouterHealth``] no longer lists them (router
restart). Test hook (only with ``K3SERVE_TEST_HOOKS=1``): ``PrefillRequest.debug_fail_transfer_n``
makes the first n write submissions of that request's sender fail; ``K3SERVE_KV_FAIL_FIRST_N``
does the same for every request.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

CLUSTER_TOKEN_HEADER = "X-K3serve-Cluster-Token"
"""Header carrying the cluster token on every internal call (both directions)."""
CLUSTER_TOKEN_ENV = "K3SERVE_CLUSTER_TOKEN"
"""Environment variable the launcher passes the cluster token in."""
API_KEY_ENV = "K3SERVE_API_KEY"
"""Environment variable the router reads its public API keys from (when ``--api-key`` is
unset): one key, or several separated by whitespace (:func:`api_keys_env`)."""


def api_keys_env(keys: str | Sequence[str] | None) -> str:
    """The :data:`API_KEY_ENV` value for ``keys`` (one key, or a list of them): the keys
    separated by spaces ("" for none). A bearer token holds no whitespace, so the router
    splits it back (:func:`api_keys_from_env`).

    Raises:
        ValueError: a key that is empty or holds whitespace (``--api-key`` names it).
    """
    out = [keys] if isinstance(keys, str) else list(keys or ())
    for k in out:
        if not k or k != "".join(k.split()):
            raise ValueError(f"--api-key: a key must be non-empty and hold no whitespace "
                             f"(got {len(k)} characters)")
    return " ".join(out)


def api_keys_from_env(value: str | None) -> list[str]:
    """The keys of an :data:`API_KEY_ENV` value (whitespace-separated; none when unset)."""
    return (value or "").split()


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
        text_ends: per generated token, ``len(text)`` right after it (the text each token
            released; ``None`` if logprobs were not asked for).
    """

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[Any] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    text_ends: list[int] | None = None


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
    "api_keys_env",
    "api_keys_from_env",
]
