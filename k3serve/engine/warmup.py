"""Start-up warm-up: run every forward shape class once before the engine takes requests.

On CUDA the first forward of a shape compiles Triton kernels (one binary per specialization:
token and row counts that are 1, divisible by 16, or neither; prefill with and without cached
context; decode-only vs mixed batches), and takes seconds. :func:`warm_up` runs these shapes
through :meth:`ModelRunner.execute` — the engine's own run seam, so a CUDA-graph runner
replays its captured decode buckets — on throw-away rows:

* prefill chunks of ``C = max_num_batched_tokens`` tokens (first chunk, and a second one
  after ``C`` cached tokens), a ragged one, several short prompts in one batch;
* mixed steps: ``k`` decode rows beside a prefill chunk filling the step, for ``k`` = 1 and
  the decode buckets;
* decode batches at every captured bucket (eager buckets on a runner without graphs);
* with speculative decoding on, a verify forward of ``k + 1`` tokens per row and its state
  replay at every bucket (the draft model of a draft proposer is not warmed here).

The rows use slots ``0 … N−1`` and pages ``0 … P−1`` before the cache manager has handed any
out: nothing is registered, hashed or evented, and every admission zeroes (or loads) its slot
and writes its pages before reading them, so the warm-up leaves no trace a request can see.
Shapes whose slots or pages do not fit the pools are skipped. One side effect is visible:
the warm-up tokens are counted in the MoE ``expert_load`` counters, as the graphs' padding is.

On the CPU the forward is eager PyTorch (nothing to compile): :func:`warm_up` skips unless
``force`` is set.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

from k3serve.engine.runner import Row, RunBatch

log = logging.getLogger("k3serve.engine")

#: context of the decode rows in the warm-up batches (tokens)
DECODE_CONTEXT = 40


@dataclass(frozen=True)
class WarmupReport:
    """What :func:`warm_up` ran: forwards, their seconds, and why it skipped (``""``: ran)."""

    num_forwards: int
    seconds: float
    skipped: str = ""


def warmup_shapes(
    chunk: int, decode_buckets: Sequence[int], max_model_len: int
) -> list[list[tuple[int, int]]]:
    """The warm-up batches, each a list of ``(new_tokens, num_cached)`` rows.

    Args:
        chunk: ``max_num_batched_tokens`` (tokens per step).
        decode_buckets: the decode batch sizes (a CUDA-graph runner's buckets).
        max_model_len: longest sequence; rows past it are left out.

    Returns:
        Batches in run order, with no row over ``max_model_len`` and no batch over ``chunk``
        tokens.
    """
    prefill: list[list[tuple[int, int]]] = [
        [(chunk, 0)],
        [(chunk, chunk)],
        [(max(1, chunk - 13), 0)],
        [(17, 0)],
        [(100, 0), (37, 0), (64, 0)],
    ]
    mixed = [[(1, DECODE_CONTEXT)] * k + [(chunk - k, 0)]
             for k in sorted({1, *decode_buckets}) if k < chunk]
    decode = [[(1, DECODE_CONTEXT)] * b for b in sorted(set(decode_buckets))]
    out = []
    for batch in (*prefill, *mixed, *decode):
        rows = [(n, c) for n, c in batch if n >= 1 and n + c <= max_model_len]
        if rows and sum(n for n, _ in rows) <= chunk:
            out.append(rows)
    return out


def _rows(batch: Sequence[tuple[int, int]], block_size: int, num_slots: int,
          num_pages: int) -> tuple[Row, ...] | None:
    """The batch as runner rows over slots ``0 …`` and pages ``0 …``, or None when it does not
    fit the pools."""
    if len(batch) > num_slots:
        return None
    rows, page = [], 0
    for slot, (n, cached) in enumerate(batch):
        need = -(-(n + cached) // block_size)
        if page + need > num_pages:
            return None
        rows.append(Row(token_ids=[(7 * i + slot) % 97 + 3 for i in range(n)], num_cached=cached,
                        slot=slot, block_table=list(range(page, page + need))))
        page += need
    return tuple(rows)


def warm_up(engine, force: bool = False) -> WarmupReport:
    """Run the shapes of :func:`warmup_shapes` through ``engine.runner.execute`` once.

    Call it after the engine is built and before it takes a request (it uses slots and pages
    as if none were allocated).

    Args:
        engine: a :class:`~k3serve.engine.engine.LLMEngine` with nothing admitted.
        force: run on the CPU too (tests).

    Returns:
        :class:`WarmupReport`.

    Raises:
        RuntimeError: the engine already holds requests.
        Exception: whatever a forward raises (a shape the engine cannot run is a start-up
            error, not a request's).
    """
    runner = engine.runner
    if getattr(runner, "device", None) is None:
        return WarmupReport(0, 0.0, "a multi-rank runner: its ranks warm up on their own")
    if runner.device.type != "cuda" and not force:
        return WarmupReport(0, 0.0, "cpu: eager PyTorch kernels, nothing to compile")
    if engine.requests or getattr(engine.connector, "num_reserved", 0):
        raise RuntimeError("warm_up: the engine already holds requests")
    c = engine.config
    buckets = getattr(runner, "buckets", (1, 2))
    pools = runner.pools
    slots, pages = c.num_slots, c.num_pages
    t0 = time.perf_counter()
    n = used = 0
    for batch in warmup_shapes(c.max_num_batched_tokens, buckets, engine.max_model_len):
        rows = _rows(batch, c.block_size, slots, pages)
        if rows is None:
            log.info("warm-up: %d rows / %d tokens do not fit the pools; skipped",
                     len(batch), sum(r for r, _ in batch))
            continue
        runner.execute(RunBatch(rows))
        n, used = n + 1, max(used, len(rows))
    spec = getattr(engine, "spec", None)
    if spec is not None:  # verify forwards (multi-token rows, capture) and their replay
        k1 = spec.config.num_speculative_tokens + 1
        for b in sorted(set(buckets)):
            rows = _rows([(k1, DECODE_CONTEXT)] * b, c.block_size, slots, pages)
            if rows is None or b * k1 > c.max_num_batched_tokens + b:
                continue
            _, cap = runner.verify(RunBatch(rows))
            runner.replay(cap, list(range(b)), list(range(b)), [0] * b, [k1] * b)
            n, used = n + 1, max(used, b)
    for s in range(used):
        pools.zero_slot(s)
    if runner.device.type == "cuda":
        import torch

        torch.cuda.synchronize(runner.device)
    return WarmupReport(n, time.perf_counter() - t0)


__all__ = ["WarmupReport", "warm_up", "warmup_shapes"]
