"""router/migrate.py's DecodeEvents against scripted decode streams: a stream that fails mid-way is
resumed after exactly the tokens the consumer took (token #1 first), the new stream continues
from the last of them, the logprobs follow, and the migrations are bounded."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest

from k3serve.messages import StreamEvent, TokenLogprob
from router.migrate import MAX_MIGRATIONS, DecodeEvents
from router.workers import WorkerError


@dataclass(frozen=True)
class W:
    """A worker as DecodeEvents sees it (its URL names it in the log)."""

    url: str


class ScriptedPool:
    """``relay(worker, body, handle)`` (as ``DecodeStreams.relay``) plays
    ``scripts[worker]``: events (one per batch) until ``handle`` returns True, then an
    exception or the end."""

    def __init__(self, scripts: dict[str, list]) -> None:
        self.scripts, self.bodies = scripts, []

    async def relay(self, w, body, handle):
        self.bodies.append((w.url, body))
        for item in self.scripts[w.url]:
            if isinstance(item, BaseException):
                raise item
            if handle([item]):
                return


def ev(*toks: int, finish: str | None = None) -> StreamEvent:
    return StreamEvent(token_ids=list(toks), finish_reason=finish,
                       logprobs=[TokenLogprob(logprob=-t / 8) for t in toks])


def collect(src: DecodeEvents, stop_after: int | None = None) -> list[int]:
    got: list[int] = []

    def handle(batch) -> bool:
        got.extend(t for e in batch for t in e.token_ids)
        return stop_after is not None and len(got) >= stop_after

    asyncio.run(src.run(handle))
    return got


def test_a_failed_stream_resumes_after_the_delivered_tokens():
    pool = ScriptedPool({"d0": [ev(11), ev(12, 13), WorkerError("d0", "stream: ReadError")],
                         "d1": [ev(14), ev(15, finish="length")]})
    calls = []

    async def resume(failed, tokens, lps, k):
        calls.append((failed, tokens, lps, k))
        return W("d1"), "sub-m1"

    src = DecodeEvents(pool, W("d0"), "sub", (10, -1.0), resume)
    assert collect(src) == [11, 12, 13, 14, 15]
    assert calls == [(W("d0"), [10, 11, 12, 13], [-1.0, -11 / 8, -12 / 8, -13 / 8], 1)]
    (w0, b0), (w1, b1) = pool.bodies
    assert (w0, b0.request_id, b0.token_id) == ("d0", "sub", 10)
    assert (w1, b1.request_id, b1.token_id, b1.logprob) == ("d1", "sub-m1", 13, -13 / 8)
    assert (src.worker, src.sub, src.migrations) == (W("d1"), "sub-m1", 1)
    assert src.tokens == [10, 11, 12, 13, 14, 15]


def test_no_resume_or_too_many_failures_raise_the_worker_error():
    boom = [ev(11), WorkerError("d", "stream: gone")]
    with pytest.raises(WorkerError, match="gone"):
        collect(DecodeEvents(ScriptedPool({"d0": boom}), W("d0"), "s", (10, None), None))
    n = 0

    async def resume(failed, tokens, lps, k):
        nonlocal n
        n += 1
        return W(f"d{k}"), f"s-m{k}"

    pool = ScriptedPool({f"d{k}": [ev(20 + k), WorkerError(f"d{k}", "gone")]
                         for k in range(MAX_MIGRATIONS + 1)})
    with pytest.raises(WorkerError):
        collect(DecodeEvents(pool, W("d0"), "s", (10, None), resume))
    assert n == MAX_MIGRATIONS


def test_a_failed_resume_raises_the_original_failure():
    async def resume(failed, tokens, lps, k):
        raise RuntimeError("no other decode worker")

    pool = ScriptedPool({"d0": [ev(11), WorkerError("d0", "stream: original")]})
    with pytest.raises(WorkerError, match="original"):
        collect(DecodeEvents(pool, W("d0"), "s", (10, None), resume))


def test_a_consumer_that_stops_does_not_migrate():
    calls = []

    async def resume(*a):
        calls.append(a)
        return W("d1"), "x"

    pool = ScriptedPool({"d0": [ev(11, 12), WorkerError("d0", "late")]})
    assert collect(DecodeEvents(pool, W("d0"), "s", (10, None), resume), stop_after=2) == [11, 12]
    assert calls == []


def test_tokens_read_between_batches_follow_the_delivered_ones():
    """``tokens`` / ``logprobs`` are counted when read (the relay only notes each batch):
    read after every batch, and after a read and more batches, they are the tokens the
    consumer has, token #1 first, a token sent without a logprob getting ``None``."""
    no_lp = StreamEvent(token_ids=[13, 14], logprobs=[TokenLogprob(logprob=-0.5)])
    pool = ScriptedPool({"d0": [ev(11), ev(12), no_lp, ev(15, finish="stop")]})
    src = DecodeEvents(pool, W("d0"), "sub", (10, -1.0), None)
    seen = []

    def handle(batch) -> bool:
        seen.append((list(src.tokens), list(src.logprobs)))
        return False

    asyncio.run(src.run(handle))
    # a batch counts as delivered once ``handle`` returned
    assert seen == [([10], [-1.0]), ([10, 11], [-1.0, -11 / 8]),
                    ([10, 11, 12], [-1.0, -11 / 8, -12 / 8]),
                    ([10, 11, 12, 13, 14], [-1.0, -11 / 8, -12 / 8, -0.5, None])]
    assert src.tokens == [10, 11, 12, 13, 14, 15]
    assert src.logprobs == [-1.0, -11 / 8, -12 / 8, -0.5, None, -15 / 8]


def test_a_long_stream_counts_its_batches_as_it_goes():
    """Past ``COUNT_EVERY`` delivered batches the tokens are counted (the events are not
    held for the whole stream), and the tokens read at the end are still all of them."""
    from router.migrate import COUNT_EVERY

    n = 2 * COUNT_EVERY + 5
    events = [ev(100 + k) for k in range(n)] + [ev(999, finish="length")]
    src = DecodeEvents(ScriptedPool({"d0": events}), W("d0"), "sub", (10, -1.0), None)
    held = []

    def handle(batch) -> bool:
        held.append(len(src._pending))
        return False

    asyncio.run(src.run(handle))
    assert max(held) < COUNT_EVERY
    assert src.tokens == [10, *range(100, 100 + n), 999]
    assert src.logprobs == [-1.0, *[-(100 + k) / 8 for k in range(n)], -999 / 8]
