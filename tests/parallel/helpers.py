"""A model instance over several rank processes, driven from the test process through a pipe.

``spawn_instance`` starts all W ranks (torch.multiprocessing, gloo, a FileStore rendezvous):
rank 0 builds a :class:`~k3serve.parallel.runner.ParallelModelRunner` and answers the
``InstanceClient``'s calls (greedy generation, one forward, the transfer layout's view of
slots, expert load counters); ranks ≥ 1 run :func:`~k3serve.parallel.runner.follow`.
"""

from __future__ import annotations

import os
import tempfile
import traceback
from collections.abc import Sequence
from typing import Any, Self

import torch
import torch.distributed as dist

from k3serve.parallel.runner import (
    InstanceSpec,
    ParallelModelRunner,
    RankRunner,
    Row,
    follow,
    init_dist,
)


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


def engine_rounds(engine: Any, rounds: Sequence[Sequence[tuple[Sequence[int], int]]],
                  max_tokens: int) -> list[list[tuple[list[list[int]], int]]]:
    """Greedy requests through an ``LLMEngine``, round after round (each round's requests are
    added together and run to completion; the cache carries over to the next round).

    Args:
        engine: the engine (its prefix cache and snapshots on, as the test sets them).
        rounds: per round, ``(prompt ids, n)`` per request.
        max_tokens: tokens per choice.

    Returns:
        Per round, per request: ``(token ids of each choice, num_cached_tokens)``.
    """
    from k3serve import SamplingParams

    out = []
    for k, rnd in enumerate(rounds):
        rids = []
        for j, (ids, n) in enumerate(rnd):
            rid = f"r{k}-{j}"
            engine.add_request(rid, list(ids), SamplingParams(temperature=0.0, n=n,
                                                              max_tokens=max_tokens))
            rids.append(rid)
        final: dict[str, Any] = {}
        while len(final) < len(rids):
            for o in engine.step():
                if o.finished:
                    final[o.request_id] = o
        out.append([([list(c.token_ids) for c in final[r].outputs], final[r].num_cached_tokens)
                    for r in rids])
    return out


# --------------------------------------------------------------------------- processes
def _rank_main(rank: int, spec: InstanceSpec, store_path: str, conn: Any) -> None:
    torch.set_num_threads(spec.threads)
    init_dist(spec, rank, store_path)
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
                elif op == "gathered_state":  # the transfer layout's view of slots
                    runner.gather_slots(args[0])
                    st, idx = runner.transfer_pools, list(args[0])
                    res = (st.kda_state[:, idx].clone(), st.conv_state[:, idx].clone())
                elif op == "engine_rounds":  # an LLMEngine driving this instance
                    from k3serve.engine.config import EngineConfig
                    from k3serve.engine.engine import LLMEngine

                    ec = EngineConfig(block_size=spec.block_size, num_pages=spec.num_pages,
                                      num_slots=spec.num_slots, num_snapshots=spec.num_snapshots)
                    engine = LLMEngine(runner.model, runner.cfg, None, ec, runner=runner)
                    res = engine_rounds(engine, *args)
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

    def gathered_state(self, slots: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(kda [L, n, H, K, V], conv [L, n, W−1, 3·H·K])`` of ``slots`` as the instance's
        transfer layout holds them after ``gather_slots`` (full heads, TP-1 order)."""
        return self._call("gathered_state", list(slots))

    def engine_rounds(self, rounds, max_tokens: int):
        """:func:`engine_rounds` on an ``LLMEngine`` over the instance (a fresh engine)."""
        return self._call("engine_rounds", [[(list(i), n) for i, n in r] for r in rounds],
                          max_tokens)

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


__all__ = ["InstanceClient", "engine_rounds", "greedy_generate", "spawn_instance"]
