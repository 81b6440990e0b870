"""ModelRunner: scheduled sequences → ``ForwardBatch`` → logits, plus the cache tensor copies.

The only engine module that touches tensors. What the cache manager decides in ids, the
runner carries out on :class:`~k3serve.cache.pools.KVPools`:

* admission: zero the slot (fresh sequence) or load a snapshot into it (prefix hit);
* after a forward: copy slots into snapshots (:class:`~k3serve.cache.types.SnapshotSave`);
* ``n > 1``: copy the parent's slot and its partial last page (:class:`ForkPlan`);
* speculative decoding: a verify forward (:meth:`ModelRunner.verify`: every token's logits,
  the slots' states read but not written) and the replay of the accepted tokens into the
  slots (:meth:`ModelRunner.replay`, :mod:`k3serve.model.capture`).

Packing of one forward (``T`` new tokens of ``N`` sequences)::

    input_ids   [ seq0: t_c0 … t_c0+n0-1 | seq1: … | … ]          [T]
    cu_seqlens  [0, n0, n0+n1, …]                                   [N+1]
    num_cached  [c0, c1, …]       block_table [N, max_pages]        slot_mapping [T]

The run seam: the engine hands every forward to :meth:`ModelRunner.execute` as one
:class:`RunBatch` (rows + an optional per-layer hook) and gets ``[N, V]`` logits back; it never
calls the model itself. A CUDA-graph runner (:mod:`k3serve.engine.cuda_graphs`) plugs in there:
a subclass whose ``execute`` replays a captured graph for batches it has one for (decode-only,
a captured size, ``layer_hook is None``: a Python hook cannot run inside a graph) and falls back
to :meth:`ModelRunner.forward` otherwise, and likewise for :meth:`ModelRunner.verify`. Slot
preparation, snapshot saves and forks stay plain tensor copies outside the graph.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch

from k3serve.cache.pools import KVPools
from k3serve.cache.types import Admission, ForkPlan, SnapshotSave
from k3serve.model.batch import make_batch
from k3serve.model.capture import KDACapture, replay


@dataclass(frozen=True)
class Row:
    """One sequence in a forward.

    Attributes:
        token_ids: the new tokens, positions ``[num_cached, num_cached + len)``.
        num_cached: tokens already in the cache.
        slot: KDA/conv state slot.
        block_table: pages covering ``[0, num_cached + len)``.
    """

    token_ids: Sequence[int]
    num_cached: int
    slot: int
    block_table: Sequence[int]


@dataclass(frozen=True)
class RunBatch:
    """One forward's input, as the engine builds it.

    Attributes:
        rows: the sequences of the forward, in output order (``N`` rows).
        layer_hook: ``hook(layer_idx)`` after each layer has written its cache (a connector's
            per-layer transfer), or ``None``.
    """

    rows: tuple[Row, ...]
    layer_hook: Callable[[int], None] | None = None

    @property
    def is_decode(self) -> bool:
        """Every row feeds a single token (a CUDA graph's shape class)."""
        return all(len(r.token_ids) == 1 for r in self.rows)

    @property
    def num_tokens(self) -> int:
        return sum(len(r.token_ids) for r in self.rows)


class ModelRunner:
    """Runs a ``K3ForCausalLM`` against its pools.

    Args:
        model: the model (``forward(input_ids, batch, pools, layer_hook)``), in eval mode.
        pools: the cache pools.
        device: where input tensors go (the model's device).
    """

    def __init__(self, model: torch.nn.Module, pools: KVPools, device: torch.device | str = "cpu"):
        self.model = model
        self.pools = pools
        self.block_size = pools.block_size
        self.device = torch.device(device)

    def execute(self, batch: RunBatch) -> torch.Tensor:
        """The engine's one call per forward (the seam a CUDA-graph runner overrides).

        Args:
            batch: :class:`RunBatch` of ``N`` rows.

        Returns:
            ``[N, V]`` float32 logits of each row's last new token.

        Raises:
            ValueError: as :meth:`forward`; whatever the layer hook raises (the slots of the
                batch are then part-way updated: the engine recomputes them).
        """
        return self.forward(list(batch.rows), batch.layer_hook)

    @property
    def transfer_pools(self) -> KVPools:
        """The pools the kvstore registers and transfers (this runner's own)."""
        return self.pools

    def fingerprint_fields(self) -> dict[str, object]:
        """Fields the runner adds to the kvstore pairing fingerprint: ``tp`` (1 here), so that
        a pair of different tensor-parallel degrees is refused naming it."""
        return {"tp": 1}

    def receive_cache(self, slot: int, pages: Sequence[int]) -> None:
        """A transferred cache landed in :attr:`transfer_pools` (``slot``, latent ``pages``):
        nothing to do when those are the model's own pools."""

    @torch.inference_mode()
    def forward(
        self, rows: Sequence[Row], layer_hook: Callable[[int], None] | None = None
    ) -> torch.Tensor:
        """One eager forward over ``rows`` (mutates their slots' states and writes latents): the
        plain-torch path every runner falls back to.

        Returns:
            ``[N, V]`` float32 logits of each row's last new token.

        Raises:
            ValueError: an empty row list or a block table too short (from ``make_batch``).
        """
        batch = make_batch(
            [len(r.token_ids) for r in rows],
            [r.num_cached for r in rows],
            [r.slot for r in rows],
            [r.block_table for r in rows],
            self.block_size,
            device=self.device,
        )
        ids = torch.tensor([t for r in rows for t in r.token_ids], dtype=torch.int64)
        if self.device.type == "cuda":  # pinned + non_blocking: no stream sync
            ids = ids.pin_memory().to(self.device, non_blocking=True)
        else:
            ids = ids.to(self.device)
        return self.model(ids, batch, self.pools, layer_hook=layer_hook)

    def verify_replays(self, num_rows: int, k: int) -> bool:
        """Whether a verify batch of ``num_rows`` rows of ``k + 1`` tokens each replays a
        captured graph: never here (:class:`~k3serve.engine.cuda_graphs.CUDAGraphRunner`
        captures them)."""
        return False

    @torch.inference_mode()
    def verify(self, batch: RunBatch) -> tuple[torch.Tensor, KDACapture]:
        """A speculative verify forward: logits of every new token, no KDA/conv state written.

        Each row carries the last sampled token and its proposed tokens. The slots' states are
        read, left as they were, and each KDA layer's state-update inputs are kept
        (:mod:`k3serve.model.capture`); the latents of every token are written at its position.
        The eager multi-token path (a CUDA-graph runner replays captured graphs for uniform
        batches and falls back to this one).

        Returns:
            ``([T, V] float32 logits in row order, the capture)`` for :meth:`replay`.

        Raises:
            ValueError: as :meth:`forward`; whatever the layer hook raises (nothing of the
                slots' states changed then).
        """
        rows = batch.rows
        fb = make_batch(
            [len(r.token_ids) for r in rows], [r.num_cached for r in rows],
            [r.slot for r in rows], [r.block_table for r in rows], self.block_size,
            device=self.device, all_logits=True,
        )  # fmt: skip
        assert fb.host is not None
        capture = KDACapture(fb.host.cu_seqlens)
        fb = dataclasses.replace(fb, is_decode=False, capture=capture)
        ids = torch.tensor([t for r in rows for t in r.token_ids], dtype=torch.int64)
        logits = self.model(ids.to(self.device), fb, self.pools, layer_hook=batch.layer_hook)
        return logits, capture

    @torch.inference_mode()
    def replay(self, capture: KDACapture, rows: Sequence[int], slots: Sequence[int],
               starts: Sequence[int], lengths: Sequence[int]) -> None:
        """Advance ``slots`` over the captured tokens ``[starts, starts + lengths)`` of their
        verify rows (:func:`k3serve.model.capture.replay`). Mutates the pools."""
        replay(capture, self.pools.kda_state, self.pools.conv_state, rows, slots, starts,
               lengths)

    @torch.inference_mode()
    def prepare_slots(self, admissions: Iterable[Admission]) -> None:
        """Zero each admitted slot, or load its prefix hit's snapshot into it."""
        for a in admissions:
            if a.load_snapshot is None:
                self.pools.zero_slot(a.slot)
            else:
                self.pools.load_snapshot(a.load_snapshot, a.slot)

    @torch.inference_mode()
    def save_snapshots(self, saves: Iterable[SnapshotSave]) -> None:
        """Copy slots into snapshots, in order (a later save may reuse an evicted id)."""
        for s in saves:
            self.pools.save_snapshot(s.slot, s.snapshot)

    @torch.inference_mode()
    def fork(self, plan: ForkPlan) -> None:
        """Copy the parent's state slot and partial last page for a new choice."""
        self.pools.copy_slot(plan.src_slot, plan.dst_slot)
        for src, dst in plan.page_copies:
            self.pools.mla_latent[:, dst].copy_(self.pools.mla_latent[:, src])


__all__ = ["ModelRunner", "Row", "RunBatch"]
