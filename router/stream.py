"""One choice after its token #1: token #1 and the decode worker's events as text deltas.

Steps 6 and 10 of the request lifecycle, router side (:mod:`k3serve.protocol`): token #1 is
counted and sent at once (TTFT), then D's decode stream (:mod:`router.decode_stream`) yields
:class:`~k3serve.messages.StreamEvent` s that the engine's incremental detokenizer turns into
text (stop strings, stop tokens and ``max_tokens`` decided here exactly as offline).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from k3serve.messages import PrefillResponse, StreamEvent, finite
from router.decode_stream import DecodeStreams
from router.metrics import RouterMetrics
from router.migrate import DecodeEvents, Resume, ServedBy
from router.placement import Placement
from router.workers import Worker, WorkerError

if TYPE_CHECKING:
    from k3serve.messages import TokenLogprob as WireLogprob
    from k3serve.sampling import SamplingParams

log = logging.getLogger("k3serve.router")

END = object()  # a choice's last queue item


@dataclass
class TokenLogprob:
    """Log-probability of one generated token and its top alternatives (token id, logprob);
    ``None``: not a finite number (:func:`k3serve.messages.finite`)."""

    token_id: int
    logprob: float | None
    top: list[tuple[int, float | None]]

    @classmethod
    def of(cls, token_id: int, wire: WireLogprob | PrefillResponse | None) -> TokenLogprob:
        """From a worker's logprob message (``None``: none sent)."""
        if wire is None:
            return cls(token_id, None, [])
        return cls(token_id, finite(wire.logprob),
                   [(t, finite(lp)) for t, lp in wire.top_logprobs or ()])


@dataclass
class Delta:
    """New output of one choice: text, token ids, their logprobs, and the finish.

    ``texts``: the text each token completed (aligned with ``token_ids``; ``"".join(texts)
    == text``), kept so that deltas relayed together still attribute text per token (the
    completions logprobs' ``text_offset``); ``None``: all of ``text`` goes to the last token.
    """

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    texts: list[str] | None = None

    def absorb(self, d: Delta) -> None:
        """Append ``d`` (the same choice's next delta) to this one: tokens relayed together
        become one client chunk with the same text, tokens and finish."""
        if self.texts is None:
            self.texts = [self.text if k == len(self.token_ids) - 1 else ""
                          for k in range(len(self.token_ids))]
        self.texts += d.texts if d.texts is not None else [
            d.text if k == len(d.token_ids) - 1 else "" for k in range(len(d.token_ids))]
        if not d.token_ids and d.text:  # text released without a token: the last one's
            if self.texts:
                self.texts[-1] += d.text
            else:
                self.texts = None
        self.text += d.text
        self.token_ids += d.token_ids
        self.logprobs += d.logprobs
        self.finish_reason = d.finish_reason


def relay_batch(index: int, batch: list[StreamEvent], detok, logprobs: bool = True) -> Delta:
    """The events D sent together (one network read, :meth:`router.decode_stream.DecodeStreams.relay`) through
    the choice's detokenizer, as one :class:`Delta`: tokens up to the one that finishes the
    choice; when D ended the stream first (a ``finish_reason`` the detokenizer did not reach),
    the held-back text is released and D's reason kept.

    ``logprobs`` False (the request asked for none): ``Delta.logprobs`` stays empty (no
    :class:`TokenLogprob` per token; nothing renders them), and the batch's tokens go through
    the detokenizer at once (:meth:`~k3serve.tokenizer.detok.IncrementalDetokenizer.update`:
    the same text, tokens and finish; ``Delta.texts`` is ``None``, the per-token split of
    the text being needed only for logprobs' ``text_offset``).
    """
    if not logprobs:
        return _relay_plain(index, batch, detok)
    d = Delta(index, texts=[])
    texts, ids, lps = d.texts, d.token_ids, d.logprobs
    step = detok.step
    for ev in batch:
        wire = ev.logprobs if logprobs else ()
        for k, tok in enumerate(ev.token_ids):
            o = step(tok)
            ids.append(tok)
            if logprobs:
                lps.append(TokenLogprob.of(tok, wire[k] if k < len(wire) else None))
            texts.append(o.new_text)
            if o.finished:
                break
        if detok.finished:
            break
        if ev.finish_reason:  # D ended it first
            rest = detok.finish(ev.finish_reason).new_text
            if texts:
                texts[-1] += rest
            elif rest:
                d.texts = None
            d.text = rest
            break
    d.text = "".join(texts) if d.texts is not None else d.text
    d.finish_reason = detok.finish_reason
    return d


