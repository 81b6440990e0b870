"""The transfer collectives of a multi-rank instance: rank 0's full-head staging pools
(``k3serve.parallel.runner.TransferPools``) ↔ the ranks' head shards.

Rank r of attention group g (``k3serve.parallel.groups``; one group when ``dp`` = 1) holds heads
``(r mod tp)·H/tp …`` of the slots group g owns::

    kda_state[:, s]    [L_kda, H/tp, K, V]           heads of position t = r mod tp
    conv_state[:, s]   [L_kda, W−1, 3·H/tp·K]        channels q_t | k_t | v_t

Rank 0's staging holds the whole state, in one TP-1 process's order: heads concatenated by
position, conv channels ``q_0 … q_{tp−1} | k_0 … | v_0 …`` (``KDAMixer.conv_weight``). MLA latent
pages are replicated on every rank, so rank 0's own pool is already whole.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist


@torch.inference_mode()
def gather_states(runner: Any, slots: Sequence[int]) -> None:
    """Collective (every rank): rank 0 assembles the full-head KDA and conv states of ``slots``
    in ``runner.staging``, each slot from the ranks of the group that owns it. A no-op for
    TP 1 (rank 0's own pools are whole).

    Args:
        runner: a ``k3serve.parallel.runner.RankRunner`` (``spec``, ``rank``, ``pools``,
            ``groups``; rank 0: ``staging``).
        slots: the slots, the same list on every rank.
    """
    tp, world = runner.spec.tp, runner.spec.world
    if tp == 1 or not slots:
        return
    dev = runner.device
    idx = torch.tensor(list(slots), dtype=torch.int64, device=dev)
    kda = runner.pools.kda_state.index_select(1, idx).contiguous()  # [L, n, H/tp, K, V]
    conv = runner.pools.conv_state.index_select(1, idx).contiguous()  # [L, n, W-1, 3·H/tp·K]
    if runner.rank != 0:
        dist.gather(kda, None, dst=0)
        dist.gather(conv, None, dst=0)
        return
    kl = [torch.empty_like(kda) for _ in range(world)]
    cl = [torch.empty_like(conv) for _ in range(world)]
    dist.gather(kda, kl, dst=0)
    dist.gather(conv, cl, dst=0)
    groups = runner.groups
    owners = [groups.owner(s) if groups is not None else 0 for s in slots]
    st = runner.staging
    for g in sorted(set(owners)):
        sel = torch.tensor([i for i, o in enumerate(owners) if o == g], device=dev)
        ks, cs = kl[g * tp:(g + 1) * tp], cl[g * tp:(g + 1) * tp]
        st.kda_state.index_copy_(1, idx[sel], torch.cat(ks, dim=2).index_select(1, sel))
        parts = [c.index_select(1, sel).chunk(3, dim=-1) for c in cs]  # per rank: q_t, k_t, v_t
        st.conv_state.index_copy_(1, idx[sel],
                                  torch.cat([p[j] for j in range(3) for p in parts], -1))


@torch.inference_mode()
def scatter_state(runner: Any, slot: int, pages: Sequence[int]) -> None:
    """Collective (every rank): rank 0's received cache of one request becomes every rank's —
    the inverse of :func:`gather_states` for ``slot`` (TP > 1: each rank gets its position's
    heads / channels and the owner group keeps them; TP 1: the whole state is broadcast) and a
    broadcast of the MLA latent ``pages`` (replicated on every rank)."""
    tp, world = runner.spec.tp, runner.spec.world
    pools = runner.pools
    kda_out = pools.kda_state[:, slot].contiguous()  # [L, H/tp, K, V]
    conv_out = pools.conv_state[:, slot].contiguous()  # [L, W-1, 3·H/tp·K]
    if tp > 1:
        kda_in = conv_in = None
        if runner.rank == 0:
            st = runner.staging
            kd = [c.contiguous() for c in st.kda_state[:, slot].chunk(tp, dim=1)]
            q, k, v = (c.chunk(tp, dim=-1) for c in st.conv_state[:, slot].chunk(3, dim=-1))
            cv = [torch.cat([q[t], k[t], v[t]], -1).contiguous() for t in range(tp)]
            kda_in, conv_in = [kd[r % tp] for r in range(world)], [cv[r % tp] for r in range(world)]
        dist.scatter(kda_out, kda_in, src=0)
        dist.scatter(conv_out, conv_in, src=0)
    else:
        dist.broadcast(kda_out, src=0)
        dist.broadcast(conv_out, src=0)
    if runner.groups is None or runner.groups.mine(slot):
        pools.kda_state[:, slot].copy_(kda_out)
        pools.conv_state[:, slot].copy_(conv_out)
    if pages and pools.mla_latent.shape[0]:
        idx = torch.tensor(list(pages), dtype=torch.int64, device=runner.device)
        lat = pools.mla_latent.index_select(1, idx).contiguous()
        dist.broadcast(lat, src=0)
        pools.mla_latent.index_copy_(1, idx, lat)


__all__ = ["gather_states", "scatter_state"]
