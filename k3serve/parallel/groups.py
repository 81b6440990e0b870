"""Data-parallel attention: an instance of ``ep = tp · dp`` ranks as ``dp`` attention groups.

Ranks ``g·tp … g·tp + tp − 1`` form attention group g; group g runs the attention (KDA and MLA,
heads split over its ``tp`` ranks as ``k3serve.parallel.tp`` does) and the dense / shared MLPs
(split the same way) for its own sequences, while the routed experts of every MoE layer are
expert-parallel over all ``ep`` ranks: each group's tokens go to the experts' owners and come
back (``k3serve.parallel.ep`` with a token group per attention group)::

    rank          0    1  │  2    3          tp 2 × dp 2, ep 4
    group         g0      │  g1
    attention     seqs of g0 (heads ½ each) │ seqs of g1 (heads ½ each)   all-reduce in group
    MoE           experts 0-1 │ 2-3 │ 4-5 │ 6-7                           all-to-all over all 4

A sequence belongs to the group of its slot: ``group = slot mod dp`` (a slot keeps its sequence
for the sequence's life, so its state never moves). Every rank sees every op (rank 0 broadcasts
them, ``k3serve.parallel.runner``) and runs the part its group owns, so the collectives stay
matched on every rank every step; a group with no sequence in a forward still joins each MoE
layer's exchange with zero tokens (:meth:`AttentionGroups.idle_forward`).

Cache placement (the pools keep the instance's slot and page numbering on every rank):

    KDA / conv state of slot s   live on group s mod dp only (its heads on each of its ranks);
                                 the same slot on other groups is never read
    MLA latent pages             replicated on every rank: after each forward every group
                                 broadcasts the pages its sequences wrote (prefix pages are
                                 shared between sequences of any group)
    KDA snapshots                replicated: a save on the owner group is broadcast to the others,
                                 so a prefix hit loads on any group

Cross-group copies (snapshots, pages, a fork into a slot of another group) are broadcasts over
the **peer groups** — ranks with the same position t in every attention group, which hold the
same heads. Logits come back to rank 0 by one gather (padded to the largest group's row count).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from k3serve.cache.types import Admission, ForkPlan, SnapshotSave


class AttentionGroups:
    """This rank's place in the ``dp`` attention groups of ``tp`` ranks, and their process groups.

    Every rank of the instance must construct it (``torch.distributed.new_group`` is collective),
    after the default process group exists.

    Args:
        tp: ranks per attention group.
        dp: attention groups (``world = tp · dp``).
        rank: this rank.
        backend: the groups' backend (``gloo``, ``nccl``).
        timeout_s: the groups' collective timeout, seconds.

    Attributes:
        group: this rank's attention group index; ``pos``: its position in the group.
        tp_group: process group of this attention group (the heads' all-reduces).
        peer_group: process group of the ranks at position ``pos`` of every group.
    """

    def __init__(self, tp: int, dp: int, rank: int, backend: str, timeout_s: float) -> None:
        self.tp, self.dp, self.rank = tp, dp, rank
        self.group, self.pos = divmod(rank, tp)
        timeout = timedelta(seconds=timeout_s)
        for g in range(dp):
            pg = dist.new_group([g * tp + t for t in range(tp)], timeout=timeout, backend=backend)
            if g == self.group:
                self.tp_group = pg
        for t in range(tp):
            pg = dist.new_group([g * tp + t for g in range(dp)], timeout=timeout, backend=backend)
            if t == self.pos:
                self.peer_group = pg

    def owner(self, slot: int) -> int:
        """Attention group of slot ``slot``."""
        return int(slot) % self.dp

    def mine(self, slot: int) -> bool:
        """Whether this rank's group owns slot ``slot``."""
        return self.owner(slot) == self.group

    def token_group(self) -> tuple[int, int, Any]:
        """``(tp, pos, tp_group)``: the ``tokens`` argument of ``k3serve.parallel.ep``."""
        return self.tp, self.pos, self.tp_group

    def bcast_from(self, x: torch.Tensor, group: int) -> torch.Tensor:
        """Broadcast ``x`` (same shape on every rank) from attention group ``group`` to the
        others, over this rank's peer group; returns ``x`` (filled on the receivers)."""
        dist.broadcast(x, src=group * self.tp + self.pos, group=self.peer_group)
        return x

    # ------------------------------------------------------------------ forward
    def forward(self, rows: Sequence[Any], run: Callable[[list[Any]], torch.Tensor],
                model: torch.nn.Module, pools: Any) -> torch.Tensor | None:
        """One forward of ``rows`` (every rank gets all of them): this group's rows through
        ``run`` (the local forward → ``[n_g, V]``), or :meth:`idle_forward`; then the pages
        written are shared (:meth:`share_pages`) and the logits gathered.

        Returns:
            On rank 0 ``[N, V]`` float32 logits in row order; elsewhere this group's (or None).
        """
        owners = [self.owner(r.slot) for r in rows]
        mine = [r for r, g in zip(rows, owners, strict=True) if g == self.group]
        logits = run(mine) if mine else self.idle_forward(model)
        self.share_pages(pools, rows, owners)
        return self.gather_logits(logits, owners, model.cfg.vocab_size,
                                  model.lm_head.weight.device)

    @torch.inference_mode()
    def idle_forward(self, model: torch.nn.Module) -> None:
        """Join every MoE layer's expert exchange, in layer order, with zero tokens (a group
        without sequences in this forward; the other groups' tokens still reach this rank's
        experts)."""
        from k3serve.parallel.counters import moe_layers

        for moe in moe_layers(model).values():
            cfg = moe.cfg
            dev = moe.gate.weight.device
            w = cfg.moe_latent_size or cfg.hidden_size
            k = cfg.num_experts_per_tok
            moe.ep(torch.zeros(0, w, dtype=moe.gate.weight.dtype, device=dev),
                   torch.zeros(0, k, dtype=torch.float32, device=dev),
                   torch.zeros(0, k, dtype=torch.int64, device=dev))

    @torch.inference_mode()
    def share_pages(self, pools: Any, rows: Sequence[Any], owners: Sequence[int]) -> None:
        """Every group broadcasts the latent pages its rows wrote (positions ``[num_cached,
        num_cached + len)``) to the other groups, group by group."""
        if pools.mla_latent.shape[0] == 0:
            return
        bs = pools.block_size
        for g in range(self.dp):
            pages = sorted({int(r.block_table[p // bs]) for r, o in zip(rows, owners, strict=True)
                            if o == g
                            for p in range(r.num_cached, r.num_cached + len(r.token_ids))})
            if not pages:
                continue
            idx = torch.tensor(pages, dtype=torch.int64, device=pools.mla_latent.device)
            lat = self.bcast_from(pools.mla_latent.index_select(1, idx).contiguous(), g)
            if g != self.group:
                pools.mla_latent.index_copy_(1, idx, lat)

    @torch.inference_mode()
    def gather_logits(self, logits: torch.Tensor | None, owners: Sequence[int], vocab: int,
                      dev: torch.device) -> torch.Tensor | None:
        """Rank 0 gathers every group's logits ``[n_g, V]`` (from each group's first rank, padded
        to the largest ``n_g``) into row order ``[N, V]`` float32, on ``dev``."""
        counts = [sum(1 for o in owners if o == g) for g in range(self.dp)]
        n_max = max(counts)
        pad = torch.zeros(n_max, vocab, dtype=torch.float32, device=dev)
        if logits is not None:
            pad[: logits.shape[0]] = logits
        parts = [torch.empty_like(pad) for _ in range(self.tp * self.dp)] if self.rank == 0 \
            else None
        dist.gather(pad, parts, dst=0)
        if self.rank != 0:
            return logits
        assert parts is not None
        out = torch.empty(len(owners), vocab, dtype=torch.float32, device=dev)
        for g in range(self.dp):
            at = [i for i, o in enumerate(owners) if o == g]
            if at:
                out[torch.tensor(at, device=dev)] = parts[g * self.tp][: len(at)]
        return out

    # ------------------------------------------------------------------ cache copies
    @torch.inference_mode()
    def prepare_slots(self, pools: Any, admissions: Iterable[Admission]) -> None:
        """The owner group zeros each admitted slot or loads its snapshot (replicated)."""
        for a in admissions:
            if not self.mine(a.slot):
                continue
            if a.load_snapshot is None:
                pools.zero_slot(a.slot)
            else:
                pools.load_snapshot(a.load_snapshot, a.slot)

    @torch.inference_mode()
    def save_snapshots(self, pools: Any, saves: Iterable[SnapshotSave]) -> None:
        """The owner group copies the slot into the snapshot, then broadcasts it to the others
        (in order: a later save may reuse an evicted id)."""
        for s in saves:
            g = self.owner(s.slot)
            if g == self.group:
                pools.save_snapshot(s.slot, s.snapshot)
            state = self.bcast_from(pools.snap_state[:, s.snapshot].contiguous(), g)
            conv = self.bcast_from(pools.snap_conv[:, s.snapshot].contiguous(), g)
            if g != self.group:
                pools.snap_state[:, s.snapshot].copy_(state)
                pools.snap_conv[:, s.snapshot].copy_(conv)

    @torch.inference_mode()
    def fork(self, pools: Any, plan: ForkPlan) -> None:
        """Copy the parent's slot into the child's (across groups: a broadcast from the parent's
        group) and its partial last page on every rank (latents are replicated)."""
        src, dst = self.owner(plan.src_slot), self.owner(plan.dst_slot)
        if src == dst:
            if src == self.group:
                pools.copy_slot(plan.src_slot, plan.dst_slot)
        else:
            state = self.bcast_from(pools.kda_state[:, plan.src_slot].contiguous(), src)
            conv = self.bcast_from(pools.conv_state[:, plan.src_slot].contiguous(), src)
            if dst == self.group:
                pools.kda_state[:, plan.dst_slot].copy_(state)
                pools.conv_state[:, plan.dst_slot].copy_(conv)
        for a, b in plan.page_copies:
            pools.mla_latent[:, b].copy_(pools.mla_latent[:, a])

    def zero_slots(self, pools: Any, slots: Iterable[int]) -> None:
        """The owner group zeros each slot."""
        for s in slots:
            if self.mine(s):
                pools.zero_slot(s)


__all__ = ["AttentionGroups"]
