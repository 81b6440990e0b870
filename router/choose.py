"""The placement sequence of one choice: hash the prompt → match the index → the workers'
live views → :func:`router.placement.place`.

Both ways a choice is placed (a PD stack's prefill + decode pair, a monolithic stack's one
worker) go through :func:`choose`.
"""

from __future__ import annotations

import hashlib
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
           seq: int, policy: str, params: PlacementParams, prefill_rate: float) -> Placement:
    """Place one choice over the given workers (pure but for reading their load accounts).

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
        prefill_rate: Prefill tokens/s of a worker that reports none.

    Raises:
        NoWorkerAvailable: as :func:`router.placement.place`.
    """
    fingerprint, bs = layout
    hashes = prompt_hashes(ids, bs, fingerprint, cache_salt)
    req = PlacementRequest(len(ids), bs, seq=seq, max_new_tokens=max_new,
                           key=affinity_key(ids, hashes, fingerprint, cache_salt))
    match = index.match(hashes, req.max_cached_blocks)
    store = match.get(STORE) if decode else None  # the shared store's content, if reported
    rates = [w.info.prefill_rate or prefill_rate for w in prefill]
    pstates = [live_view(w.url, match.get(w.url), store, w.placement_queued(r), r,
                         w.placement_load)
               for w, r in zip(prefill, rates, strict=True)]
    dstates = [DecodeWorkerState(w.url, w.placement_free_tokens(), w.placement_free_slots(),
                                 w.placement_running) for w in decode]
    return place(req, pstates, dstates, policy, params)
