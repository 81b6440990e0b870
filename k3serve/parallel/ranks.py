"""Starting the ranks of a multi-rank instance, for both launchers.

* One host (``start_instance``): the worker process is rank 0 and starts ranks 1 … W−1 as its
  own processes (torch.multiprocessing, a ``FileStore`` in a temp folder).
* Placed elsewhere (``start_remote_instance`` + ``python -m k3serve.parallel.ranks``): the
  worker process is rank 0, hosts a ``TCPStore`` on a free port of its host and prints one
  line ``rank rendezvous at HOST:PORT SPEC_JSON``; whoever placed the other ranks (the Ray
  backend's rank actors, ``deploy/ray_actors.py``) starts ``python -m k3serve.parallel.ranks
  --store HOST:PORT --rank R --spec SPEC_JSON`` there. Every rank builds from that one spec.

Either way every rank joins the group (``init_dist``: all arrive within ``timeout_s``),
builds its shard, and waits at the ``built`` barrier, so the first forward's collectives
meet ranks that are ready; then ranks ≥ 1 follow rank 0 (``runner.follow``) until ``stop``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sys
import tempfile
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from k3serve.parallel.rendezvous import format_rendezvous
from k3serve.parallel.runner import (
    InstanceSpec,
    ParallelModelRunner,
    RankRunner,
    follow,
    init_dist,
    store_barrier,
)
from k3serve.process import die_with_parent, ignore_sigint


def _exit(code: int) -> None:
    """Leave at once (a torch interpreter's teardown takes seconds and has nothing to flush)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_follower(spec: InstanceSpec, rank: int, store: str | dist.Store,
                 timeout_s: float = 300.0) -> None:
    """Rank ``rank`` ≥ 1: join, build the shard, follow rank 0, leave the group."""
    torch.set_num_threads(spec.threads)
    store = init_dist(spec, rank, store, timeout_s)
    try:
        runner = RankRunner(spec, rank)
        store_barrier(store, "built", rank, spec.world, timeout_s)
        follow(runner)
    finally:
        dist.destroy_process_group()


def _follower_entry(rank: int, spec: InstanceSpec, store_path: str) -> None:
    """Process target of a worker's rank ≥ 1 on its host; the exit code says how it ended.
    The kernel kills it when rank 0's process ends (``PR_SET_PDEATHSIG``); it ignores SIGINT
    (a terminal's Ctrl-C reaches the whole process group: rank 0 drains, then ends it)."""
    code = 0
    try:
        die_with_parent(signal.SIGKILL)
        ignore_sigint()
        run_follower(spec, rank, store_path)
    except BaseException:  # noqa: BLE001 — printed (the worker's log), then the exit code
        traceback.print_exc()
        code = 1
    finally:
        _exit(code)


def start_instance(spec: InstanceSpec, timeout_s: float = 300.0) -> ParallelModelRunner:
    """Make the calling process rank 0 of a ``spec.world``-rank instance on this host: start
    ranks 1 … W−1 as processes (daemonic, so they end with this process), join the group and
    build rank 0's :class:`ParallelModelRunner` (``close()`` stops the followers).

    Raises:
        RuntimeError: the group did not form within ``timeout_s`` seconds or a follower exited
            early (exit codes in the message; their tracebacks are on stderr).
        ValueError: as :class:`RankRunner` (e.g. a head count not divisible by ``tp``).
    """
    import torch.multiprocessing as mp

    if spec.world == 1:
        raise ValueError("tp/ep: start_instance needs tp > 1 or ep > 1")
    ctx = mp.get_context("spawn")
    tmp = tempfile.TemporaryDirectory(prefix="k3serve-ranks-")
    path = os.path.join(tmp.name, "store")
    procs = []
    for r in range(1, spec.world):
        p = ctx.Process(target=_follower_entry, args=(r, spec, path), daemon=True,
                        name=f"k3serve-rank{r}")
        p.start()
        procs.append(p)
    try:
        store = init_dist(spec, 0, path, timeout_s)
        runner = ParallelModelRunner(spec, 0)
        store_barrier(store, "built", 0, spec.world, timeout_s)
    except BaseException as e:
        for p in procs:
            p.kill()
            p.join(5)
        tmp.cleanup()
        raise RuntimeError(
            f"instance tp={spec.tp} ep={spec.ep}: rank 0 could not start ({e!r}; follower exit "
            f"codes {[p.exitcode for p in procs]})"
        ) from e
    runner.own_followers(procs, tmp)
    return runner


def start_remote_instance(spec: InstanceSpec, host: str,
                          timeout_s: float = 300.0) -> ParallelModelRunner:
    """Make the calling process rank 0 of an instance whose other ranks another launcher
    starts: host the rendezvous store on a free port of ``host``, print the
    rendezvous line (``k3serve.parallel.rendezvous``, stdout), join and build.

    Raises:
        RuntimeError: not every rank arrived (or built) within ``timeout_s`` seconds.
        ValueError: as :class:`RankRunner`.
    """
    if spec.world == 1:
        raise ValueError("tp/ep: start_remote_instance needs tp > 1 or ep > 1")
    store = dist.TCPStore(host, 0, spec.world, is_master=True,
                          timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
    print(format_rendezvous(f"{host}:{store.port}", json.dumps(dataclasses.asdict(spec))),
          flush=True)
    init_dist(spec, 0, store, timeout_s)
    try:
        runner = ParallelModelRunner(spec, 0)
        store_barrier(store, "built", 0, spec.world, timeout_s)
    except BaseException:
        dist.destroy_process_group()
        raise
    runner.rendezvous = store  # the followers' store lives as long as rank 0
    return runner


def main(argv: list[str] | None = None) -> int:
    """``python -m k3serve.parallel.ranks --store HOST:PORT --rank R --spec JSON``: one
    follower rank; exit 0 after rank 0's ``stop``, 1 on any failure (traceback on stderr)."""
    ap = argparse.ArgumentParser(prog="python -m k3serve.parallel.ranks")
    ap.add_argument("--store", required=True, help="rank 0's rendezvous HOST:PORT")
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--spec", required=True, help="the instance spec (JSON, from rank 0)")
    ap.add_argument("--timeout", type=float, default=300.0, help="rendezvous seconds")
    a = ap.parse_args(argv)
    spec = InstanceSpec(**json.loads(a.spec))
    if not 1 <= a.rank < spec.world:
        raise SystemExit(f"--rank: must be in 1..{spec.world - 1}, got {a.rank}")
    host, _, port = a.store.rpartition(":")
    code = 0
    try:
        store = dist.TCPStore(host, int(port), spec.world, is_master=False,
                              timeout=timedelta(seconds=a.timeout))
        run_follower(spec, a.rank, store, a.timeout)
    except BaseException:  # noqa: BLE001 — printed, then the exit code says it
        traceback.print_exc()
        code = 1
    _exit(code)
    return code


if __name__ == "__main__":
    main()


__all__ = ["main", "run_follower", "start_instance", "start_remote_instance"]
