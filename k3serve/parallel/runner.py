"""One model instance over several ranks: rank 0 drives, the other ranks follow the same forward.

Every rank holds the (TP-split, EP-partitioned) model and its own cache pools (KDA states split
by head, MLA latents replicated: ``k3serve.parallel.tp``). Rank 0 owns the scheduling: each call
on its ``ParallelModelRunner`` first broadcasts ``(op, args)`` from rank 0 to the group
(``torch.distributed.broadcast_object_list``: the batch rows, slots, pages — small Python
values), then runs the op locally; the followers (``follow``) receive the same op and run it
on their shards, so the collectives inside the forward (all-reduce, all-to-all) line up::

    rank 0 (driver)                     rank 1..W-1 (followers)
    forward(rows) ─ broadcast(op) ───▶  follow(): op = broadcast() ─┐
       model(ids, batch, pools)  ◀─ all-reduce / all-to-all ─▶ model(ids, batch, pools)
       → logits (rank 0 samples)                                   └─ loop until "stop"

With ``dp`` > 1 attention groups (``ep = tp · dp``, ``k3serve.parallel.groups``) every rank still
receives every op and runs its group's part of it (its slots' rows, their cache copies); rank 0
gathers the other groups' logits.

``ParallelModelRunner`` has the methods of ``k3serve.engine.runner.ModelRunner`` (``forward``,
``prepare_slots``, ``save_snapshots``, ``fork``) so an engine on rank 0 can drive it unchanged.
``k3serve.parallel.ranks`` starts the ranks: on one host (rank 0 starts the others) or as
processes that another launcher places (Ray actors across nodes, a TCPStore rendezvous).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from k3serve.cache.pools import KVPools
from k3serve.config import ModelConfig
from k3serve.engine.runner import ModelRunner
from k3serve.parallel import ep as ep_mod
from k3serve.parallel import tp as tp_mod
from k3serve.parallel.expert_plan import LayerPlan, Plan
from k3serve.parallel.groups import AttentionGroups
from k3serve.parallel.layout import attention_groups
from k3serve.parallel.transfer import gather_states, scatter_state

_log = logging.getLogger("k3serve.parallel")
COLLECTIVE_TIMEOUT_S = 30.0
INSTANCE_FAILED_EXIT = 70
"""Exit code of a rank-0 process whose instance failed (a collective raised or timed out)."""


class Row(NamedTuple):
    """One sequence of a forward (the fields of ``k3serve.engine.runner.Row``)."""

    token_ids: Sequence[int]
    num_cached: int
    slot: int
    block_table: Sequence[int]


@dataclass(frozen=True)
class InstanceSpec:
    """What every rank builds.

    Attributes:
        model: preset name or checkpoint folder (``k3serve.model.checkpoint.load_model``).
        tp: tensor-parallel ranks of one attention group.
        ep: expert-parallel ranks: 1, or the world size (a multiple of ``tp``: ``dp = ep / tp``
            attention groups, :func:`k3serve.parallel.layout.attention_groups`).
        num_slots / num_pages / block_size / num_snapshots: cache pool sizes (per rank; slot
            and page numbers are the instance's, the same on every rank).
        plan: expert placement (``Plan.to_dict()`` form) or None (contiguous).
        random_init: random weights when the preset has no checkpoint.
        dtype: parameter / latent + conv pool dtype name (``float32``, ``bfloat16``).
        seed: random-init seed (every rank draws the same weights).
        device: ``cpu`` (every rank on the CPU, gloo) or ``cuda`` (rank r on ``cuda:r``).
        threads: torch intra-op threads of each rank process.
        collective_timeout_s: seconds a collective of the model (all-reduce, all-to-all,
            gather) may wait for a peer before it raises: a rank that hangs is detected
            within this bound, and the instance fails as a whole (:class:`ParallelModelRunner`).

    Raises:
        ValueError: ``tp``/``ep`` < 1, or both > 1 and ``ep`` not a multiple of ``tp``;
            ``collective_timeout_s`` ≤ 0 (naming the field).
    """

    model: str = "k3-tiny"
    tp: int = 1
    ep: int = 1
    num_slots: int = 8
    num_pages: int = 64
    block_size: int = 16
    num_snapshots: int = 0
    plan: dict[str, Any] | None = None
    random_init: bool = False
    dtype: str = "float32"
    seed: int = 0
    device: str = "cpu"
    threads: int = 1
    collective_timeout_s: float = COLLECTIVE_TIMEOUT_S

    def __post_init__(self) -> None:
        if not self.collective_timeout_s > 0:
            raise ValueError(f"collective_timeout_s: must be > 0, got {self.collective_timeout_s}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device: 'cpu' or 'cuda', got {self.device!r}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype: float32, bfloat16 or float16, got {self.dtype!r}")
        attention_groups(self.tp, self.ep)

    @property
    def world(self) -> int:
        return max(self.tp, self.ep)

    @property
    def dp(self) -> int:
        """Attention groups (:func:`k3serve.parallel.layout.attention_groups`)."""
        return attention_groups(self.tp, self.ep)

    def rank_device(self, rank: int) -> str:
        """Where rank ``rank`` lives: ``cpu``, or ``cuda:{rank}`` where the process sees the
        instance's cards (one host), ``cuda:0`` where it sees one (a Ray actor's card)."""
        if self.device == "cpu":
            return "cpu"
        return f"cuda:{rank if self.world <= torch.cuda.device_count() else 0}"

    @property
    def backend(self) -> str:
        """``torch.distributed`` backend of the model's collectives (gloo on CPU, NCCL)."""
        return "gloo" if self.device == "cpu" else "nccl"


