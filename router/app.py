"""The router: OpenAI-compatible FastAPI front of the prefill/decode cluster.

One request, in the order the code runs it (DESIGN.md §1)::

    1. /v1/completions | /v1/chat/completions: API key, JSON, schema (router/schemas.py),
       model name, tokenize (the model's tokenizer; chat template), length check.
    2. For each prompt: hash its full blocks (k3serve.cache.hashing.block_hashes, salt =
       workers' fingerprint + cache_salt), match them in the GlobalIndex, and call
       router/placement.place → (prefill P, decode D, predicted cached tokens, snapshot_at).
    3. D /internal/reserve → ticket + bootstrap address; P /internal/prefill with the token
       ids, ticket, address, snapshot_at → token #1 (+ logprobs, actual cached tokens):
       streamed to the client at once (TTFT), counted in the metrics.
    4. D /internal/stream (with token #1, which D continues from should the transfer have
       failed) → tokens #2.. as SSE, turned into text by the engine's incremental
       detokenizer (stop strings, stop tokens, max_tokens decided here exactly as offline).
       A stream that ends without the detokenizer finishing releases its held-back text
       (``IncrementalDetokenizer.finish``); see ``Router.run_choice`` for the finish reason.
    5. Choices 2..n of a prompt start when choice 1's prefill has answered (and P's cache
       events are pulled), so their prefills reuse the prompt's cache.

Errors are OpenAI-style bodies: bad input 400, bad API key 401, no healthy worker or a
worker failure 503 — never a 500 (unexpected exceptions are logged and answered 503).

Run: ``python -m router.app --host 127.0.0.1 --port 8000 --model k3-tiny [--api-key KEY]``;
the cluster token comes from ``$K3SERVE_CLUSTER_TOKEN`` (``k3serve serve`` sets it).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import logging
import math
import os
import re
import secrets
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from k3serve.protocol import API_KEY_ENV, CLUSTER_TOKEN_ENV, CLUSTER_TOKEN_HEADER
from router.metrics import RouterMetrics
from router.placement import (
    POLICIES,
    DecodeWorkerState,
    NoWorkerAvailable,
    Placement,
    PlacementParams,
    PlacementRequest,
    PrefillWorkerState,
    place,
)
from router.schemas import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatResponseMessage,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    TopLogprob,
    Usage,
    error_body,
    new_id,
    now,
    validation_error_body,
)
from router.workers import Worker, WorkerError, WorkerPool

log = logging.getLogger("k3serve.router")


# ============================================================================ config, errors
@dataclass(frozen=True)
class RouterConfig:
    """Everything the router is configured with (read once, in ``main``).

    Attributes:
        model: Served model name (preset or checkpoint folder); requests must name it.
        policy: Prefill placement policy, a key of ``router.placement.POLICIES``.
        api_key: Bearer token required on ``/v1/*``; ``None`` leaves the API open.
        cluster_token: Token exchanged with workers on every internal call.
        tokenizer: Tokenizer name or folder; ``None`` = the model's.
        add_bos: Prepend BOS to text prompts of ``/v1/completions`` (token-id prompts and
            chat templates are used as given).
        poll_interval_s: Seconds between cache-event pulls of each worker.
        poll_timeout_s: Timeout of one cache-event pull, seconds: ``unhealthy_after`` slow
            pulls in a row take a stuck (alive but unresponsive) worker out of placement.
        unhealthy_after: Failed pulls in a row that take a worker out of placement.
        timeout_s: Timeout of one internal call, seconds (a stream: between two events).
        max_model_len: Longest prompt + output in tokens; ``None`` = the workers' (or the
            model config's) value.
        prefill_rate: Prefill tokens/s assumed for workers that do not report one.
        busy_wait_s: How long a request waits for room while every decode worker answers
            ``busy`` (no free slot or pages) before it fails with 503, seconds.
        placement: Cache-aware policy knobs.
    """

    model: str = "k3-tiny"
    policy: str = "cache_aware"
    api_key: str | None = None
    cluster_token: str | None = None
    tokenizer: str | None = None
    add_bos: bool = True
    poll_interval_s: float = 0.1
    poll_timeout_s: float = 10.0
    unhealthy_after: int = 3
    timeout_s: float = 600.0
    max_model_len: int | None = None
    prefill_rate: float = 10_000.0
    busy_wait_s: float = 60.0
    placement: PlacementParams = field(default_factory=PlacementParams)

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy: {self.policy!r} is not one of {sorted(POLICIES)}")
        if self.poll_interval_s <= 0:
            raise ValueError("poll_interval_s: must be > 0")
        if self.poll_timeout_s <= 0:
            raise ValueError("poll_timeout_s: must be > 0")


class APIError(Exception):
    """An error answered as ``{"error": {...}}`` with an HTTP status."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status, message, type, param, code)

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.message, self.type, self.param, self.code),
                            status_code=self.status)


#: Pause before a choice that found every decode worker busy retries its reservation; waiting
#: choices take turns, so at most 1 / BUSY_RETRY_S such retries per second leave the router.
BUSY_RETRY_S = 0.005


def _unavailable(message: str) -> APIError:
    return APIError(503, message, "server_error", code="service_unavailable")


# ============================================================================ one choice
@dataclass
class TokenLogprob:
    """Log-probability of one generated token and its top alternatives (token id, logprob)."""

    token_id: int
    logprob: float | None
    top: list[tuple[int, float]]


@dataclass
class Delta:
    """New output of one choice: text, token ids, their logprobs, and the finish."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None


@dataclass
class PromptJob:
    """One prompt of a request and the choices generated for it."""

    prompt_index: int
    token_ids: list[int]
    max_new: int  # tokens per choice (user's max_tokens, else what the model length leaves)
    cached_tokens: int = 0  # choice 0's actual reuse (usage.prompt_tokens_details)
    prefill: Worker | None = None  # choice 0's workers, known at its token #1
    decode: Worker | None = None


_END = object()  # a choice's last queue item


class Router:
    """Request pipeline, worker pool and metrics of one router process.

    Args:
        config: The router's configuration.
        transport: httpx transport for internal calls (tests route them in-process).
    """

    def __init__(self, config: RouterConfig,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        from k3serve.tokenizer import get_tokenizer

        self.config = config
        self.metrics = RouterMetrics()
        self.pool = WorkerPool(config.model, config.cluster_token, config.poll_interval_s,
                               config.unhealthy_after, config.timeout_s, transport,
                               on_worker=lambda w: self.metrics.add_worker(w.name, w.role),
                               poll_timeout_s=config.poll_timeout_s)
        self.tokenizer = get_tokenizer(config.tokenizer or config.model)
        self._seq = itertools.count()
        self._background: set[asyncio.Task] = set()
        self._model_len: int | None = None
        # Choices waiting for decode room retry one at a time, in turn (FIFO): a crowd of them
        # must not flood the decode workers with reservation attempts.
        self._busy_gate = asyncio.Lock()

    async def close(self) -> None:
        for t in list(self._background):
            with contextlib.suppress(Exception):
                await asyncio.wait_for(t, 5.0)
        await self.pool.close()

    def _spawn(self, coro) -> None:
        t = asyncio.create_task(coro)
        self._background.add(t)
        t.add_done_callback(self._background.discard)

    # ------------------------------------------------------------------ request → prompts
    @property
    def max_model_len(self) -> int:
        """Longest prompt + output, tokens: config, else the smallest a worker reports, else
        the model config's ``max_position_embeddings``."""
        if self.config.max_model_len:
            return self.config.max_model_len
        reported = [w.info.max_model_len for w in self.pool.workers.values()
                    if w.info.max_model_len]
        if reported:
            return min(reported)
        if self._model_len is None:
            from k3serve.config import load_config

            try:
                self._model_len = load_config(self.config.model).max_position_embeddings
            except (ValueError, OSError):
                self._model_len = 1 << 20
        return self._model_len

    def _job(self, index: int, ids: list[int], max_tokens: int | None,
             param: str = "prompt") -> PromptJob:
        limit = self.max_model_len
        vocab = self.tokenizer.vocab_size
        if not ids:
            raise APIError(400, "the prompt is empty", param=param, code="invalid_value")
        if max(ids) >= vocab:
            raise APIError(400, f"token id {max(ids)} is outside the vocabulary [0, {vocab})",
                           param=param, code="invalid_value")
        if len(ids) + (max_tokens or 1) > limit:
            raise APIError(
                400, f"This model's maximum context length is {limit} tokens. However, you "
                f"requested {len(ids) + (max_tokens or 0)} tokens ({len(ids)} in the prompt, "
                f"{max_tokens or 0} for the completion).", param=param,
                code="context_length_exceeded")
        return PromptJob(index, ids, max_tokens if max_tokens else limit - len(ids))

    def completion_jobs(self, req: CompletionRequest) -> list[PromptJob]:
        """Tokenize the prompts of a completions request.

        Raises:
            APIError: empty or over-long prompt, token id outside the vocabulary.
        """
        jobs = []
        for i, p in enumerate(req.prompts()):
            ids = (self.tokenizer.encode(p, add_bos=self.config.add_bos) if isinstance(p, str)
                   else list(p))
            jobs.append(self._job(i, ids, req.max_tokens))
        return jobs

    def chat_jobs(self, req: ChatCompletionRequest) -> list[PromptJob]:
        """Render and tokenize the conversation of a chat request.

        Raises:
            APIError: over-long prompt.
        """
        msgs = [{"role": m.role, "content": m.text()} for m in req.messages]
        try:
            ids = list(self.tokenizer.apply_chat_template(msgs, add_generation_prompt=True,
                                                          tokenize=True))
        except ValueError as e:
            raise APIError(400, str(e), param="messages", code="invalid_value") from None
        return [self._job(0, ids, req.max_new_tokens, "messages")]

    def sampling(self, req: CompletionRequest | ChatCompletionRequest, max_new: int,
                 choice: int, base_seed: int):
        """The ``SamplingParams`` of one choice (n = 1; its own seed).

        Choice 0 uses the request's seed (a fresh one if unset), so ``n = 1`` reproduces
        with the same seed; choice j > 0 uses a seed derived from it, so choices differ.
        """
        from k3serve.sampling import SamplingParams

        if isinstance(req, ChatCompletionRequest):
            logprobs = (req.top_logprobs or 0) if req.logprobs else None
        else:
            logprobs = req.logprobs
        seed = base_seed if choice == 0 else (base_seed * 0x9E3779B97F4A7C15 + choice) % (1 << 63)
        return SamplingParams(
            n=1, max_tokens=max_new, temperature=req.temperature, top_p=req.top_p,
            presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
            seed=seed, stop=tuple(req.stop or ()),
            stop_token_ids=tuple(self.tokenizer.stop_token_ids), logprobs=logprobs)

    # ------------------------------------------------------------------ placement
    def place(self, ids: list[int], cache_salt: str | None, max_new: int,
              exclude: frozenset[str] = frozenset()) -> tuple[Placement, Worker, Worker]:
        """Score the healthy workers and choose (prefill, decode) for one choice.

        Raises:
            NoWorkerAvailable: no healthy prefill or decode worker.
        """
        from k3serve.cache.hashing import block_hashes, make_salt

        prefill = [w for w in self.pool.live("prefill") if w.url not in exclude]
        decode = [w for w in self.pool.live("decode") if w.url not in exclude]
        if not prefill or not decode or self.pool.layout is None:
            raise NoWorkerAvailable(
                f"no healthy {'prefill' if not prefill else 'decode'} worker")
        fingerprint, bs = self.pool.layout
        req = PlacementRequest(len(ids), bs, seq=next(self._seq), max_new_tokens=max_new)
        hashes = block_hashes(ids, bs, make_salt(fingerprint, cache_salt))
        match = self.pool.match(hashes, req.max_cached_blocks)
        pstates = []
        for w in prefill:
            m = match.get(w.url)
            pstates.append(PrefillWorkerState(
                w.url, m.usable_blocks if m else 0, m.mla_blocks if m else 0, w.queued_tokens,
                w.info.prefill_rate or self.config.prefill_rate))
        dstates = []
        for w in decode:
            cap = w.info.capacity_tokens
            dstates.append(DecodeWorkerState(
                w.url, cap - w.reserved_tokens if cap else 1 << 62,
                w.info.num_slots - w.running, w.running))
        p = place(req, pstates, dstates, self.config.policy, self.config.placement)
        return p, self.pool.workers[p.prefill], self.pool.workers[p.decode]

    # ------------------------------------------------------------------ one choice
    async def _busy_turn(self) -> None:
        """Wait for this choice's turn to retry a reservation that found no decode room."""
        async with self._busy_gate:
            await asyncio.sleep(BUSY_RETRY_S)

    async def run_choice(self, job: PromptJob, index: int, choice: int, sampling,
                         cache_salt: str | None, rid: str, arrival: float,
                         out: asyncio.Queue) -> Worker:
        """Run one choice through reserve → prefill → stream, pushing ``Delta``s to ``out``.

        A worker that cannot be reached before anything was computed is marked unhealthy and
        the choice is placed once more elsewhere. A decode worker that answers ``busy`` (no
        free slot or pages) stays healthy: the choice is placed again after a short backoff,
        for up to ``RouterConfig.busy_wait_s``. Cancelling the task aborts the request on
        both workers.

        The router's detokenizer decides stops and ``max_tokens``; when D's stream ends
        before it did, the held-back text (a partial character, the possible start of a stop
        string) is released by ``IncrementalDetokenizer.finish`` and the choice ends with:

        * D's ``finish_reason`` when D sent one: ``"length"`` (D's own model length, below
          what the router allowed: only with ``--max-model-len`` above a worker's),
          ``"stop"``, or ``"abort"`` for anything else (D aborted the request: an error
          finish, the output is truncated);
        * with no ``finish_reason`` at all (``[DONE]`` or the body ended early):
          ``"length"`` when the prompt plus the tokens received reach D's model length (D
          cannot go on), else ``"abort"``; D is told to abort.

        A broken connection, a non-2xx status or an error event is a worker failure
        (``WorkerError``: 503, or an error event mid-stream); the released text is delivered
        before it.

        Returns:
            The prefill worker that ran it.

        Raises:
            NoWorkerAvailable: no healthy worker.
            WorkerError: a worker failed.
        """
        from k3serve.tokenizer.detok import IncrementalDetokenizer

        tried: set[str] = set()
        L = len(job.token_ids)
        need = L + job.max_new
        attempt, busy_since = 0, None
        while True:
            p, P, D = self.place(job.token_ids, cache_salt, job.max_new, frozenset(tried))
            sub = f"{rid}-{index}" + (f"-r{attempt}" if attempt else "")
            D.running += 1
            D.reserved_tokens += need
            try:
                res = await self.pool.post(D, "/internal/reserve", {
                    "request_id": sub, "prompt_token_ids": job.token_ids,
                    "sampling": sampling.to_dict(), "n": 1, "cache_salt": cache_salt})
                ticket, addr = res.get("ticket"), res.get("bootstrap_addr")
                if ticket is None or addr is None:
                    raise WorkerError(D.url, "reserve: answer lacks ticket or bootstrap_addr")
            except BaseException as e:
                D.running -= 1
                D.reserved_tokens -= need
                if isinstance(e, asyncio.CancelledError):
                    self._spawn(self.pool.abort(D, sub))
                if isinstance(e, WorkerError) and e.busy:
                    # D is alive but has no free slot or pages now: wait for room (bounded)
                    # instead of taking it out of placement.
                    busy_since = busy_since if busy_since is not None else time.monotonic()
                    left = self.config.busy_wait_s - (time.monotonic() - busy_since)
                    if left > 0:
                        with contextlib.suppress(TimeoutError):
                            await asyncio.wait_for(self._busy_turn(), left)
                        continue
                    raise NoWorkerAvailable(
                        f"no decode worker had room for the request within "
                        f"{self.config.busy_wait_s:g} s") from None
                if isinstance(e, WorkerError) and e.retryable and attempt == 0:
                    self.pool.mark_failed(D)
                    tried.add(D.url)
                    attempt += 1
                    continue
                raise
            uncached = L - p.predicted_cached_tokens
            P.queued_tokens += uncached
            self.metrics.waiting.labels(P.name).inc()
            try:
                pre = await self.pool.post(P, "/internal/prefill", {
                    "request_id": sub, "prompt_token_ids": job.token_ids,
                    "sampling": sampling.to_dict(), "ticket": ticket, "bootstrap_addr": addr,
                    "snapshot_at": list(p.snapshot_at), "cache_salt": cache_salt})
                token = int(pre["token_id"])
                cached = int(pre.get("num_cached_tokens") or 0)
                source = pre.get("cached_source") or "local"
                if source not in ("local", "store") or not 0 <= cached <= L:
                    raise ValueError(f"cached_source {source!r}, num_cached_tokens {cached}")
                raw_lp = pre.get("logprob")
                raw_lp = None if raw_lp is None else float(raw_lp)
                first_lp = TokenLogprob(token, _opt_float(raw_lp),
                                        _parse_top(pre.get("top_logprobs")))
            except BaseException as e:
                D.running -= 1
                D.reserved_tokens -= need
                self._spawn(self.pool.abort(D, sub))
                if isinstance(e, asyncio.CancelledError):
                    self._spawn(self.pool.abort(P, sub))
                    raise
                if isinstance(e, (KeyError, ValueError, TypeError)):
                    raise WorkerError(P.url, f"prefill: malformed answer: {e!r}") from None
                if isinstance(e, WorkerError) and e.retryable and attempt == 0:
                    self.pool.mark_failed(P)
                    tried.add(P.url)
                    attempt += 1
                    continue
                raise
            finally:
                P.queued_tokens -= uncached
                self.metrics.waiting.labels(P.name).dec()
            break

        # ---- token #1: counted and streamed at once
        self.metrics.observe_prefill(P.name, L, {source: cached}, p.predicted_cached_tokens)
        if choice == 0:
            job.cached_tokens, job.prefill, job.decode = cached, P, D
            if job.prompt_index == 0:  # the request's first token
                self.metrics.ttft.labels(P.name).observe(time.monotonic() - arrival)
        detok = IncrementalDetokenizer(self.tokenizer, sampling,
                                       eos_token_id=self.tokenizer.eos_token_id)
        o = detok.step(token)
        await out.put(Delta(index, o.new_text, [token], [first_lp], o.finish_reason))
        if o.finished:
            D.running -= 1
            D.reserved_tokens -= need
            self._spawn(self.pool.abort(D, sub))
            return P

        # ---- tokens #2.. from the decode worker
        self.metrics.running.labels(D.name).inc()
        itl = self.metrics.itl.labels(D.name)
        last = time.monotonic()
        n_out = 1
        try:
            async for ev in self.pool.stream(D, sub, token, raw_lp):
                ids = [int(t) for t in ev.get("token_ids") or ()]
                lps = _parse_logprobs(ev.get("logprobs"), ids)
                t = time.monotonic()
                for _ in ids:
                    itl.observe((t - last) / len(ids))
                last = t
                d = Delta(index)
                for k, tok in enumerate(ids):
                    o = detok.step(tok)
                    d.token_ids.append(tok)
                    d.logprobs.append(lps[k])
                    d.text += o.new_text
                    if o.finished:
                        break
                n_out += len(d.token_ids)
                if not detok.finished and ev.get("finish_reason"):  # D ended it first
                    d.text += detok.finish(_finish(ev["finish_reason"])).new_text
                d.finish_reason = detok.finish_reason
                if d.token_ids or d.text or d.finish_reason:
                    await out.put(d)
                if d.finish_reason:
                    if not ev.get("finish_reason"):  # the router saw the stop first
                        self._spawn(self.pool.abort(D, sub))
                    break
            if not detok.finished:  # the stream ended without a finish_reason
                cap = D.info.max_model_len
                reason = "length" if cap and L + n_out >= cap else "abort"
                log.warning("request %s: the decode stream of %s ended without a finish after "
                            "%d tokens; finishing with %r", sub, D.name, n_out, reason)
                self._spawn(self.pool.abort(D, sub))
                await out.put(Delta(index, detok.finish(reason).new_text, finish_reason=reason))
        except BaseException as e:
            self._spawn(self.pool.abort(D, sub))
            if isinstance(e, WorkerError) and not detok.finished:
                rest = detok.finish("abort").new_text  # deliver the held-back text first
                if rest:
                    await out.put(Delta(index, rest))
            raise
        finally:
            self.metrics.running.labels(D.name).dec()
            D.running -= 1
            D.reserved_tokens -= need
        return P

    async def run_prompt(self, req: CompletionRequest | ChatCompletionRequest, job: PromptJob,
                         rid: str, arrival: float, out: asyncio.Queue) -> None:
        """Run the ``n`` choices of one prompt; every choice ends with ``_END`` in ``out``.

        Choice 0 goes first; once its prefill answered (token #1 is out) and that prefill
        worker's cache events are pulled, choices 1..n-1 start together and find the prompt
        cached. An exception is put in ``out`` in place of a choice's ``_END``.
        """
        base_seed = req.seed if req.seed is not None else secrets.randbits(63)
        n = req.n
        first_out: asyncio.Queue = asyncio.Queue()
        relay_done = asyncio.Event()

        async def relay() -> None:
            """Forward choice 0's deltas; wake the other choices at its first token."""
            while True:
                item = await first_out.get()
                await out.put(item)
                relay_done.set()
                if item is _END or isinstance(item, BaseException):
                    return

        async def choice(j: int) -> Worker | None:
            q = first_out if j == 0 else out
            try:
                return await self.run_choice(
                    job, job.prompt_index * n + j, j,
                    self.sampling(req, job.max_new, j, base_seed), req.cache_salt, rid,
                    arrival, q)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - delivered to the consumer
                await q.put(e)
                return None
            finally:
                await q.put(_END)

        relay_task = asyncio.create_task(relay())
        first = asyncio.create_task(choice(0))
        others: list[asyncio.Task] = []
        try:
            if n > 1:
                await relay_done.wait()
                if job.prefill is not None:  # pull its events: the prompt is indexed now
                    with contextlib.suppress(WorkerError):
                        await self.pool.sync(job.prefill)
                others = [asyncio.create_task(choice(j)) for j in range(1, n)]
            await asyncio.gather(first, relay_task, *others)
        finally:
            for t in (first, relay_task, *others):
                t.cancel()

    # ------------------------------------------------------------------ request driver
    async def execute(self, req: CompletionRequest | ChatCompletionRequest,
                      jobs: list[PromptJob], rid: str, arrival: float
                      ) -> tuple[asyncio.Queue, list[asyncio.Task], int]:
        """Start every prompt of a request; return (delta queue, tasks, number of choices)."""
        out: asyncio.Queue = asyncio.Queue()
        tasks = [asyncio.create_task(self.run_prompt(req, job, rid, arrival, out))
                 for job in jobs]
        return out, tasks, len(jobs) * req.n


async def _cancel(tasks: Sequence[asyncio.Task]) -> None:
    for t in tasks:
        t.cancel()
    for t in tasks:
        with contextlib.suppress(BaseException):
            await t


def _opt_float(x: Any) -> float | None:
    """A logprob as a JSON-safe float (-inf and NaN become OpenAI's -9999.0)."""
    if x is None:
        return None
    v = float(x)
    return v if math.isfinite(v) else -9999.0


def _parse_top(x: Any) -> list[tuple[int, float]]:
    """Top alternatives as ``[(token_id, logprob)]`` from ``[[id, lp]]``, ``[{"token_id",
    "logprob"}]`` or ``{id: lp}``."""
    if not x:
        return []
    if isinstance(x, dict):
        return [(int(k), _opt_float(v)) for k, v in x.items()]
    out = []
    for e in x:
        if isinstance(e, dict):
            out.append((int(e["token_id"]), _opt_float(e["logprob"])))
        else:
            out.append((int(e[0]), _opt_float(e[1])))
    return out


def _parse_logprobs(x: Any, ids: list[int]) -> list[TokenLogprob]:
    """Per-token logprobs of a decode event: a list aligned with ``token_ids`` whose entries
    are a float or ``{"logprob", "top_logprobs"}``; ``None`` when not asked for."""
    out = []
    for k, tok in enumerate(ids):
        e = x[k] if isinstance(x, list) and k < len(x) else None
        if isinstance(e, dict):
            out.append(TokenLogprob(tok, _opt_float(e.get("logprob")),
                                    _parse_top(e.get("top_logprobs"))))
        else:
            out.append(TokenLogprob(tok, _opt_float(e), []))
    return out


def _finish(reason: Any) -> str | None:
    if not reason:
        return None
    return reason if reason in ("stop", "length") else "abort"


# ============================================================================ responses
@dataclass
class _ChoiceAcc:
    """Everything one choice produced (non-streaming response, usage)."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    token_texts: list[str] = field(default_factory=list)  # text completed by each token
    finish_reason: str | None = None

    def absorb(self, d: Delta) -> None:
        self.text += d.text
        self.token_ids += d.token_ids
        self.logprobs += d.logprobs
        self.token_texts += _token_texts(d)
        self.finish_reason = d.finish_reason or self.finish_reason


def _token_texts(d: Delta) -> list[str]:
    """Text attributed per token: a delta's text goes to its last token."""
    return [d.text if k == len(d.token_ids) - 1 else "" for k in range(len(d.token_ids))]


class _Render:
    """Turns deltas into OpenAI objects (completions or chat)."""

    def __init__(self, router: Router, req: CompletionRequest | ChatCompletionRequest,
                 rid: str, chat: bool) -> None:
        self.router, self.req, self.rid, self.chat = router, req, rid, chat
        self.created = now()
        self.tok = router.tokenizer
        self._offset: dict[int, int] = {}

    def token_str(self, t: int) -> str:
        b = self.tok.decode_bytes([t], skip_special_tokens=False)
        try:
            return b.decode("utf-8")
        except UnicodeDecodeError:
            return "".join(f"bytes:\\x{x:02x}" for x in b)

    def token_bytes(self, t: int) -> list[int]:
        return list(self.tok.decode_bytes([t], skip_special_tokens=False))

    def want_logprobs(self) -> bool:
        if isinstance(self.req, ChatCompletionRequest):
            return self.req.logprobs
        return self.req.logprobs is not None

    def completion_logprobs(self, index: int, lps: list[TokenLogprob],
                            texts: list[str]) -> CompletionLogprobs:
        off = self._offset.get(index, 0)
        res = CompletionLogprobs()
        for lp, piece in zip(lps, texts, strict=True):
            res.tokens.append(self.token_str(lp.token_id))
            res.token_logprobs.append(lp.logprob)
            res.top_logprobs.append({self.token_str(t): v for t, v in lp.top} if lp.top
                                    or self.req.logprobs else None)
            res.text_offset.append(off)
            off += len(piece)
        self._offset[index] = off
        return res

    def chat_logprobs(self, lps: list[TokenLogprob]) -> ChatLogprobs:
        return ChatLogprobs(content=[
            ChatTokenLogprob(
                token=self.token_str(lp.token_id), logprob=lp.logprob if lp.logprob is not None
                else -9999.0, bytes=self.token_bytes(lp.token_id),
                top_logprobs=[TopLogprob(token=self.token_str(t), logprob=v,
                                         bytes=self.token_bytes(t)) for t, v in lp.top])
            for lp in lps])

    def chunk(self, d: Delta, first: bool) -> dict[str, Any]:
        """One SSE chunk for a delta."""
        lp_on = self.want_logprobs() and d.logprobs
        if self.chat:
            delta = DeltaMessage(role="assistant" if first else None, content=d.text
                                 if (d.text or first) else None)
            c = ChatChunkChoice(index=d.index, delta=delta,
                                logprobs=self.chat_logprobs(d.logprobs) if lp_on else None,
                                finish_reason=d.finish_reason)
            return ChatCompletionChunk(id=self.rid, created=self.created,
                                       model=self.router.config.model, choices=[c]
                                       ).model_dump(exclude_none=True)
        c = CompletionChoice(
            index=d.index, text=d.text, finish_reason=d.finish_reason,
            logprobs=self.completion_logprobs(d.index, d.logprobs, _token_texts(d))
            if lp_on else None)
        return CompletionChunk(id=self.rid, created=self.created,
                               model=self.router.config.model, choices=[c]
                               ).model_dump(exclude_none=True)

    def usage(self, jobs: list[PromptJob], accs: dict[int, _ChoiceAcc]) -> Usage:
        prompt = sum(len(j.token_ids) for j in jobs)
        completion = sum(len(a.token_ids) for a in accs.values())
        return Usage(prompt_tokens=prompt, completion_tokens=completion,
                     total_tokens=prompt + completion,
                     prompt_tokens_details=PromptTokensDetails(
                         cached_tokens=sum(j.cached_tokens for j in jobs)))

    def full(self, jobs: list[PromptJob], accs: dict[int, _ChoiceAcc]) -> dict[str, Any]:
        """The non-streaming response."""
        usage = self.usage(jobs, accs)
        if self.chat:
            choices = [ChatChoice(
                index=i, message=ChatResponseMessage(content=a.text),
                logprobs=self.chat_logprobs(a.logprobs) if self.want_logprobs() else None,
                finish_reason=a.finish_reason) for i, a in sorted(accs.items())]
            return ChatCompletionResponse(id=self.rid, created=self.created,
                                          model=self.router.config.model, choices=choices,
                                          usage=usage).model_dump()
        choices = []
        for i, a in sorted(accs.items()):
            lp = None
            if self.want_logprobs():
                self._offset[i] = 0
                lp = self.completion_logprobs(i, a.logprobs, a.token_texts)
            choices.append(CompletionChoice(index=i, text=a.text, logprobs=lp,
                                            finish_reason=a.finish_reason))
        return CompletionResponse(id=self.rid, created=self.created,
                                  model=self.router.config.model, choices=choices,
                                  usage=usage).model_dump()


# ============================================================================ the app
def create_app(config: RouterConfig,
               transport: httpx.AsyncBaseTransport | None = None) -> FastAPI:
    """Build the router's FastAPI app.

    Args:
        config: Router configuration.
        transport: httpx transport for the internal calls (tests); default: the network.

    Returns:
        The app; ``app.state.router`` is its ``Router``.
    """
    router = Router(config, transport)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await router.close()

    app = FastAPI(title="k3serve router", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.router = router

    # ---------------------------------------------------------------- error handlers
    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, e: RequestValidationError) -> JSONResponse:
        return JSONResponse(validation_error_body(list(e.errors())), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = "not_found" if e.status_code == 404 else None
        return JSONResponse(error_body(str(e.detail), "invalid_request_error", code=kind),
                            status_code=e.status_code)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, e: Exception) -> JSONResponse:
        log.exception("unexpected error: %r", e)
        return JSONResponse(error_body(f"internal error: {type(e).__name__}", "server_error",
                                       code="internal_error"), status_code=503)

    # ---------------------------------------------------------------- helpers
    def check_api_key(request: Request) -> None:
        if not config.api_key:
            return
        auth = request.headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        if scheme.lower() != "bearer" or not _same_secret(token.strip(), config.api_key):
            raise APIError(401, "Incorrect API key provided.", code="invalid_api_key")

    def check_cluster_token(request: Request) -> None:
        if not config.cluster_token:
            return
        got = request.headers.get(CLUSTER_TOKEN_HEADER, "")
        if not _same_secret(got, config.cluster_token):
            raise APIError(403, "missing or wrong cluster token", code="forbidden")

    async def parse(request: Request, model: type):
        raw = await request.body()
        try:
            data = json.loads(raw)
        except (ValueError, RecursionError) as e:
            # ValueError: JSONDecodeError, bad UTF-8, an int past Python's digit limit;
            # RecursionError: nesting deeper than the parser's recursion limit
            raise APIError(400, f"request body is not valid JSON: {e}",
                           code="invalid_json") from None
        if not isinstance(data, dict):
            raise APIError(400, "request body must be a JSON object", code="invalid_json")
        bad = _lone_surrogate_field(data)
        if bad is not None:  # "\ud800": valid JSON, but no tokenizer or body can encode it
            raise APIError(400, f"{bad}: a string holds an unpaired UTF-16 surrogate escape",
                           param=bad, code="invalid_value")
        try:
            req = model.model_validate(data)
        except ValidationError as e:
            raise APIError(400, **_split(validation_error_body(e.errors()))) from None
        if req.model != config.model:
            raise APIError(400, f"The model `{req.model}` does not exist; this server serves "
                           f"`{config.model}`.", param="model", code="model_not_found")
        return req

    async def serve(request: Request, chat: bool) -> Response:
        arrival = time.monotonic()
        check_api_key(request)
        req = await parse(request, ChatCompletionRequest if chat else CompletionRequest)
        jobs = router.chat_jobs(req) if chat else router.completion_jobs(req)
        rid = new_id("chatcmpl" if chat else "cmpl")
        render = _Render(router, req, rid, chat)
        out, tasks, num_choices = await router.execute(req, jobs, rid, arrival)
        accs: dict[int, _ChoiceAcc] = {}
        first_seen: set[int] = set()
        # Until the response starts, nothing else notices a client that goes away (a
        # streaming response watches for it itself once it runs): watch here, so that the
        # request is aborted on the workers instead of running to max_tokens.
        watch: list[asyncio.Task | None] = [asyncio.ensure_future(_client_gone(request))]

        def stop_watch() -> None:
            if watch[0] is not None:
                watch[0].cancel()
                watch[0] = None

        async def next_item():
            gone = watch[0]
            if gone is None:
                return await out.get()
            get = asyncio.ensure_future(out.get())
            try:
                await asyncio.wait((get, gone), return_when=asyncio.FIRST_COMPLETED)
            finally:
                if not get.done():
                    get.cancel()
            if get.done() and not get.cancelled():
                return get.result()
            raise APIError(499, "the client closed the request", code="client_closed_request")

        def absorb(d: Delta) -> None:
            accs.setdefault(d.index, _ChoiceAcc()).absorb(d)

        def fail(e: BaseException) -> APIError:
            if isinstance(e, APIError):
                return e
            if isinstance(e, NoWorkerAvailable):
                return _unavailable(str(e))
            log.warning("request %s failed: %s", rid, e)  # worker addresses stay in the log
            return APIError(503, "a worker failed while serving the request; retry",
                            "server_error", code="worker_error")

        def observe_e2e() -> None:
            d = jobs[0].decode
            if d is not None:
                router.metrics.e2e.labels(d.name).observe(time.monotonic() - arrival)

        # Wait for the first output (or error) before answering, so failures before any token
        # get a proper status code.
        ended = 0
        try:
            first = await next_item()
        except BaseException:
            stop_watch()
            await _cancel(tasks)
            raise
        if isinstance(first, BaseException):
            stop_watch()
            await _cancel(tasks)
            raise fail(first)

        if not req.stream:
            try:
                item = first
                while True:
                    if isinstance(item, BaseException):
                        raise fail(item)
                    if item is _END:
                        ended += 1
                        if ended == num_choices:
                            break
                    else:
                        absorb(item)
                    item = await next_item()
            finally:
                stop_watch()
                await _cancel(tasks)
            observe_e2e()
            return JSONResponse(render.full(jobs, accs))

        stop_watch()  # the streaming response watches for a disconnect from here on

        async def sse() -> AsyncIterator[bytes]:
            nonlocal ended
            item = first
            try:
                while True:
                    if isinstance(item, BaseException):
                        err = fail(item)
                        yield _sse(error_body(err.message, err.type, err.param, err.code))
                        break
                    if item is _END:
                        ended += 1
                        if ended == num_choices:
                            break
                    else:
                        absorb(item)
                        yield _sse(render.chunk(item, item.index not in first_seen))
                        first_seen.add(item.index)
                    item = await next_item()
                if ended == num_choices:
                    observe_e2e()
                    if req.include_usage:
                        u = render.usage(jobs, accs).model_dump()
                        obj = "chat.completion.chunk" if chat else "text_completion"
                        yield _sse({"id": rid, "object": obj, "created": render.created,
                                    "model": config.model, "choices": [], "usage": u})
                yield b"data: [DONE]\n\n"
            finally:
                await _cancel(tasks)

        return StreamingResponse(sse(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache",
                                          "X-Accel-Buffering": "no"})

    # ---------------------------------------------------------------- public API
    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await serve(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await serve(request, chat=True)

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        check_api_key(request)
        return ModelList(data=[ModelCard(id=config.model, max_model_len=router.max_model_len)]
                         ).model_dump()

    @app.get("/health")
    async def health(detail: int = 0) -> JSONResponse:
        pool = router.pool
        live_p, live_d = pool.live("prefill"), pool.live("decode")
        body: dict[str, Any] = {
            "status": "ok" if live_p and live_d else "unavailable",
            "model": config.model,
            "num_workers": len(pool.workers),
            "num_workers_healthy": len(live_p) + len(live_d),
            "num_prefill_healthy": len(live_p),
            "num_decode_healthy": len(live_d),
        }
        if detail:
            body["workers"] = [
                {"url": w.url, "name": w.name, "role": w.role, "healthy": w.healthy,
                 "queued_tokens": w.queued_tokens, "running": w.running,
                 "blocks": pool.index.num_blocks(w.url),
                 "snapshots": pool.index.num_snapshots(w.url), "resyncs": w.resyncs}
                for w in pool.workers.values()]
        return JSONResponse(body, status_code=200 if live_p and live_d else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        body, ctype = router.metrics.render()
        return Response(body, media_type=ctype)

    # ---------------------------------------------------------------- internal API
    @app.post("/internal/register")
    async def register(request: Request) -> dict[str, Any]:
        check_cluster_token(request)
        try:
            data = json.loads(await request.body())
            url = data["url"]
            if not isinstance(url, str) or not url.startswith(("http://", "https://")):
                raise ValueError
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError):
            raise APIError(400, 'body must be {"url": "http://host:port"}', param="url",
                           code="invalid_value") from None
        try:
            w = await router.pool.register(url)
        except WorkerError as e:
            raise APIError(503, f"cannot read the worker's info: {e}", "server_error",
                           code="worker_unreachable") from None
        except ValueError as e:
            raise APIError(400, str(e), code="invalid_worker") from None
        return {"ok": True, "worker_id": w.name, "role": w.role, "url": w.url}

    return app


def _same_secret(got: str, want: str) -> bool:
    """Constant-time comparison of a header value with a secret; any text (a header decoded
    as latin-1, a non-ASCII key) compares as UTF-8 bytes instead of raising."""
    return secrets.compare_digest(got.encode("utf-8", "surrogateescape"),
                                  want.encode("utf-8", "surrogateescape"))


_SURROGATE = re.compile(r"[\ud800-\udfff]")


def _lone_surrogate_field(data: dict[str, Any]) -> str | None:
    """The top-level field of a parsed JSON body holding a string with an unpaired
    surrogate (``json.loads`` decodes ``"\\ud800"`` to one), else ``None``. Iterative:
    the body may nest as deep as the parser allowed."""
    for key, value in data.items():
        if isinstance(key, str) and _SURROGATE.search(key):
            return "body"
        stack = [value]
        while stack:
            v = stack.pop()
            if isinstance(v, str):
                if _SURROGATE.search(v):
                    return key
            elif isinstance(v, dict):
                stack.extend(v.keys())
                stack.extend(v.values())
            elif isinstance(v, list):
                stack.extend(v)
    return None


async def _client_gone(request: Request) -> None:
    """Return once the client has disconnected (the ASGI messages after the body)."""
    while (await request.receive()).get("type") != "http.disconnect":
        pass


def _split(body: dict[str, Any]) -> dict[str, Any]:
    e = body["error"]
    return {"message": e["message"], "type": e["type"], "param": e["param"], "code": e["code"]}


def _sse(obj: Any) -> bytes:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n".encode()


# ============================================================================ entry point
def main(argv: list[str] | None = None) -> int:
    """``python -m router.app``: parse flags (and the two environment variables), serve."""
    import uvicorn

    ap = argparse.ArgumentParser(prog="python -m router.app", description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--model", default="k3-tiny")
    ap.add_argument("--policy", default="cache_aware", choices=sorted(POLICIES))
    ap.add_argument("--api-key", default=None,
                    help=f"bearer token for /v1/* (default: ${API_KEY_ENV}, else open)")
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--no-bos", action="store_true", help="do not prepend BOS to text prompts")
    ap.add_argument("--poll-interval", type=float, default=0.1, help="seconds")
    ap.add_argument("--poll-timeout", type=float, default=10.0,
                    help="seconds one cache-event pull may take before it counts as failed")
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--prefill-rate", type=float, default=10_000.0, help="tokens/s")
    ap.add_argument("--log-level", default="warning")
    args = ap.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    config = RouterConfig(
        model=args.model, policy=args.policy,
        api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
        cluster_token=os.environ.get(CLUSTER_TOKEN_ENV) or None, tokenizer=args.tokenizer,
        add_bos=not args.no_bos, poll_interval_s=args.poll_interval,
        poll_timeout_s=args.poll_timeout,
        max_model_len=args.max_model_len, prefill_rate=args.prefill_rate)
    uvicorn.run(create_app(config), host=args.host, port=args.port, log_level=args.log_level)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
