"""Static buffers and shape planning of the speculative verify step under CUDA graphs.

A verify forward feeds each of ``N`` sequences ``k + 1`` tokens (the last sampled one and
``k`` proposals) and needs every token's logits and the KDA inputs of every token
(:mod:`k3serve.model.capture`). One graph is captured per shape ``(b, k)``: ``b`` a decode
bucket (:func:`k3serve.engine.cuda_graphs.default_buckets`) up to the speculation's batch
limit, ``1 ≤ k ≤ K``, ``b·(k+1)`` within the step's token budget and ``k + 1 ≤ block_size``
(the padding rows fit one scratch page). A batch replays when every row carries the same
``k + 1`` tokens, no layer hook runs and ``N ≤ b`` for a captured ``b``; anything else runs
the eager :meth:`~k3serve.engine.runner.ModelRunner.verify`. The engine pads rows that
proposed fewer tokens to the longest row's ``k`` when that shape replays
(``EngineCore._verify_width`` in :mod:`k3serve.engine.core`).

Static inputs (:class:`StaticVerifyBuffers`), one flat int64 device tensor (``Bmax`` largest
bucket, ``Q = K + 1``, ``W = ceil(max_model_len / block_size)``)::

    meta = [ input_ids Bmax·Q | slot_mapping Bmax·Q | num_cached Bmax | state_slots Bmax
             | block_table Bmax·W ]

Row ``i`` of shape ``(b, k)`` holds its tokens at ``[i·(k+1), (i+1)·(k+1))``
(``cu_seqlens = (k+1)·arange(b + 1)``, one constant tensor per ``k``). Padding rows
``N ≤ i < b`` feed token 0 at positions ``0 … k`` against the scratch slot and the scratch
page (as the decode graphs' padding rows do): every layer is causal within a row and rows are
independent, so the real rows' logits and KDA inputs are the unpadded forward's. The forward
reads no host metadata: the MLA layers attend each query through the paged decode kernel
(``ForwardBatch.query_len``) and the chunked KDA kernel's chunk tables are cached per
``cu_seqlens`` tensor (built when the shape is warmed up, before its capture).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from k3serve.engine.runner import Row, RunBatch
from k3serve.model.batch import ForwardBatch
from k3serve.model.capture import KDACapture, LayerInputs


def verify_shapes(buckets: Sequence[int], max_k: int, max_batch: int, block_size: int,
                  max_tokens: int) -> tuple[tuple[int, int], ...]:
    """The ``(b, k)`` shapes to capture: ``b`` in ``buckets`` up to the smallest bucket that
    holds ``max_batch`` rows, ``1 ≤ k ≤ max_k``, ``k + 1 ≤ block_size`` and
    ``b·(k+1) ≤ max_tokens``; sorted by ``(k, b)``. Empty when ``max_k`` or ``max_batch`` is 0.

    Raises:
        ValueError: a negative ``max_k`` / ``max_batch``, a bucket < 1, ``block_size`` or
            ``max_tokens`` < 1.
    """
    if max_k < 0 or max_batch < 0:
        raise ValueError(f"max_k, max_batch: must be ≥ 0, got {max_k}, {max_batch}")
    if block_size < 1 or max_tokens < 1 or any(b < 1 for b in buckets):
        raise ValueError("buckets, block_size, max_tokens: must be ≥ 1")
    bk = sorted(set(buckets))
    if not max_k or not max_batch or not bk:
        return ()
    top = next((b for b in bk if b >= max_batch), bk[-1])
    return tuple((b, k) for k in range(1, max_k + 1) for b in bk
                 if b <= top and k + 1 <= block_size and b * (k + 1) <= max_tokens)


def verify_eligible(batch: RunBatch, shapes: Sequence[tuple[int, int]]) -> tuple[int, int] | None:
    """The shape a verify batch replays in, or None (eager): rows of unequal length or of one
    token, a layer hook, or no captured bucket for ``N`` rows at this ``k``."""
    if batch.layer_hook is not None or not batch.rows:
        return None
    q = len(batch.rows[0].token_ids)
    if q < 2 or any(len(r.token_ids) != q for r in batch.rows):
        return None
    n = len(batch.rows)
    fits = [b for b, k in shapes if k == q - 1 and b >= n]
    return (min(fits), q - 1) if fits else None


class StaticVerifyBuffers:
    """The static verify inputs the graphs read, and their per-step preparation.

    Args:
        max_batch: ``Bmax``, rows of the largest shape.
        max_k: ``K``, the most proposals of a shape.
        max_model_len: longest sequence (positions + 1); sets ``W`` and ``max_seq_len``.
        block_size: tokens per page ``B`` (``K + 1 ≤ B``).
        scratch_slot, scratch_page: the padding rows' state slot and latent page.
        device: where the graphs run.

    Raises:
        ValueError: a size < 1, or ``K + 1 > block_size``.
    """

    def __init__(self, max_batch: int, max_k: int, max_model_len: int, block_size: int,
                 scratch_slot: int, scratch_page: int, device: torch.device | str) -> None:
        for name, v in (("max_batch", max_batch), ("max_k", max_k),
                        ("max_model_len", max_model_len), ("block_size", block_size)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"StaticVerifyBuffers.{name}: must be an int ≥ 1, got {v!r}")
        if max_k + 1 > block_size:
            raise ValueError(f"max_k: {max_k} + 1 tokens exceed a page of {block_size}")
        self.max_batch, self.max_k, self.block_size = max_batch, max_k, block_size
        self.max_model_len = max_model_len
        self.width = -(-max_model_len // block_size)
        self.scratch_slot, self.scratch_page = scratch_slot, scratch_page
        self.device = torch.device(device)
        bm, q, w = max_batch, max_k + 1, self.width
        self._tok = bm * q
        size = 2 * bm * q + 2 * bm + bm * w
        pin = self.device.type == "cuda"
        self.host = torch.zeros(size, dtype=torch.int64, device="cpu", pin_memory=pin)
        self.meta = torch.zeros(size, dtype=torch.int64, device=self.device)
        t = self._tok
        self.input_ids = self.meta[0:t]
        self.slot_mapping = self.meta[t : 2 * t]
        self.num_cached = self.meta[2 * t : 2 * t + bm]
        self.state_slots = self.meta[2 * t + bm : 2 * t + 2 * bm]
        self.block_table = self.meta[2 * t + 2 * bm :].view(bm, w)
        self.logits_indices = torch.arange(t, dtype=torch.int64, device=self.device)
        self._cu = {k: torch.arange(bm + 1, dtype=torch.int64, device=self.device) * (k + 1)
                    for k in range(1, max_k + 1)}
        self._batches: dict[tuple[int, int], ForwardBatch] = {}
        self._copied: torch.cuda.Event | None = None

    def cu_host(self, n: int, k: int) -> tuple[int, ...]:
        """Row boundaries of ``n`` rows of ``k + 1`` tokens, host ints."""
        return tuple(i * (k + 1) for i in range(n + 1))

    def batch(self, bucket: int, k: int) -> ForwardBatch:
        """The :class:`ForwardBatch` of shape ``(bucket, k)`` over the static buffers, with a
        fresh :class:`KDACapture` (``batch.capture``) that the forward fills. Building it
        reads ``cu_seqlens[-1]`` back once: call it before a capture, not inside one.

        Raises:
            ValueError: ``bucket`` outside ``[1, Bmax]`` or ``k`` outside ``[1, K]``.
        """
        if not 1 <= bucket <= self.max_batch or not 1 <= k <= self.max_k:
            raise ValueError(f"shape: ({bucket}, {k}) outside [1, {self.max_batch}] × "
                             f"[1, {self.max_k}]")
        fb = self._batches.get((bucket, k))
        if fb is None:
            t = bucket * (k + 1)
            fb = ForwardBatch(
                cu_seqlens=self._cu[k][: bucket + 1], num_cached=self.num_cached[:bucket],
                state_slots=self.state_slots[:bucket], block_table=self.block_table[:bucket],
                slot_mapping=self.slot_mapping[:t], logits_indices=self.logits_indices[:t],
                max_seq_len=self.max_model_len, query_len=k + 1,
            )  # fmt: skip
            self._batches[(bucket, k)] = fb
        return dataclasses.replace(fb, capture=KDACapture(self.cu_host(bucket, k)))

    def fill(self, rows: Sequence[Row], bucket: int, k: int) -> None:
        """Write ``rows`` (``k + 1`` tokens each) and padding up to ``bucket`` into the static
        device buffers: host writes, then one asynchronous host→device copy.

        Raises:
            ValueError: more rows than ``bucket``, a row of another length, a last position
                at or past ``max_model_len``, a block table too short or wider than ``W``.
        """
        n, q = len(rows), k + 1
        if not 1 <= n <= bucket <= self.max_batch or not 1 <= k <= self.max_k:
            raise ValueError(f"rows: {n} rows of {q} tokens do not fit shape ({bucket}, {k})")
        if self._copied is not None:  # the previous step's copy must have left the host buffer
            self._copied.synchronize()
        bm, t, w, bs = self.max_batch, self._tok, self.width, self.block_size
        h = self.host.numpy()
        bt = h[2 * t + 2 * bm :].reshape(bm, w)
        for i, r in enumerate(rows):
            if len(r.token_ids) != q:
                raise ValueError(f"rows[{i}].token_ids: {len(r.token_ids)} tokens, shape has {q}")
            c = r.num_cached
            if c + q > self.max_model_len:
                raise ValueError(f"rows[{i}].num_cached: position {c + k} ≥ max_model_len "
                                 f"{self.max_model_len}")
            table = list(r.block_table)
            if len(table) > w or len(table) <= (c + k) // bs:
                raise ValueError(f"rows[{i}].block_table: {len(table)} pages for position "
                                 f"{c + k} (width {w})")
            h[i * q : (i + 1) * q] = r.token_ids
            h[t + i * q : t + (i + 1) * q] = [table[p // bs] * bs + p % bs
                                              for p in range(c, c + q)]
            h[2 * t + i] = c
            h[2 * t + bm + i] = r.slot
            bt[i, : len(table)] = table
            bt[i, len(table) :] = -1
        self._pad_host(n, bucket, q)
        self._send()

    def clear(self) -> None:
        """Every row a padding row (for the warm-up and capture runs: they write latents to
        the scratch page only)."""
        if self._copied is not None:
            self._copied.synchronize()
        self._pad_host(0, self.max_batch, self.max_k + 1)
        self._send()

    def _pad_host(self, n: int, end: int, q: int) -> None:
        """Padding rows ``n … end−1`` of ``q`` tokens into the host copy: token 0 at positions
        ``0 … q−1`` of the scratch slot and page."""
        bm, t, w, bs = self.max_batch, self._tok, self.width, self.block_size
        h = self.host.numpy()
        bt = h[2 * t + 2 * bm :].reshape(bm, w)
        h[n * q : end * q] = 0
        h[t + n * q : t + end * q] = [self.scratch_page * bs + j
                                      for _ in range(n, end) for j in range(q)]
        h[2 * t + n : 2 * t + end] = 0
        h[2 * t + bm + n : 2 * t + bm + end] = self.scratch_slot
        bt[n:end] = -1
        bt[n:end, 0] = self.scratch_page

    def _send(self) -> None:
        """The host copy → the device buffers, one asynchronous copy on CUDA."""
        self.meta.copy_(self.host, non_blocking=self.device.type == "cuda")
        if self.device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record()


def real_rows(logits: torch.Tensor, capture: KDACapture, n: int, k: int,
              ) -> tuple[torch.Tensor, KDACapture]:
    """The first ``n`` rows of a padded verify's outputs, as the eager verify returns them:
    ``[n·(k+1), V]`` logits (a fresh tensor) and a capture over those rows' tokens (views of
    the static one's tensors, valid until the next replay of the shape)."""
    t = n * (k + 1)
    cap = KDACapture(tuple(i * (k + 1) for i in range(n + 1)))
    for j, x in capture.layers.items():
        cap.layers[j] = LayerInputs(x.pre[:t], x.k[:t], x.v[:t], x.g[:t], x.beta[:t])
    return logits[:t].clone(), cap


__all__ = ["StaticVerifyBuffers", "real_rows", "verify_eligible", "verify_shapes"]
