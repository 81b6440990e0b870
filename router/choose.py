"""The placement sequence of one choice: hash the prompt → match the index and the router's
record of where it just sent prompts → the workers' live views → :func:`router.placement.place`
→ record where this prompt goes.

Both ways a choice is placed (a PD stack's prefill + decode pair, a monolithic stack's one
worker) go through :func:`choose`.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence

from router.index import STORE, GlobalIndex
from router.placement import (
    DecodeWorkerState,
    Placement,
    PlacementParams,
    PlacementRequest,
)
from router.policies import live_view
from router.policies.table import place
from router.preprocess import prompt_hashes
from router.recent import RecentPlacements
from router.workers import Worker


def affinity_key(ids: Sequence[int], hashes: Sequence[str], fingerprint: str,
                 cache_salt: str | None) -> str:
    """The content address that breaks placement ties (``PlacementRequest.key``,
    ``router.placement.tie_breaks``): the chained hash of the prompt's last full block (it
    addresses the whole full-block prefix, salted as the workers salt it), or for a prompt
    shorter than one block a ``blake2b`` of its layout, salt and token ids. Every replica
    computes the same key for the same prompt; distinct prompts get unrelated keys."""
    if hashes:
        return hashes[-1]
    h = hashlib.blake2b(f"{fingerprint}\x00{cache_salt or ''}\x00".encode(), digest_size=16)
    h.update(",".join(map(str, ids)).encode())
    return h.hexdigest()


def choose(index: GlobalIndex, layout: tuple[str, int], prefill: Sequence[Worker],
           decode: Sequence[Worker], ids: list[int], cache_salt: str | None, max_new: int,
           seq: int, policy: str, params: PlacementParams, prefill_rate: float,
           recent: RecentPlacements | None = None, now: float | None = None) -> Placement:
    """Place one choice over the given workers and record where it goes in ``recent``.

    A worker's queue and load are priced at its measured prefill rate
    (:attr:`Worker.measured_rate`), else the rate its info states, else ``prefill_rate``.
    A prompt the router sent to a worker and whose cache events have not arrived counts as
    held there (``recent.match``), and the work of the last prompt sent to a worker that this
    one extends is named as such (``recent.extended``, decayed from when that prompt's compute
    ended at the worker's rate: placement does not read it as load that pushes the extension
    away). The chosen worker is recorded in ``recent`` right away, before
    the caller sends the prompt, with its predicted uncached tokens and the boundaries it
    snapshots (the prompt end and ``snapshot_at``).

    Args:
        index: The router's cache index.
        layout: ``(fingerprint, block_size)`` of the cluster.
        prefill: The prefill candidates (a monolithic stack: its workers, which prefill and
            decode a choice on one worker).
        decode: The decode candidates; empty for a monolithic stack (the placement's
            ``decode`` is then ``None`` and the shared store is not considered).
        ids: The prompt's token ids.
        cache_salt: The request's cache salt.
        max_new: Most new tokens of the choice.
        seq: The round-robin / random sequence number.
        policy / params: The prefill policy's name and knobs.
        prefill_rate: Prefill tokens/s of a worker that reports no measured rate and states
            none in its info (the router's ``--prefill-rate``).
        recent: Where the router just sent prompts (``None``: no such record).
        now: Monotonic seconds (``None``: the clock).

    Raises:
        NoWorkerAvailable: as :func:`router.placement.place`.
    """
    fingerprint, bs = layout
    hashes = prompt_hashes(ids, bs, fingerprint, cache_salt)
    req = PlacementRequest(len(ids), bs, seq=seq, max_new_tokens=max_new,
                           key=affinity_key(ids, hashes, fingerprint, cache_salt))
    match = index.match(hashes, req.max_cached_blocks)
    store = match.get(STORE) if decode else None  # the shared store's content, if reported
    t = time.monotonic() if now is None else now
    pending = recent.match(hashes, req.max_cached_blocks, t) if recent is not None else {}
    rates = {w.url: w.measured_rate or w.info.prefill_rate or prefill_rate for w in prefill}
    chain = (recent.extended(hashes, t, prefill[0].recent.horizon_s, rates)
             if recent is not None and prefill else {})
    pstates = []
    for w in prefill:
        static = w.info.prefill_rate or prefill_rate
        rate = rates[w.url]
        pstates.append(live_view(w.url, match.get(w.url), store, w.placement_queued(rate, now),
                                 static, w.placement_load, now, pending=pending.get(w.url),
                                 measured_rate=w.measured_rate,
                                 chain_tokens=chain.get(w.url, 0.0)))
    dstates = [DecodeWorkerState(w.url, w.placement_free_tokens(), w.placement_free_slots(),
                                 w.placement_running) for w in decode]
    p = place(req, pstates, dstates, policy, params)
    if recent is not None:
        recent.record(p.prefill, hashes,
                      [req.max_cached_blocks, *(s // bs for s in p.snapshot_at)],
                      len(ids) - p.predicted_cached_tokens, t)
    return p
