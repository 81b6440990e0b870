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

``ParallelModelRunner`` has the methods of ``k3serve.engine.runner.ModelRunner`` (``forward``,
``prepare_slots``, ``save_snapshots``, ``fork``) so an engine on rank 0 can drive it unchanged.
``spawn_instance`` starts all W ranks as processes (torch.multiprocessing, gloo, a FileStore)
and returns an ``InstanceClient`` that talks to rank 0 through a pipe (offline use, tests).
"""

from __future__ import annotations

import os
import tempfile
import traceback
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, NamedTuple, Self

import torch
import torch.distributed as dist

from k3serve.cache.pools import KVPools
from k3serve.config import ModelConfig
from k3serve.model.batch import make_batch
from k3serve.parallel import ep as ep_mod
from k3serve.parallel import tp as tp_mod
from k3serve.parallel.planner import LayerPlan, Plan


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
        tp: tensor-parallel ranks (1 or the world size).
        ep: expert-parallel ranks (1 or the world size).
        num_slots / num_pages / block_size / num_snapshots: cache pool sizes (per rank).
        plan: expert placement (``Plan.to_dict()`` form) or None (contiguous).
        random_init: random weights when the preset has no checkpoint.

    Raises:
        ValueError: ``tp``/``ep`` < 1, or both > 1 and different.
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

    def __post_init__(self) -> None:
        for f in ("tp", "ep"):
            v = getattr(self, f)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{f}: must be an int ≥ 1, got {v!r}")
        if self.tp > 1 and self.ep > 1 and self.tp != self.ep:
            raise ValueError(
                f"ep: {self.ep} != tp {self.tp}; one instance uses one group of ranks for both"
            )

    @property
    def world(self) -> int:
        return max(self.tp, self.ep)


class RankRunner:
    """One rank's model + pools; runs ops locally (no broadcast).

    Args:
        spec: what to build.
        rank: this rank (0 when not distributed).
        device: where the model and pools live.
    """

    def __init__(self, spec: InstanceSpec, rank: int = 0, device: str = "cpu") -> None:
        from k3serve.model.checkpoint import load_model

        self.spec, self.rank = spec, rank
        model, cfg = load_model(spec.model, device=device, random_init=spec.random_init)
        self.cfg: ModelConfig = cfg
        self.local_cfg = tp_mod.local_config(cfg, spec.tp)
        tp_mod.shard_model(model, rank if spec.tp > 1 else 0, spec.tp)
        if spec.ep > 1:
            plans: list[LayerPlan] | None = None
            if spec.plan is not None:
                plans = Plan.from_dict(spec.plan).layers
            ep_mod.install_ep(model, plans, rank, spec.ep)
            ep_mod.free_remote_experts(model)
        self.model = model.eval()
        self.pools = KVPools(
            self.local_cfg,
            num_slots=spec.num_slots,
            num_pages=spec.num_pages,
            block_size=spec.block_size,
            num_snapshots=spec.num_snapshots,
            device=device,
        )
        self.block_size = spec.block_size
        self.device = torch.device(device)

    @torch.inference_mode()
    def forward(
        self, rows: Sequence[Row], layer_hook: Callable[[int], None] | None = None
    ) -> torch.Tensor:
        """One forward over ``rows`` → ``[N, V]`` float32 logits of each row's last new token
        (mutates the rows' slots and pages). Raises ValueError as ``make_batch``."""
        batch = make_batch(
            [len(r.token_ids) for r in rows],
            [r.num_cached for r in rows],
            [r.slot for r in rows],
            [r.block_table for r in rows],
            self.block_size,
            device=self.device,
        )
        ids = torch.tensor([t for r in rows for t in r.token_ids], dtype=torch.int64,
                           device=self.device)
        return self.model(ids, batch, self.pools, layer_hook=layer_hook)

    @torch.inference_mode()
    def prepare_slots(self, admissions: Iterable[Any]) -> None:
        """Zero each admitted slot (``a.slot``) or load its snapshot (``a.load_snapshot``)."""
        for a in admissions:
            if a.load_snapshot is None:
                self.pools.zero_slot(a.slot)
            else:
                self.pools.load_snapshot(a.load_snapshot, a.slot)

    @torch.inference_mode()
    def save_snapshots(self, saves: Iterable[Any]) -> None:
        """Copy slots into snapshots (``s.slot`` → ``s.snapshot``), in order."""
        for s in saves:
            self.pools.save_snapshot(s.slot, s.snapshot)

    @torch.inference_mode()
    def fork(self, plan: Any) -> None:
        """Copy ``plan.src_slot`` → ``plan.dst_slot`` and the ``plan.page_copies`` pages."""
        self.pools.copy_slot(plan.src_slot, plan.dst_slot)
        for src, dst in plan.page_copies:
            self.pools.mla_latent[:, dst].copy_(self.pools.mla_latent[:, src])

    def zero_slots(self, slots: Sequence[int]) -> None:
        """Zero the KDA / conv state of ``slots`` (fresh sequences)."""
        for s in slots:
            self.pools.zero_slot(s)


_OPS = ("forward", "prepare_slots", "save_snapshots", "fork", "zero_slots")


class ParallelModelRunner(RankRunner):
    """Rank 0 of a multi-rank instance: every op is broadcast to the followers, then run here.

    Same constructor as ``RankRunner`` (``rank`` must be 0); the process group must exist.
    Ops' arguments must be picklable (``layer_hook`` is run on rank 0 only).
    """

    def _bcast(self, op: str, *args: Any) -> None:
        obj = [(op, args)]
        dist.broadcast_object_list(obj, src=0)

    def forward(self, rows, layer_hook=None):
        rows = [Row(list(r.token_ids), r.num_cached, r.slot, list(r.block_table)) for r in rows]
        self._bcast("forward", rows)
        return super().forward(rows, layer_hook)

    def prepare_slots(self, admissions):
        admissions = list(admissions)
        self._bcast("prepare_slots", admissions)
        super().prepare_slots(admissions)

    def save_snapshots(self, saves):
        saves = list(saves)
        self._bcast("save_snapshots", saves)
        super().save_snapshots(saves)

    def fork(self, plan):
        self._bcast("fork", plan)
        super().fork(plan)

    def zero_slots(self, slots):
        slots = list(slots)
        self._bcast("zero_slots", slots)
        super().zero_slots(slots)

    def stop(self) -> None:
        """Release the followers (their ``follow`` loops return)."""
        self._bcast("stop")


def follow(runner: RankRunner) -> None:
    """Follower loop of ranks ≥ 1: run every op rank 0 broadcasts until ``stop``."""
    while True:
        obj: list[Any] = [None]
        dist.broadcast_object_list(obj, src=0)
        op, args = obj[0]
        if op == "stop":
            return
        if op not in _OPS:
            raise ValueError(f"op: unknown {op!r}")
        getattr(runner, op)(*args)


# --------------------------------------------------------------------------- generation
def greedy_generate(
    runner: RankRunner, prompts: Sequence[Sequence[int]], max_new_tokens: int
) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy continuation of each prompt (one prefill, then batched decode steps).

    Slot i and pages ``[i·n, (i+1)·n)`` go to prompt i (``n`` pages cover prompt + answer).

    Args:
        runner: a ``RankRunner`` / ``ParallelModelRunner`` (its pools must be large enough).
        prompts: token ids per prompt (each ≥ 1 token).
        max_new_tokens: tokens to generate per prompt (≥ 1).

    Returns:
        ``(tokens per prompt, logits per step [N, V] float32)``.

    Raises:
        ValueError: too many prompts / pages for the pools, an empty prompt or
            ``max_new_tokens`` < 1.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: must be ≥ 1, got {max_new_tokens}")
    n_seq = len(prompts)
    bs = runner.block_size
    per = max(-(-(len(p) + max_new_tokens) // bs) for p in prompts)
    if n_seq > runner.spec.num_slots or n_seq * per > runner.spec.num_pages:
        raise ValueError(
            f"prompts: {n_seq} prompts × {per} pages exceed the pools "
            f"({runner.spec.num_slots} slots, {runner.spec.num_pages} pages)"
        )
    tables = [list(range(i * per, (i + 1) * per)) for i in range(n_seq)]
    runner.zero_slots(range(n_seq))
    rows = [Row(list(p), 0, i, tables[i]) for i, p in enumerate(prompts)]
    out: list[list[int]] = [[] for _ in prompts]
    steps: list[torch.Tensor] = []
    lens = [len(p) for p in prompts]
    for _ in range(max_new_tokens):
        logits = runner.forward(rows)
        steps.append(logits.clone())
        nxt = logits.argmax(-1).tolist()
        for i, t in enumerate(nxt):
            out[i].append(int(t))
        rows = [Row([nxt[i]], lens[i], i, tables[i]) for i in range(n_seq)]
        lens = [x + 1 for x in lens]
    return out, steps


# --------------------------------------------------------------------------- processes
def _rank_main(rank: int, spec: InstanceSpec, store_path: str, conn: Any) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        store=dist.FileStore(store_path, spec.world),
        rank=rank,
        world_size=spec.world,
        timeout=timedelta(seconds=300),
    )
    try:
        if rank != 0:
            follow(RankRunner(spec, rank))
            return
        runner = ParallelModelRunner(spec, 0)
        conn.send(("ready", None))
        while True:
            op, args = conn.recv()
            if op == "stop":
                runner.stop()
                conn.send(("ok", None))
                return
            try:
                if op == "generate":
                    res: Any = greedy_generate(runner, *args)
                elif op == "forward":
                    res = runner.forward(*args)
                elif op == "expert_load":
                    from k3serve.parallel.counters import expert_load

                    res = expert_load(runner.model)
                else:
                    raise ValueError(f"op: unknown {op!r}")
                conn.send(("ok", res))
            except Exception:  # noqa: BLE001 — reported to the client; the instance stays up
                conn.send(("error", traceback.format_exc()))
    finally:
        dist.destroy_process_group()


def _rank_entry(rank: int, spec: InstanceSpec, store_path: str, conn: Any) -> None:
    """Process target: run the rank, then leave at once (a torch interpreter's teardown takes
    seconds on a loaded machine and there is nothing left to flush)."""
    code = 0
    try:
        _rank_main(rank, spec, store_path, conn)
    except BaseException:  # noqa: BLE001 — printed, then the exit code says it
        traceback.print_exc()
        code = 1
    finally:
        import sys

        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _wait(conn: Any, procs: list[Any], timeout: float) -> bool:
    """Wait for rank 0's answer; False on timeout or as soon as any rank has exited."""
    import time

    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if conn.poll(0.5):
            return True
        if any(p.exitcode is not None for p in procs):
            return conn.poll(0.5)
    return False


class InstanceClient:
    """Parent-side handle of a spawned instance (``spawn_instance``); talks to rank 0.

    Use as a context manager, or call ``close()``.
    """

    def __init__(self, spec: InstanceSpec, procs: list[Any], conn: Any, tmp: Any) -> None:
        self.spec, self._procs, self._conn, self._tmp = spec, procs, conn, tmp

    def _call(self, op: str, *args: Any, timeout: float = 300.0) -> Any:
        self._conn.send((op, args))
        if not _wait(self._conn, self._procs, timeout):
            raise TimeoutError(f"rank 0 did not answer {op!r} within {timeout:.0f} s, or a rank "
                               f"died (exit codes {[p.exitcode for p in self._procs]})")
        status, res = self._conn.recv()
        if status == "error":
            raise RuntimeError(f"rank 0 failed on {op!r}:\n{res}")
        return res

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int):
        """``greedy_generate`` on the instance → ``(tokens per prompt, logits per step)``."""
        return self._call("generate", [list(p) for p in prompts], max_new_tokens)

    def forward(self, rows: Sequence[Row]) -> torch.Tensor:
        """One forward on the instance → ``[N, V]`` logits."""
        return self._call("forward", [Row(*r) for r in rows])

    def expert_load(self) -> dict[int, Any]:
        """Rank 0's expert load counters (every rank routes all tokens: they agree)."""
        return self._call("expert_load")

    def close(self) -> None:
        """Stop every rank (waits up to 60 s, then kills the ones left)."""
        try:
            if all(p.is_alive() for p in self._procs):
                self._call("stop", timeout=60.0)
        except (OSError, EOFError, TimeoutError, RuntimeError):
            pass
        for p in self._procs:
            p.join(60)
            if p.is_alive():
                p.kill()
                p.join(5)
        self._conn.close()
        self._tmp.cleanup()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def spawn_instance(spec: InstanceSpec, ready_timeout: float = 300.0) -> InstanceClient:
    """Start ``spec.world`` rank processes (gloo on CPU, FileStore rendezvous in a temp dir).

    Raises:
        RuntimeError: a rank failed to start (its traceback is in the message when rank 0
            reported it), or rank 0 was not ready within ``ready_timeout`` seconds.
    """
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    tmp = tempfile.TemporaryDirectory(prefix="k3serve-inst-")
    store = os.path.join(tmp.name, "store")
    parent, child = ctx.Pipe()
    procs = []
    for r in range(spec.world):
        p = ctx.Process(target=_rank_entry, args=(r, spec, store, child if r == 0 else None),
                        daemon=True)
        p.start()
        procs.append(p)
    client = InstanceClient(spec, procs, parent, tmp)
    ok = _wait(parent, procs, ready_timeout)
    if not ok or parent.recv()[0] != "ready":
        for p in procs:
            p.kill()
        tmp.cleanup()
        raise RuntimeError(
            f"instance tp={spec.tp} ep={spec.ep}: rank 0 not ready (exit codes "
            f"{[p.exitcode for p in procs]})"
        )
    return client


__all__ = [
    "InstanceClient",
    "InstanceSpec",
    "ParallelModelRunner",
    "RankRunner",
    "Row",
    "follow",
    "greedy_generate",
    "spawn_instance",
]