class RankRunner(ModelRunner):
    """One rank's model + pools; runs ops locally (no broadcast). The forward, slot, snapshot
    and fork ops are :class:`~k3serve.engine.runner.ModelRunner`'s, on this rank's shard; with
    several attention groups (``spec.dp`` > 1) :class:`~k3serve.parallel.groups.AttentionGroups`
    runs this group's part of each.

    Args:
        spec: what to build.
        rank: this rank (0 when not distributed).
        device: where the model and pools live (default ``spec.rank_device(rank)``).

    Attributes:
        folder: the checkpoint folder the weights came from (``None``: random init).
        groups: the attention groups (``spec.dp`` > 1; the process group must exist), or None.
    """

    def __init__(self, spec: InstanceSpec, rank: int = 0, device: str | None = None) -> None:
        from k3serve.model.checkpoint import load_model

        self.spec, self.rank = spec, rank
        device = device or spec.rank_device(rank)
        dtype = getattr(torch, spec.dtype)
        model, cfg, folder = load_model(spec.model, device=device, dtype=dtype, seed=spec.seed,
                                        random_init=spec.random_init)
        self.folder: str | None = folder
        self.cfg: ModelConfig = cfg
        self.local_cfg = tp_mod.local_config(cfg, spec.tp)
        self.groups: AttentionGroups | None = None
        tp_group, tokens = None, None
        if spec.dp > 1:
            self.groups = AttentionGroups(spec.tp, spec.dp, rank, spec.backend,
                                          spec.collective_timeout_s)
            tp_group, tokens = self.groups.tp_group, self.groups.token_group()
        tp_mod.shard_model(model, rank % spec.tp, spec.tp, tp_group)
        if spec.ep > 1:
            plans: list[LayerPlan] | None = None
            if spec.plan is not None:
                plans = Plan.from_dict(spec.plan).layers
            ep_mod.install_ep(model, plans, rank, spec.ep, None, tokens)
            ep_mod.free_remote_experts(model)
        pools = KVPools(
            self.local_cfg,
            num_slots=spec.num_slots,
            num_pages=spec.num_pages,
            block_size=spec.block_size,
            num_snapshots=spec.num_snapshots,
            dtype=dtype,
            device=device,
        )
        super().__init__(model.eval(), pools, device)

    def fingerprint_fields(self) -> dict[str, Any]:
        """Pairing fingerprint fields of the instance's transfer layout: ``{"tp": tp}`` (a
        prefill / decode pair must agree: ``k3serve.parallel.layout.check_pair``)."""
        return {"tp": self.spec.tp}

    def receive_cache(self, slot: int, pages: Sequence[int]) -> None:
        """A transferred cache landed in :attr:`transfer_pools` (nothing to do on one rank)."""

    def forward(self, rows, layer_hook=None):
        """:meth:`ModelRunner.forward`; with attention groups, this group's rows (logits of
        every row on rank 0: :meth:`AttentionGroups.forward`)."""
        if self.groups is None:
            return super().forward(rows, layer_hook)
        run = super().forward
        return self.groups.forward(rows, lambda mine: run(mine, layer_hook), self.model,
                                   self.pools)

    def prepare_slots(self, admissions) -> None:
        if self.groups is None:
            return super().prepare_slots(admissions)
        self.groups.prepare_slots(self.pools, admissions)

    def save_snapshots(self, saves) -> None:
        if self.groups is None:
            return super().save_snapshots(saves)
        self.groups.save_snapshots(self.pools, saves)

    def fork(self, plan) -> None:
        if self.groups is None:
            return super().fork(plan)
        self.groups.fork(self.pools, plan)

    def zero_slots(self, slots: Sequence[int]) -> None:
        """Zero the KDA / conv state of ``slots`` (fresh sequences; on their owner group)."""
        if self.groups is not None:
            return self.groups.zero_slots(self.pools, slots)
        for s in slots:
            self.pools.zero_slot(s)

    def gather_slots(self, slots: Sequence[int]) -> None:
        """Collective: rank 0's staging gets the full-head states of ``slots``
        (:func:`k3serve.parallel.transfer.gather_states`; a no-op for TP 1)."""
        gather_states(self, slots)

    def scatter_cache(self, slot: int, pages: Sequence[int]) -> None:
        """Collective: rank 0's received cache of one request becomes every rank's
        (:func:`k3serve.parallel.transfer.scatter_state`)."""
        scatter_state(self, slot, pages)


