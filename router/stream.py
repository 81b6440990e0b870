"""One choice after its token #1: token #1 and the decode worker's events as text deltas.

Steps 6 and 10 of the request lifecycle, router side (:mod:`k3serve.protocol`): token #1 is
counted and sent at once (TTFT), then D's decode stream (:mod:`router.decode_stream`) yields
:class:`~k3serve.messages.StreamEvent` s. The workers' engines detokenize and decide the stops
(stop strings, stop tokens, ``max_tokens``: exactly as offline, by the same detokenizer); the
router relays their text and finish and decodes nothing.
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
from router.workers import Worker

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


def relay_batch(index: int, batch: list[StreamEvent], logprobs: bool = True) -> Delta:
    """The events D sent together (one network read,
    :meth:`router.decode_stream.DecodeStreams.relay`) as one :class:`Delta`: their tokens and
    the text D released for them (D detokenizes and decides the stops; nothing is decoded
    here), up to the event that carries D's finish (tokens after it are not D's news).

    ``logprobs`` False (the request asked for none): ``Delta.logprobs`` stays empty and
    ``Delta.texts`` is ``None``; else one :class:`TokenLogprob` per token, and the text each
    token released (``StreamEvent.texts``, for completions' ``text_offset``) when D sent it.
    """
    d = Delta(index)
    ids = d.token_ids
    texts: list[str] | None = [] if logprobs else None
    parts = []
    for ev in batch:
        ids += ev.token_ids
        parts.append(ev.text)
        if logprobs:
            wire = ev.logprobs
            d.logprobs += [TokenLogprob.of(tok, wire[k] if k < len(wire) else None)
                           for k, tok in enumerate(ev.token_ids)]
            if texts is not None:
                if ev.texts is not None and len(ev.texts) == len(ev.token_ids):
                    texts += ev.texts
                elif not ev.token_ids and texts:  # text without a token: the last one's
                    texts[-1] += ev.text
                elif ev.token_ids or ev.text:
                    texts = None  # D sent none: the text goes to the last token
        if ev.finish_reason:
            d.finish_reason = ev.finish_reason
            break
    d.text = parts[0] if len(parts) == 1 else "".join(parts)
    d.texts = texts
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
                        abort: Callable[[Worker, str], None],
                        ttft_since: float | None = None, resume: Resume | None = None) -> None:
    """Put token #1 and then D's tokens #2.. into ``out`` as :class:`Delta` s.

    Token #1, its text and whether it finished the request come from the answer of the
    worker that computed the prompt (``c.first``); tokens #2.. and their text from D's
    stream. The workers detokenize and decide the stops; this relays what they sent.

    Args:
        c: The placed choice.
        prompt_len: Prompt length L, tokens.
        index: The choice's index in the response.
        sampling: Its sampling parameters (``logprobs``: whether logprobs are relayed).
        out: Where the deltas go.
        streams / metrics: the router's.
        abort: Aborts a request on a worker in the background.
        ttft_since: Arrival time (monotonic s) when this is the request's first token.
        resume: Moves the request to another decode worker when D fails mid-stream (request
            migration, :mod:`router.migrate`); ``None``: D's failure ends the choice.

    Ends (see :meth:`router.pipeline.Router.run_choice` for the finish reasons) when token #1
    or D finished the request, or the stream ended without a finish (``length`` at D's model
    length, else ``abort``; text D still held back is not known here).

    Raises:
        WorkerError: D failed and the request could not migrate.
    """
    P, D, first, sub = c.prefill, c.decode, c.first, c.sub
    metrics.observe_prefill(P.name, prompt_len, {first.cached_source: first.num_cached_tokens},
                            c.placement.predicted_cached_tokens)
    if ttft_since is not None:
        metrics.ttft.labels(P.name).observe(time.monotonic() - ttft_since)
    await out.put(Delta(index, first.text, [first.token_id],
                        [TokenLogprob.of(first.token_id, first)], first.finish_reason,
                        [first.text]))
    if first.finish_reason:
        abort(D, sub)
        return

    last = time.monotonic()
    n_out = 1
    finished = False
    want_lps = sampling.logprobs is not None
    served = ServedBy(metrics, D)  # running / itl of the worker serving it now (migration)
    src = DecodeEvents(streams, D, sub, (first.token_id, finite(first.logprob)), resume, served)

    def handle(batch: list[StreamEvent]) -> bool:
        """One batch of D's events, in the task that read it: relayed into ``out``; True
        once the choice finished."""
        nonlocal last, n_out, finished
        d = relay_batch(index, batch, want_lps)
        t = time.monotonic()
        n = len(d.token_ids)
        if n:
            served.itl.observe_many((t - last) / n, n, t)
        last = t
        n_out += n
        if d.token_ids or d.text or d.finish_reason:
            out.put_nowait(d)  # unbounded: as ``await out.put``
        finished = d.finish_reason is not None
        return finished

    with contextlib.closing(served):
        try:
            await src.run(handle)
            if not finished:  # the stream ended without a finish_reason
                cap = src.worker.info.max_model_len
                reason = "length" if cap and prompt_len + n_out >= cap else "abort"
                log.warning("request %s: the decode stream of %s ended without a finish "
                            "after %d tokens; finishing with %r", src.sub, src.worker.name,
                            n_out, reason)
                abort(src.worker, src.sub)
                await out.put(Delta(index, finish_reason=reason))
        except BaseException:
            abort(src.worker, src.sub)
            raise
