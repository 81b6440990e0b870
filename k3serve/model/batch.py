"""ForwardBatch: what one model forward needs to know about its sequences (INTERFACES.md §2).

Token layout of one forward (N sequences, T new tokens flattened in ``input_ids [T]``)::

    seq n:  |<-------- num_cached[n] -------->|<--- new: cu[n+1]-cu[n] --->|
            positions 0 .. num_cached-1         num_cached .. seq_len-1
            (latents already in pages;          (computed now; latents written at
             KDA/conv state in state slot)       slot_mapping, final state → slot)

    block_table[n] = pages covering [0, seq_len); flat latent slot = page * block_size + offset
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from k3serve.model.capture import KDACapture


@dataclass(frozen=True)
class BatchHost:
    """The host-side copy of a batch's sequence metadata, as the scheduler knows it.

    Prefill kernels size their launches and index tables from these ints instead of reading
    the device tensors back (each read is a host sync that stalls the launch queue mid-forward).

    Attributes:
        cu_seqlens: ``N+1`` ints, ``ForwardBatch.cu_seqlens`` on the host.
        num_cached: ``N`` ints.
        block_table: ``N`` tuples of page ids (unpadded rows; each covers its sequence).
    """

    cu_seqlens: tuple[int, ...]
    num_cached: tuple[int, ...]
    block_table: tuple[tuple[int, ...], ...]


@dataclass(frozen=True)
class ForwardBatch:
    """Per-forward metadata (INTERFACES.md §2). All tensors int64 on the model's device.

    Attributes:
        cu_seqlens: ``[N+1]`` boundaries of each sequence's new tokens in ``input_ids [T]``.
        num_cached: ``[N]`` tokens of each sequence already in the cache (positions).
        state_slots: ``[N]`` KDA/conv state slot per sequence (initial state read, final written).
        block_table: ``[N, max_blocks]`` latent pages covering ``[0, num_cached + new)``; pad −1.
        slot_mapping: ``[T]`` flat latent slot ``page * block_size + offset`` of each new token.
        is_decode: every sequence has exactly one new token (recurrent KDA, absorbed MLA).
        logits_indices: rows of ``[T]`` that get logits; None = last new token of each sequence.
        max_seq_len: a host-side upper bound on ``seq_lens`` (tokens), or None. Decode kernels
            size their launch grid from it instead of reading ``seq_lens.max()`` back from the
            device (a host sync, which a CUDA graph cannot capture); a CUDA-graph batch sets it
            to the engine's ``max_model_len``.
        host: the same ``cu_seqlens`` / ``num_cached`` / block table as host ints
            (:class:`BatchHost`), or None. :func:`make_batch` sets it; with it the prefill
            forward reads nothing back from the device (none is needed when it is None either,
            but then each consumer reads ``cu_seqlens`` etc. back once per forward).
        capture: a speculative verify forward: the KDA layers read their slots' states, write
            neither, and keep each token's state-update inputs here
            (:class:`~k3serve.model.capture.KDACapture`; the engine replays the accepted
            prefix). ``None``: states are written as usual.
        query_len: every sequence has exactly this many new tokens and the MLA layers attend
            them one query per row of the paged decode kernel, bounded by ``max_seq_len``
            (:meth:`~k3serve.model.mla.MLAMixer.forward`): no host metadata read — the CUDA
            graph of a speculative verify step. ``None``: the prefill / decode paths.
    """

    cu_seqlens: torch.Tensor
    num_cached: torch.Tensor
    state_slots: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    is_decode: bool = False
    logits_indices: torch.Tensor | None = None
    max_seq_len: int | None = None
    host: BatchHost | None = None
    capture: KDACapture | None = None
    query_len: int | None = None

    def __post_init__(self) -> None:
        n = self.num_cached.shape[0]
        if self.cu_seqlens.ndim != 1 or self.cu_seqlens.shape[0] != n + 1:
            raise ValueError(
                f"cu_seqlens: shape {tuple(self.cu_seqlens.shape)}, expected [{n + 1}]"
            )
        if self.state_slots.shape != (n,):
            raise ValueError(f"state_slots: shape {tuple(self.state_slots.shape)}, expected [{n}]")
        if self.block_table.ndim != 2 or self.block_table.shape[0] != n:
            raise ValueError(
                f"block_table: shape {tuple(self.block_table.shape)}, expected [{n}, max_blocks]"
            )
        if self.host is not None:
            if len(self.host.cu_seqlens) != n + 1 or len(self.host.num_cached) != n:
                raise ValueError(f"host: {len(self.host.cu_seqlens)} boundaries for {n} sequences")
            total = self.host.cu_seqlens[-1]
        else:
            total = int(self.cu_seqlens[-1])  # one host read at construction, none per use
        if self.slot_mapping.ndim != 1 or self.slot_mapping.shape[0] != total:
            raise ValueError(
                f"slot_mapping: shape {tuple(self.slot_mapping.shape)}, expected [{total}]"
            )
        if self.max_seq_len is not None and (
            not isinstance(self.max_seq_len, int) or self.max_seq_len < 1
        ):
            raise ValueError(f"max_seq_len: must be an int ≥ 1 or None, got {self.max_seq_len!r}")
        if self.is_decode and (
            any(b - a != 1 for a, b in zip(self.host.cu_seqlens, self.host.cu_seqlens[1:]))
            if self.host is not None
            else not bool((self.new_lens == 1).all())
        ):
            raise ValueError("is_decode: every sequence must have exactly 1 new token")
        if self.query_len is not None and (
            self.is_decode or not isinstance(self.query_len, int) or self.query_len < 1
            or total != n * self.query_len or self.max_seq_len is None
        ):
            raise ValueError(
                f"query_len: {self.query_len!r} new tokens per sequence need a non-decode batch "
                f"of {n} × query_len tokens (has {total}) and max_seq_len"
            )

    @property
    def num_seqs(self) -> int:
        """N, the number of sequences."""
        return int(self.num_cached.shape[0])

    @property
    def num_tokens(self) -> int:
        """T, the number of new tokens (from ``slot_mapping``'s shape: no device read)."""
        return int(self.slot_mapping.shape[0])

    @property
    def new_lens(self) -> torch.Tensor:
        """``[N]`` new tokens per sequence."""
        return self.cu_seqlens[1:] - self.cu_seqlens[:-1]

    @property
    def seq_lens(self) -> torch.Tensor:
        """``[N]`` total length after this forward: ``num_cached + new``."""
        return self.num_cached + self.new_lens

    def positions(self) -> torch.Tensor:
        """``[T]`` absolute position of every new token."""
        seq_idx = torch.repeat_interleave(
            torch.arange(self.num_seqs, device=self.cu_seqlens.device), self.new_lens
        )
        local = (
            torch.arange(self.num_tokens, device=self.cu_seqlens.device) - self.cu_seqlens[seq_idx]
        )
        return self.num_cached[seq_idx] + local

    def rows_for_logits(self) -> torch.Tensor:
        """``[R]`` rows of the new tokens that get logits (default: last new token per sequence)."""
        if self.logits_indices is not None:
            return self.logits_indices
        return self.cu_seqlens[1:] - 1


def make_batch(
    new_lens: Sequence[int],
    num_cached: Sequence[int],
    state_slots: Sequence[int],
    block_tables: Sequence[Sequence[int]],
    block_size: int,
    device: torch.device | str = "cpu",
    all_logits: bool = False,
) -> ForwardBatch:
    """Build a ForwardBatch from plain per-sequence lists (tests, simple engines).

    Args:
        new_lens: new tokens per sequence (each ≥ 1).
        num_cached: tokens already cached per sequence.
        state_slots: state slot per sequence.
        block_tables: page ids per sequence; must cover ``num_cached + new`` tokens.
        block_size: tokens per page B.
        device: where the tensors go.
        all_logits: logits for every new token instead of the last one per sequence.

    Returns:
        ForwardBatch with ``is_decode`` set when every ``new_lens`` is 1 and ``max_seq_len``
        the longest ``num_cached + new_lens`` (known here on the host).

    Raises:
        ValueError: mismatched list lengths, a non-positive ``new_lens`` entry, or a block table
            too short (the message names the field).

    On CUDA the tensors go up from pinned host memory without a stream sync; ``host`` carries
    the same metadata as ints (:class:`BatchHost`).
    """
    n = len(new_lens)
    if not (len(num_cached) == len(state_slots) == len(block_tables) == n):
        raise ValueError(
            "make_batch: new_lens, num_cached, state_slots, block_tables differ in length"
        )
    if n == 0 or any(x < 1 for x in new_lens):
        raise ValueError(f"new_lens: need ≥ 1 sequence with ≥ 1 new token, got {list(new_lens)}")
    if block_size < 1:
        raise ValueError(f"block_size: must be ≥ 1, got {block_size}")
    for i in range(n):
        need = -(-(num_cached[i] + new_lens[i]) // block_size)
        if len(block_tables[i]) < need:
            raise ValueError(f"block_tables[{i}]: {len(block_tables[i])} pages < {need} needed")
    width = max(1, max(len(b) for b in block_tables))
    bt = torch.full((n, width), -1, dtype=torch.int64)
    for i, b in enumerate(block_tables):
        bt[i, : len(b)] = torch.tensor(list(b), dtype=torch.int64)
    cu_host = [0]
    for x in new_lens:
        cu_host.append(cu_host[-1] + int(x))
    total = cu_host[-1]
    cu = torch.tensor(cu_host, dtype=torch.int64)
    nc = torch.tensor(list(num_cached), dtype=torch.int64)
    # slot of every new token, on the host: per sequence its pages' slot ranges, sliced (no
    # per-token Python loop, no gather: CPU advanced indexing costs ~6 ms per 8k indices)
    offs = torch.arange(block_size)
    parts = []
    for i in range(n):
        c, m = int(num_cached[i]), int(new_lens[i])
        p0, p1 = c // block_size, (c + m - 1) // block_size + 1
        full = (bt[i, p0:p1, None] * block_size + offs).reshape(-1)
        parts.append(full[c - p0 * block_size : c - p0 * block_size + m])
    slots = torch.cat(parts)
    dev = torch.device(device)

    def put(t: torch.Tensor) -> torch.Tensor:  # pinned + non_blocking: no stream sync on CUDA
        if dev.type != "cuda":
            return t.to(dev)
        return t.pin_memory().to(dev, non_blocking=True)

    return ForwardBatch(
        cu_seqlens=put(cu),
        num_cached=put(nc),
        state_slots=put(torch.tensor(list(state_slots), dtype=torch.int64)),
        block_table=put(bt),
        slot_mapping=put(slots),
        is_decode=all(x == 1 for x in new_lens),
        logits_indices=torch.arange(total, device=dev) if all_logits else None,
        max_seq_len=max(c + x for c, x in zip(num_cached, new_lens)),
        host=BatchHost(
            tuple(cu_host),
            tuple(int(c) for c in num_cached),
            tuple(tuple(int(p) for p in b) for b in block_tables),
        ),
    )


__all__ = ["BatchHost", "ForwardBatch", "make_batch"]