_OPS = ("forward", "prepare_slots", "save_snapshots", "fork", "zero_slots", "gather_slots",
        "scatter_cache")


@dataclass(frozen=True)
class TransferPools:
    """What a TP instance's rank 0 registers with the transfer engine (duck-types the
    ``KVPools`` fields ``kvstore.PoolLayout.from_kvpools`` reads).

    Attributes:
        cfg: the whole model's config (all KDA heads).
        kda_state: staging ``[L_kda, S, H, K, V]`` float32 — full heads, filled by
            ``gather_slots`` (prefill side) or by the transfer (decode side).
        conv_state: staging ``[L_kda, S, W−1, 3·H·K]``.
        mla_latent: rank 0's own latent pool ``[L_mla, P, B, D]`` (replicated: already whole).
    """

    cfg: ModelConfig
    kda_state: torch.Tensor
    conv_state: torch.Tensor
    mla_latent: torch.Tensor


class ParallelModelRunner(RankRunner):
    """Rank 0 of a multi-rank instance: every op is broadcast to the followers, then run here.

    Same constructor as ``RankRunner`` (``rank`` must be 0); the process group must exist.
    Ops' arguments must be picklable (``layer_hook`` is run on rank 0 only).

    Disaggregated transfer (the gather design): the kvstore sees one pool
    layout per instance — :attr:`transfer_pools`, the whole model's layout, byte for byte
    what a TP-1 worker registers. On the prefill side a forward with a ``layer_hook`` runs
    without it, then ``gather_slots`` assembles the batch's KDA / conv states on rank 0 and
    the hook is called for every layer in order (the writes start after the forward, not
    layer by layer); on the decode side ``receive_cache`` scatters a landed cache to the
    ranks before the request runs. One pairing, one ticket, one manifest per request.

    Attributes:
        staging: the full-head staging pools (``TransferPools``; TP > 1 only).
    """

    def __init__(self, spec: InstanceSpec, rank: int = 0, device: str | None = None) -> None:
        if rank != 0:
            raise ValueError(f"rank: ParallelModelRunner is rank 0, got {rank}")
        super().__init__(spec, 0, device)
        self._procs: list[Any] = []
        self._tmp: Any = None
        self.rendezvous: Any = None  # a TCPStore rank 0 hosts for followers placed elsewhere
        self.staging: TransferPools | None = None
        if spec.tp > 1:
            c, p = self.cfg, self.pools
            h, k = c.kda_num_heads, c.kda_head_dim
            lk, s = p.kda_state.shape[0], p.kda_state.shape[1]
            self.staging = TransferPools(
                c,
                torch.zeros(lk, s, h, k, k, dtype=torch.float32, device=self.device),
                torch.zeros(lk, s, c.kda_conv_kernel - 1, c.kda_conv_dim, dtype=p.dtype,
                            device=self.device),
                p.mla_latent,
            )

    @property
    def transfer_pools(self) -> Any:
        return self.staging if self.staging is not None else self.pools

    def instance_failed(self, op: str, exc: BaseException) -> None:
        """An op raised: its peers are mid-collective or gone, so the instance cannot go on.
        Kills the followers this process started, logs, and ends this process with
        :data:`INSTANCE_FAILED_EXIT` (its supervisor restarts the instance whole; followers
        placed elsewhere fail in their next collective)."""
        import sys

        for p in self._procs:  # followers of this host: a stopped one would never leave
            p.kill()
        _log.critical("instance failed in %s: %r", op, exc, exc_info=exc)
        print(f"k3serve: instance failed in {op}: {exc!r}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(INSTANCE_FAILED_EXIT)

    def _bcast(self, op: str, *args: Any) -> None:
        obj = [(op, args)]
        dist.broadcast_object_list(obj, src=0, group=_CTL_GROUP)

    def execute(self, batch: Any) -> torch.Tensor:
        hook = batch.layer_hook
        if hook is None or self.staging is None:
            return self.forward(list(batch.rows), hook)
        logits = self.forward(list(batch.rows), None)
        self.gather_slots(sorted({r.slot for r in batch.rows}))
        for layer in self.model.model.layers:
            hook(int(layer.idx))
        return logits

    def _run(self, op: str, fn: Any, *args: Any) -> Any:
        """Broadcast ``op`` and run ``fn(*args)`` here; any failure fails the instance."""
        try:
            self._bcast(op, *args)
            return fn(*args)
        except Exception as e:  # noqa: BLE001 — the peers cannot continue the collective
            self.instance_failed(op, e)

    def forward(self, rows, layer_hook=None):
        rows = [Row(list(r.token_ids), r.num_cached, r.slot, list(r.block_table)) for r in rows]
        try:
            self._bcast("forward", rows)
            return super().forward(rows, layer_hook)
        except Exception as e:  # noqa: BLE001 — as _run
            self.instance_failed("forward", e)

    def prepare_slots(self, admissions):
        self._run("prepare_slots", super().prepare_slots, list(admissions))

    def save_snapshots(self, saves):
        self._run("save_snapshots", super().save_snapshots, list(saves))

    def fork(self, plan):
        self._run("fork", super().fork, plan)

    def zero_slots(self, slots):
        self._run("zero_slots", super().zero_slots, list(slots))

    def gather_slots(self, slots):
        slots = [int(s) for s in slots]
        if self.staging is None or not slots:
            return
        self._run("gather_slots", super().gather_slots, slots)

    def receive_cache(self, slot: int, pages: Sequence[int]) -> None:
        """The transfer of one request landed in :attr:`transfer_pools` (slot ``slot``, latent
        ``pages``): hand every rank its part (``scatter_cache``) before the request runs."""
        self._run("scatter_cache", super().scatter_cache, int(slot), [int(p) for p in pages])

    def stop(self) -> None:
        """Release the followers (their ``follow`` loops return)."""
        self._bcast("stop")

    def own_followers(self, procs: list[Any], tmp: Any) -> None:
        """Take the follower processes (ranks 1 … W−1) and the rendezvous folder ``tmp``
        (a ``TemporaryDirectory``) that :meth:`close` stops and removes."""
        self._procs, self._tmp = list(procs), tmp

    def follower_pids(self) -> list[int]:
        """Process ids of the followers this process started (ranks 1 …; empty when another
        launcher started them)."""
        return [p.pid for p in self._procs]

    def close(self, timeout: float = 10.0) -> None:
        """Stop the followers (``stop``; the processes ``start_instance`` started and do not
        leave within ``timeout`` seconds are killed; idempotent) and leave the process group.
        Call it when no other thread drives this runner any more."""
        procs, self._procs = self._procs, []
        remote, self.rendezvous = self.rendezvous is not None, None
        if procs or remote:
            try:
                if all(p.is_alive() for p in procs):
                    self.stop()
            except Exception as e:  # noqa: BLE001 — a dead follower: kill the rest below
                _log.warning("instance stop: %r", e)
            for p in procs:
                p.join(timeout)
                if p.is_alive():
                    p.kill()
                    p.join(5)
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception as e:  # noqa: BLE001 — leaving anyway
                _log.warning("destroy_process_group: %r", e)
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None


_CTL_GROUP: Any = None
"""The gloo group of the op broadcasts (Python values): a follower waits there for rank 0's
next op as long as the instance lives, so its timeout there is :data:`CTL_TIMEOUT`; rank 0's
broadcast completes when every follower received it, so rank 0's timeout there is the spec's
``collective_timeout_s``, as for the model's collectives on the default group (gloo on CPU,
NCCL on GPU)."""
CTL_TIMEOUT = timedelta(days=30)


def init_dist(spec: InstanceSpec, rank: int, store: str | dist.Store,
              timeout_s: float = 300.0) -> dist.Store:
    """Join the instance's process group and the gloo group of the op broadcasts.

    Args:
        spec: the instance (world size, backend, collective timeout).
        rank: this rank.
        store: the rendezvous: a ``FileStore`` path (ranks on one host) or a store object
            (a ``TCPStore`` whose address went round through Ray).
        timeout_s: seconds every rank waits for all the others to arrive.

    Returns:
        The store (for :func:`store_barrier`).

    Raises:
        RuntimeError: not every rank arrived within ``timeout_s``.
    """
    global _CTL_GROUP
    if isinstance(store, str):
        store = dist.FileStore(store, spec.world)
    store.set_timeout(timedelta(seconds=timeout_s))
    store_barrier(store, "joined", rank, spec.world, timeout_s)
    if spec.device == "cuda":
        torch.cuda.set_device(spec.rank_device(rank))
    dist.init_process_group(
        spec.backend,
        store=store,
        rank=rank,
        world_size=spec.world,
        timeout=timedelta(seconds=spec.collective_timeout_s),
    )
    # rank 0's broadcast waits until every follower received it: bounded like a collective
    ctl_timeout = CTL_TIMEOUT if rank else timedelta(seconds=spec.collective_timeout_s)
    _CTL_GROUP = dist.new_group(backend="gloo", timeout=ctl_timeout)
    return store


def store_barrier(store: dist.Store, name: str, rank: int, world: int, timeout_s: float) -> None:
    """Every rank sets ``name/rank`` and waits for all ``world`` keys.

    Raises:
        RuntimeError: (torch's ``DistStoreError``) not all within ``timeout_s`` seconds.
    """
    store.set(f"{name}/{rank}", "1")
    store.wait([f"{name}/{r}" for r in range(world)], timedelta(seconds=timeout_s))


def follow(runner: RankRunner) -> None:
    """Follower loop of ranks ≥ 1: run every op rank 0 broadcasts until ``stop``."""
    while True:
        obj: list[Any] = [None]
        dist.broadcast_object_list(obj, src=0, group=_CTL_GROUP)
        op, args = obj[0]
        if op == "stop":
            return
        if op not in _OPS:
            raise ValueError(f"op: unknown {op!r}")
        getattr(runner, op)(*args)


__all__ = [
    "COLLECTIVE_TIMEOUT_S",
    "INSTANCE_FAILED_EXIT",
    "InstanceSpec",
    "ParallelModelRunner",
    "RankRunner",
    "Row",
    "TransferPools",
    "follow",
    "init_dist",
    "store_barrier",
]