def _relay_plain(index: int, batch: list[StreamEvent], detok) -> Delta:
    """:func:`relay_batch` without logprobs: the tokens up to D's first finish, fed at once."""
    ids: list[int] = []
    reason = None
    for ev in batch:
        ids += ev.token_ids
        if ev.finish_reason:
            reason = ev.finish_reason
            break
    n0 = detok.num_tokens
    text = detok.update(ids).new_text if ids else ""
    d = Delta(index, text, ids[:detok.num_tokens - n0])
    if reason and not detok.finished:  # D ended it first
        d.text += detok.finish(reason).new_text
    d.finish_reason = detok.finish_reason
    return d


@dataclass
class Placed:
    """A choice whose token #1 is back: its workers, placement, answer and held load
    (``hold`` exits :meth:`router.workers.Worker.load` of D when the choice ends)."""

    sub: str
    placement: Placement
    prefill: Worker
    decode: Worker
    first: PrefillResponse
    hold: ExitStack


async def stream_choice(c: Placed, prompt_len: int, index: int, sampling: SamplingParams,
                        out: asyncio.Queue, streams: DecodeStreams, metrics: RouterMetrics,
                        tokenizer, abort: Callable[[Worker, str], None],
                        ttft_since: float | None = None, resume: Resume | None = None) -> None:
    """Put token #1 and then D's tokens #2.. into ``out`` as :class:`Delta` s.

    Args:
        c: The placed choice.
        prompt_len: Prompt length L, tokens.
        index: The choice's index in the response.
        sampling: Its sampling parameters (stops, ``max_tokens``).
        out: Where the deltas go.
        streams / metrics / tokenizer: the router's.
        abort: Aborts a request on a worker in the background.
        ttft_since: Arrival time (monotonic s) when this is the request's first token.
        resume: Moves the request to another decode worker when D fails mid-stream (request
            migration, :mod:`router.migrate`); ``None``: D's failure ends the choice.

    Ends (see :meth:`router.pipeline.Router.run_choice` for the finish reasons) when the
    detokenizer or D finished, or the stream ended without a finish (``length`` at D's model
    length, else ``abort``).

    Raises:
        WorkerError: D failed and the request could not migrate (the held-back text is
            delivered first).
    """
    from k3serve.tokenizer.detok import IncrementalDetokenizer

    P, D, first, sub = c.prefill, c.decode, c.first, c.sub
    metrics.observe_prefill(P.name, prompt_len, {first.cached_source: first.num_cached_tokens},
                            c.placement.predicted_cached_tokens)
    if ttft_since is not None:
        metrics.ttft.labels(P.name).observe(time.monotonic() - ttft_since)
    detok = IncrementalDetokenizer(tokenizer, sampling, eos_token_id=tokenizer.eos_token_id)
    o = detok.step(first.token_id)
    await out.put(Delta(index, o.new_text, [first.token_id],
                        [TokenLogprob.of(first.token_id, first)], o.finish_reason,
                        [o.new_text]))
    if o.finished:
        abort(D, sub)
        return

    last = time.monotonic()
    n_out = 1
    want_lps = sampling.logprobs is not None
    served = ServedBy(metrics, D)  # running / itl of the worker serving it now (migration)
    src = DecodeEvents(streams, D, sub, (first.token_id, finite(first.logprob)), resume, served)

    def handle(batch: list[StreamEvent]) -> bool:
        """One batch of D's events, in the task that read it: relayed into ``out``; True
        once the choice finished."""
        nonlocal last, n_out
        d = relay_batch(index, batch, detok, want_lps)
        t = time.monotonic()
        n = len(d.token_ids)
        if n:
            served.itl.observe_many((t - last) / n, n, t)
        last = t
        n_out += n
        if d.token_ids or d.text or d.finish_reason:
            out.put_nowait(d)  # unbounded: as ``await out.put``
        if d.finish_reason:
            if not batch[-1].finish_reason:  # the router saw the stop first
                abort(src.worker, src.sub)
            return True
        return False

    with contextlib.closing(served):
        try:
            await src.run(handle)
            if not detok.finished:  # the stream ended without a finish_reason
                cap = src.worker.info.max_model_len
                reason = "length" if cap and prompt_len + n_out >= cap else "abort"
                log.warning("request %s: the decode stream of %s ended without a finish "
                            "after %d tokens; finishing with %r", src.sub, src.worker.name,
                            n_out, reason)
                abort(src.worker, src.sub)
                await out.put(Delta(index, detok.finish(reason).new_text,
                                    finish_reason=reason))
        except BaseException as e:
            abort(src.worker, src.sub)
            if isinstance(e, WorkerError) and not detok.finished:
                rest = detok.finish("abort").new_text  # deliver the held-back text first
                if rest:
                    await out.put(Delta(index, rest))
            raise
