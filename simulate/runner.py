"""Run several policies over one trace, in parallel processes, behind one progress bar."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue as _queue
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor

from simulate.config import PolicyResult, SimConfig, TraceFacts, trace_facts
from simulate.engine import replay
from simulate.traces import TraceRequest

_JOB: dict = {}


def _init(reqs, cfg, facts, queue) -> None:
    _JOB.update(reqs=reqs, cfg=cfg, facts=facts, queue=queue)


def _one(policy: str) -> PolicyResult:
    q = _JOB["queue"]
    return replay(_JOB["reqs"], policy, _JOB["cfg"], _JOB["facts"],
                  progress=(q.put if q is not None else None))


def run(reqs: Sequence[TraceRequest], policies: Sequence[str], cfg: SimConfig | None = None,
        jobs: int | None = None, progress: bool = True,
        facts: TraceFacts | None = None) -> list[PolicyResult]:
    """Replay ``reqs`` under each policy; results in the order of ``policies``.

    Args:
        reqs: the scaled trace.
        policies: names in ``router.policies.table.POLICIES`` (checked before anything runs).
        cfg: the deployment (``None``: ``SimConfig()``).
        jobs: worker processes (default: ``min(len(policies), os.cpu_count())``; 1 = inline).
        progress: show a tqdm bar over requests × policies (on stderr).
        facts: :func:`trace_facts` of ``reqs`` when already computed.

    Raises:
        ValueError: an unknown policy (``"policy"``) or no policy.
    """
    from router.policies.table import POLICIES

    if not policies:
        raise ValueError("policy: none given")
    for p in policies:
        if p not in POLICIES:
            raise ValueError(f"policy: {p!r} is not one of {sorted(POLICIES)}")
    cfg = cfg or SimConfig()
    facts = facts or trace_facts(reqs)
    jobs = jobs or min(len(policies), os.cpu_count() or 1)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(reqs) * len(policies), unit="req", desc="simulate",
                   dynamic_ncols=True, leave=False)
    try:
        if jobs <= 1 or len(policies) == 1:
            out = []
            for p in policies:
                out.append(replay(reqs, p, cfg, facts,
                                  progress=(bar.update if bar is not None else None)))
            return out
        ctx = mp.get_context("fork") if "fork" in mp.get_all_start_methods() else mp.get_context()
        queue = ctx.Queue() if bar is not None else None
        with ProcessPoolExecutor(jobs, mp_context=ctx, initializer=_init,
                                 initargs=(list(reqs), cfg, facts, queue)) as ex:
            futs = [ex.submit(_one, p) for p in policies]
            while bar is not None and not all(f.done() for f in futs):
                try:
                    bar.update(queue.get(timeout=0.2))
                except _queue.Empty:  # nothing new: poll the futures again
                    continue
            return [f.result() for f in futs]
    finally:
        if bar is not None:
            bar.close()
