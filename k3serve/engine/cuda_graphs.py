"""CUDA-graph decode: one captured graph per batch-size bucket, replayed at the runner's seam.

What vLLM / SGLang do for decode, on :meth:`ModelRunner.execute`: a decode-only
:class:`~k3serve.engine.runner.RunBatch` of ``N ≤ max(buckets)`` rows and no layer hook is
padded to the smallest captured bucket ``b ≥ N`` and replayed; anything else (a prefill chunk,
a mixed group, a layer hook, ``N`` above the largest bucket, a CPU device) runs the eager
:meth:`~k3serve.engine.runner.ModelRunner.forward`.

Static inputs (:class:`StaticDecodeBuffers`), one flat int64 device tensor whose sections the
captured graphs read (``Bmax`` = largest bucket, ``W = ceil(max_model_len / block_size)``)::

    meta = [ input_ids Bmax | num_cached Bmax | state_slots Bmax | slot_mapping Bmax | block_table Bmax·W ]

One step fills a pinned host copy of ``meta`` with plain Python writes and sends it with ONE
asynchronous host→device copy (no device→host read anywhere in the step: the logits the
sampler reads afterwards are the step's only sync). ``cu_seqlens = arange(b + 1)`` is constant
for decode and lives beside ``meta``.

Padding rows ``N ≤ i < b`` decode token 0 at position 0 against a scratch state slot and a
scratch page that the cache manager never hands out (the engine allocates the pools one slot
and one page larger: ``scratch_slot = num_slots``, ``scratch_page = num_pages``). Decode rows
are independent (per-token mixers and FFN; each row reads only its own slot and pages), so the
real rows' logits, states and latents are exactly the eager forward's; the scratch slot is
zeroed before every replay so its garbage stays bounded. One side effect is visible: the
padding tokens are counted in the MoE ``expert_load`` counters (the placement planner's input).

Capture needs the model's MoE expert stacks built first (``MoE.stacked_experts()`` allocates):
:meth:`CUDAGraphRunner.capture` builds them, warms every bucket up eagerly once (Triton
compiles), then captures the buckets largest first into one shared memory pool.

Speculative verify steps (``verify_k`` > 0) are captured too, one graph per ``(bucket, k)``
shape (:mod:`k3serve.engine.spec.verify_graphs`: planning, static buffers, padding) into the
same pool, each warmed up eagerly just before its capture; their logits go to one shared
static buffer. :meth:`CUDAGraphRunner.verify` replays a uniform verify batch (every row
``k + 1`` tokens, no layer hook) and falls back to the eager
:meth:`~k3serve.engine.runner.ModelRunner.verify` otherwise; :meth:`verify_padded` runs the
graphs' computation eagerly (the reference). :meth:`CUDAGraphRunner.capture_verify` takes the
recording function, so the capture and replay bookkeeping also runs off CUDA with a stand-in
graph object.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from k3serve.cache.pools import KVPools
from k3serve.engine.runner import ModelRunner, Row, RunBatch
from k3serve.engine.spec.verify_graphs import (
    StaticVerifyBuffers,
    real_rows,
    verify_eligible,
    verify_shapes,
)
from k3serve.model.batch import ForwardBatch
from k3serve.model.capture import KDACapture


class Graph(Protocol):
    """A recorded computation that :meth:`replay` re-runs on the same static buffers
    (``torch.cuda.CUDAGraph``, or a CPU stand-in in tests)."""

    def replay(self) -> None: ...


Recorder = Callable[[Callable[[], Any]], tuple[Graph, Any]]
"""``record(fn) → (graph, fn's outputs)``: the graph re-runs ``fn`` into those outputs."""


def default_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """Captured batch sizes (vLLM's schedule): 1, 2, 4, 8, then multiples of 16, the last
    one the first that holds ``max_num_seqs`` (``max_num_seqs`` itself when ≤ 8).

    Raises:
        ValueError: ``max_num_seqs`` < 1.
    """
    if not isinstance(max_num_seqs, int) or isinstance(max_num_seqs, bool) or max_num_seqs < 1:
        raise ValueError(f"max_num_seqs: must be an int ≥ 1, got {max_num_seqs!r}")
    top = max_num_seqs if max_num_seqs <= 8 else -(-max_num_seqs // 16) * 16
    cands = [1, 2, 4, 8, *range(16, top + 1, 16)]
    return tuple([b for b in cands if b < top] + [top])


def choose_bucket(n: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket ``≥ n``, or None when ``n`` exceeds them all (eager then).

    Raises:
        ValueError: ``n`` < 1.
    """
    if n < 1:
        raise ValueError(f"n: a batch has ≥ 1 row, got {n}")
    for b in sorted(buckets):
        if b >= n:
            return b
    return None


def graph_eligible(batch: RunBatch, buckets: Sequence[int]) -> int | None:
    """The bucket a batch replays in, or None when it must run eagerly: not decode-only, a
    layer hook (Python cannot run inside a graph), or more rows than the largest bucket."""
    if batch.layer_hook is not None or not batch.rows or not batch.is_decode:
        return None
    return choose_bucket(len(batch.rows), buckets)


class StaticDecodeBuffers:
    """The static decode inputs the graphs read, and their per-step preparation.

    Args:
        max_batch: ``Bmax``, rows of the largest bucket.
        max_model_len: longest sequence (positions + 1) a row may reach; sets the block-table
            width ``W = ceil(max_model_len / block_size)`` and the batches' ``max_seq_len``.
        block_size: tokens per page ``B``.
        scratch_slot: state slot of the padding rows (never a real sequence's).
        scratch_page: latent page of the padding rows (never a real sequence's).
        device: where the graphs run.

    Raises:
        ValueError: a non-positive size.
    """

    def __init__(
        self,
        max_batch: int,
        max_model_len: int,
        block_size: int,
        scratch_slot: int,
        scratch_page: int,
        device: torch.device | str,
    ) -> None:
        for name, v in (("max_batch", max_batch), ("max_model_len", max_model_len),
                        ("block_size", block_size)):  # fmt: skip
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"StaticDecodeBuffers.{name}: must be an int ≥ 1, got {v!r}")
        self.max_batch, self.block_size = max_batch, block_size
        self.max_model_len = max_model_len
        self.width = -(-max_model_len // block_size)
        self.scratch_slot, self.scratch_page = scratch_slot, scratch_page
        self.device = torch.device(device)
        bm, w = max_batch, self.width
        self._size = 4 * bm + bm * w
        pin = self.device.type == "cuda"
        self.host = torch.zeros(self._size, dtype=torch.int64, device="cpu", pin_memory=pin)
        self.meta = torch.zeros(self._size, dtype=torch.int64, device=self.device)
        self.input_ids = self.meta[0:bm]
        self.num_cached = self.meta[bm : 2 * bm]
        self.state_slots = self.meta[2 * bm : 3 * bm]
        self.slot_mapping = self.meta[3 * bm : 4 * bm]
        self.block_table = self.meta[4 * bm :].view(bm, w)
        self.cu_seqlens = torch.arange(bm + 1, dtype=torch.int64, device=self.device)
        self._copied: torch.cuda.Event | None = None
        self._batches: dict[int, ForwardBatch] = {}
        self._pad_host_rows(0)
        self.meta.copy_(self.host)

    def _pad_host_rows(self, start: int) -> None:
        """Write padding rows ``[start, Bmax)`` into the host copy."""
        bm, w = self.max_batch, self.width
        h = self.host.numpy()
        h[start:bm] = 0
        h[bm + start : 2 * bm] = 0
        h[2 * bm + start : 3 * bm] = self.scratch_slot
        h[3 * bm + start : 4 * bm] = self.scratch_page * self.block_size
        bt = h[4 * bm :].reshape(bm, w)
        bt[start:] = -1
        bt[start:, 0] = self.scratch_page

    def batch(self, bucket: int) -> ForwardBatch:
        """The :class:`ForwardBatch` over the first ``bucket`` static rows (built once per
        bucket: its views stay valid, the graphs read whatever :meth:`fill` wrote).

        Raises:
            ValueError: ``bucket`` outside ``[1, Bmax]``.
        """
        if not 1 <= bucket <= self.max_batch:
            raise ValueError(f"bucket: must be in [1, {self.max_batch}], got {bucket}")
        fb = self._batches.get(bucket)
        if fb is None:
            fb = ForwardBatch(
                cu_seqlens=self.cu_seqlens[: bucket + 1],
                num_cached=self.num_cached[:bucket],
                state_slots=self.state_slots[:bucket],
                block_table=self.block_table[:bucket],
                slot_mapping=self.slot_mapping[:bucket],
                is_decode=True,
                max_seq_len=self.max_model_len,
            )
            self._batches[bucket] = fb
        return fb

    def fill(self, rows: Sequence[Row], bucket: int) -> None:
        """Write ``rows`` (decode: one token each) and padding up to ``bucket`` into the
        static device buffers: host writes, then one asynchronous host→device copy.

        Raises:
            ValueError: more rows than ``bucket``, a row that is not a single token, a row
                whose block table is too short or wider than ``W``, or a position at or past
                ``max_model_len``.
        """
        n = len(rows)
        if not 1 <= n <= bucket <= self.max_batch:
            raise ValueError(f"rows: {n} rows do not fit bucket {bucket} (max {self.max_batch})")
        if self._copied is not None:  # the previous step's copy must have left the host buffer
            self._copied.synchronize()
        bm, w, bs = self.max_batch, self.width, self.block_size
        h = self.host.numpy()  # plain host writes, no torch dispatch per field
        bt = h[4 * bm :].reshape(bm, w)
        for i, r in enumerate(rows):
            if len(r.token_ids) != 1:
                raise ValueError(f"rows[{i}].token_ids: a decode row has 1 token")
            pos = r.num_cached
            if pos + 1 > self.max_model_len:
                raise ValueError(
                    f"rows[{i}].num_cached: position {pos} ≥ max_model_len {self.max_model_len}"
                )
            table = list(r.block_table)
            if len(table) > w or len(table) <= pos // bs:
                raise ValueError(
                    f"rows[{i}].block_table: {len(table)} pages for position {pos} (width {w})"
                )
            h[i] = r.token_ids[0]
            h[bm + i] = pos
            h[2 * bm + i] = r.slot
            h[3 * bm + i] = table[pos // bs] * bs + pos % bs
            bt[i, : len(table)] = table
            bt[i, len(table) :] = -1
        self._pad_host_rows(n)
        self.meta.copy_(self.host, non_blocking=self.device.type == "cuda")
        if self.device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record()


class CUDAGraphRunner(ModelRunner):
    """A :class:`ModelRunner` that replays captured CUDA graphs for decode batches.

    Args:
        model: the model, in eval mode, on ``device``.
        pools: the cache pools, with one scratch slot and one scratch page beyond what the
            cache manager hands out.
        device: a CUDA device (on CPU the buffers work but nothing is captured: every batch
            runs eagerly — how the CPU tests check preparation and padding).
        max_model_len: the engine's longest sequence.
        buckets: captured batch sizes (default :func:`default_buckets` of ``max_num_seqs``).
        max_num_seqs: running sequences at most (sizes the default buckets).
        scratch_slot, scratch_page: default: the pools' last slot and last page.
        verify_k: the most speculative tokens of a verify step (``K``; 0: no verify graphs).
        verify_max_batch: the most sequences a verify step has (the speculation's batch
            limit); shapes up to the smallest bucket holding it.
        max_num_batched_tokens: a verify shape's ``b·(k+1)`` at most.

    Raises:
        ValueError: an empty bucket list or a bucket < 1.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        pools: KVPools,
        device: torch.device | str,
        max_model_len: int,
        buckets: Sequence[int] | None = None,
        max_num_seqs: int = 256,
        scratch_slot: int | None = None,
        scratch_page: int | None = None,
        verify_k: int = 0,
        verify_max_batch: int = 0,
        max_num_batched_tokens: int = 1 << 30,
    ) -> None:
        super().__init__(model, pools, device)
        bk = tuple(sorted(set(buckets))) if buckets is not None else default_buckets(max_num_seqs)
        if not bk or bk[0] < 1:
            raise ValueError(f"buckets: need sizes ≥ 1, got {buckets!r}")
        self.buckets = bk
        self.static = StaticDecodeBuffers(
            bk[-1], max_model_len, pools.block_size,
            pools.num_slots - 1 if scratch_slot is None else scratch_slot,
            pools.num_pages - 1 if scratch_page is None else scratch_page,
            device,
        )  # fmt: skip
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._logits: dict[int, torch.Tensor] = {}
        self.num_replays = 0
        self.num_eager = 0
        kv = min(verify_k, pools.block_size - 1)
        self.verify_shapes = verify_shapes(bk, kv, verify_max_batch, pools.block_size,
                                           max_num_batched_tokens)
        self.vstatic: StaticVerifyBuffers | None = None
        if self.verify_shapes:
            self.vstatic = StaticVerifyBuffers(
                max(b for b, _ in self.verify_shapes), max(k for _, k in self.verify_shapes),
                max_model_len, pools.block_size, self.static.scratch_slot,
                self.static.scratch_page, device,
            )  # fmt: skip
        self.verify_graphs: dict[tuple[int, int], Graph] = {}
        self._vout: dict[tuple[int, int], KDACapture] = {}
        self._vlogits: torch.Tensor | None = None
        self.num_verify_replays = 0
        self.num_verify_eager = 0

    def _scratch_zero(self) -> None:
        s = self.static.scratch_slot
        self.pools.kda_state[:, s].zero_()
        self.pools.conv_state[:, s].zero_()

    def _run_static(self, bucket: int) -> torch.Tensor:
        return self.model(self.static.input_ids[:bucket], self.static.batch(bucket), self.pools)

    @torch.inference_mode()
    def capture(self) -> None:
        """Build the MoE expert stacks, warm every bucket up, capture them (largest first).

        A no-op off CUDA. Leaves the scratch slot / page dirty (zeroed before each replay).
        """
        if self.device.type != "cuda":
            return
        for mod in self.model.modules():
            if hasattr(mod, "stacked_experts") and callable(mod.stacked_experts):
                mod.stacked_experts()
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for b in self.buckets:
                self._run_static(b)
        torch.cuda.current_stream(self.device).wait_stream(side)
        torch.cuda.synchronize(self.device)
        pool = torch.cuda.graph_pool_handle()
        for b in reversed(self.buckets):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                self._logits[b] = self._run_static(b)
            self.graphs[b] = g
        torch.cuda.synchronize(self.device)
        self.capture_verify(_cuda_recorder(self.device, pool))

    @torch.inference_mode()
    def capture_verify(self, record: Recorder) -> None:
        """Capture every verify shape with ``record`` (largest first): each shape runs once
        eagerly (compiles, caches its chunk tables), then is recorded. Its logits are copied
        into one shared static buffer inside the graph; its KDA inputs stay the graph's own
        outputs. A no-op without verify shapes."""
        if self.vstatic is None:
            return
        self.vstatic.clear()
        for b, k in sorted(self.verify_shapes, key=lambda s: -s[0] * (s[1] + 1)):
            lg, _ = self._run_static_verify(b, k)
            if self._vlogits is None:  # [Bmax·(K+1), V], V from the first warm-up
                self._vlogits = lg.new_empty(self.vstatic.max_batch * (self.vstatic.max_k + 1),
                                             lg.shape[1])
            del lg
            fb = self.vstatic.batch(b, k)
            out = self._vlogits

            def fn(fb=fb, out=out):
                self._scratch_zero()
                lg = self.model(self.vstatic.input_ids[: fb.num_tokens], fb, self.pools)
                out[: fb.num_tokens].copy_(lg)
                return fb.capture

            g, cap = record(fn)
            self.verify_graphs[(b, k)] = g
            self._vout[(b, k)] = cap
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _run_static_verify(self, bucket: int, k: int) -> tuple[torch.Tensor, KDACapture]:
        assert self.vstatic is not None
        self._scratch_zero()
        fb = self.vstatic.batch(bucket, k)
        lg = self.model(self.vstatic.input_ids[: fb.num_tokens], fb, self.pools)
        assert fb.capture is not None
        return lg, fb.capture

    def verify_replays(self, num_rows: int, k: int) -> bool:
        """Whether ``num_rows`` rows of ``k + 1`` tokens replay a captured verify graph (the
        smallest captured bucket that holds them at this ``k``)."""
        fits = [b for b, kk in self.verify_shapes if kk == k and b >= num_rows]
        return bool(fits) and (min(fits), k) in self.verify_graphs

    def verify(self, batch: RunBatch) -> tuple[torch.Tensor, KDACapture]:
        """Replay the ``(bucket, k)`` graph of a uniform verify batch, else the eager verify.

        Returns:
            As :meth:`ModelRunner.verify`: ``[T, V]`` float32 logits of every token (a fresh
            tensor) and the capture (views of the graph's outputs: read before the next
            verify replay).

        Raises:
            ValueError: as :meth:`ModelRunner.verify` / :meth:`StaticVerifyBuffers.fill`.
        """
        shape = verify_eligible(batch, self.verify_shapes)
        if shape is None or shape not in self.verify_graphs:
            self.num_verify_eager += 1
            return super().verify(batch)
        assert self.vstatic is not None and self._vlogits is not None
        with torch.inference_mode():
            self.vstatic.fill(batch.rows, *shape)
            self.verify_graphs[shape].replay()
            self.num_verify_replays += 1
            return real_rows(self._vlogits, self._vout[shape], len(batch.rows), shape[1])

    @torch.inference_mode()
    def verify_padded(self, rows: Sequence[Row], bucket: int, k: int,
                      ) -> tuple[torch.Tensor, KDACapture]:
        """The verify graphs' computation run eagerly: ``rows`` padded to ``bucket`` through
        the static buffers (the replay's reference; on CPU the check of padding and of the
        per-query MLA path). Returns what :meth:`verify` returns.

        Raises:
            ValueError: no verify shapes; as :meth:`StaticVerifyBuffers.fill`.
        """
        if self.vstatic is None:
            raise ValueError("verify_padded: this runner has no verify shapes (verify_k = 0)")
        self.vstatic.fill(rows, bucket, k)
        lg, cap = self._run_static_verify(bucket, k)
        return real_rows(lg, cap, len(rows), k)

    def execute(self, batch: RunBatch) -> torch.Tensor:
        """Replay the bucket's graph for an eligible decode batch, else run eagerly.

        Returns:
            ``[N, V]`` float32 logits (a fresh tensor; the graph's output is reused next step).

        Raises:
            ValueError: as :meth:`ModelRunner.forward` / :meth:`StaticDecodeBuffers.fill`.
        """
        bucket = graph_eligible(batch, self.buckets)
        if bucket is None or bucket not in self.graphs:
            self.num_eager += 1
            return self.forward(list(batch.rows), batch.layer_hook)
        with torch.inference_mode():
            self.static.fill(batch.rows, bucket)
            self._scratch_zero()
            self.graphs[bucket].replay()
            self.num_replays += 1
            return self._logits[bucket][: len(batch.rows)].clone()

    @torch.inference_mode()
    def forward_padded(self, rows: Sequence[Row], bucket: int) -> torch.Tensor:
        """The graphs' computation run eagerly: ``rows`` padded to ``bucket`` through the
        static buffers (the CPU check of padding and preparation; on CUDA the replay's
        reference).

        Returns:
            ``[N, V]`` float32 logits of the real rows.
        """
        self.static.fill(rows, bucket)
        self._scratch_zero()
        return self._run_static(bucket)[: len(rows)].clone()


def _cuda_recorder(device: torch.device, pool: Any) -> Recorder:
    """Records ``fn`` as a ``torch.cuda.CUDAGraph`` in memory pool ``pool``."""

    def record(fn: Callable[[], Any]) -> tuple[Graph, Any]:
        torch.cuda.synchronize(device)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=pool):
            out = fn()
        return g, out

    return record


__all__ = [
    "CUDAGraphRunner",
    "Graph",
    "Recorder",
    "StaticDecodeBuffers",
    "choose_bucket",
    "default_buckets",
    "graph_eligible",
]
