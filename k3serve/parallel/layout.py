"""Per-rank cache specs, the per-rank memory plan, and the pairing rule between TP instances.

Torch-free (config arithmetic only), so kvstore/ and the router can import it.

Per rank r of a TP-``tp`` instance (``k3serve.parallel.tp``)::

    KDA state   [L_kda, S, H/tp, K, V]      heads r·H/tp … (r+1)·H/tp − 1   split
    conv state  [L_kda, S, W−1, 3·H/tp·K]   channels q_r | k_r | v_r         split
    MLA latent  [L_mla, P, B, kv_lora+rope] every token's latent             replicated

so one sequence's KDA bytes per rank are 1/tp of the whole, while every rank stores every
latent page: the instance's latent memory is tp × one copy. With ``dp`` attention groups
(:func:`attention_groups`, ``k3serve.parallel.groups``) every rank has these pools; a slot's
state is live on the group that owns it, latents and snapshots are replicated over the groups.

Disaggregated pairing: a prefill instance hands off to a decode
instance only when both have the same ``tp`` — rank r sends to rank r exactly the bytes it
holds (same head group, same latent pages), no regrouping. A mismatched pair is refused at
pairing with a ``ParallelMismatch`` naming the field (``tp``); resharding (KDA heads regrouped,
latents copied) is not built.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from k3serve.cache.specs import CacheDtypes, KDAStateSpec, MLALatentSpec
from k3serve.config import ModelConfig


class ParallelMismatch(ValueError):
    """Two instances whose parallel layouts cannot exchange caches; ``field`` names why."""

    def __init__(self, field: str, local: Any, remote: Any) -> None:
        self.field, self.local, self.remote = field, local, remote
        super().__init__(
            f"{field}: this instance has {field}={local}, the peer has {field}={remote}; "
            f"a prefill/decode pair must use the same {field} (resharding KDA heads between "
            f"different tensor-parallel degrees is not supported)"
        )


@dataclass(frozen=True)
class RankCacheSpec:
    """The cache one rank holds.

    Attributes:
        tp: tensor-parallel degree of the instance.
        rank: this rank.
        kda: the rank's ``KDAStateSpec`` (H/tp heads).
        mla: the rank's ``MLALatentSpec`` (the full latent: replicated).
        head_range: ``(first, last + 1)`` global KDA heads held.
    """

    tp: int
    rank: int
    kda: KDAStateSpec
    mla: MLALatentSpec
    head_range: tuple[int, int]

    def fingerprint(self) -> dict[str, Any]:
        """Fields a pairing compares (add to kvstore's layout fingerprint)."""
        return {"tp": self.tp, "rank": self.rank, "kda_heads": list(self.head_range)}


def rank_cache_spec(
    cfg: ModelConfig, tp: int, rank: int, block_size: int, dtypes: CacheDtypes | None = None
) -> RankCacheSpec:
    """Cache spec of rank ``rank`` of a TP-``tp`` instance.

    Raises:
        ValueError: ``tp`` < 1, ``rank`` outside ``[0, tp)``, or a head count not divisible by
            ``tp`` (naming the field).
    """
    if not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp: must be an int ≥ 1, got {tp!r}")
    if not 0 <= rank < tp:
        raise ValueError(f"rank: {rank} outside [0, tp={tp})")
    if cfg.kda_num_heads % tp:
        raise ValueError(f"tp: kda_num_heads = {cfg.kda_num_heads} is not divisible by {tp}")
    if cfg.mla_layers and cfg.mla_num_heads % tp:
        raise ValueError(f"tp: mla_num_heads = {cfg.mla_num_heads} is not divisible by {tp}")
    hl = cfg.kda_num_heads // tp
    local = cfg.replace(kda_num_heads=hl)
    d = dtypes or CacheDtypes.for_config(cfg)
    return RankCacheSpec(
        tp=tp,
        rank=rank,
        kda=KDAStateSpec.from_config(local, d),
        mla=MLALatentSpec.from_config(cfg, block_size, d.latent),
        head_range=(rank * hl, (rank + 1) * hl),
    )


def instance_cache_bytes(
    cfg: ModelConfig, tp: int, num_slots: int, num_pages: int, block_size: int,
    dtypes: CacheDtypes | None = None,
) -> dict[str, int]:
    """Memory plan of a TP instance's pools, bytes: per rank and summed over the ranks.

    Returns:
        ``{"kda_per_rank", "mla_per_rank", "per_rank", "instance"}`` — KDA slots split, latent
        pages replicated (``instance = tp · per_rank``).
    """
    s = rank_cache_spec(cfg, tp, 0, block_size, dtypes)
    kda = num_slots * s.kda.slot_size_bytes
    mla = num_pages * s.mla.page_size_bytes
    return {"kda_per_rank": kda, "mla_per_rank": mla, "per_rank": kda + mla,
            "instance": tp * (kda + mla)}


def attention_groups(tp: int, ep: int) -> int:
    """Attention groups ``dp`` of an instance of ``max(tp, ep)`` ranks.

    ``tp`` > 1 and ``ep`` > ``tp``: ``dp = ep / tp`` groups of ``tp`` ranks (ranks
    ``g·tp … g·tp + tp − 1`` form group g), each running attention for its own sequences, the
    MoE expert-parallel over all ``ep`` ranks (``k3serve.parallel.groups``). Otherwise one group:
    ``tp`` = ``ep`` (heads and experts over the same ranks), ``ep`` = 1 (tensor parallel only)
    or ``tp`` = 1 (attention replicated on every rank, experts split).

    Raises:
        ValueError: ``tp`` or ``ep`` < 1, or ``tp`` > 1 < ``ep`` with ``ep`` not a multiple of
            ``tp`` (naming the field).
    """
    for name, v in (("tp", tp), ("ep", ep)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}: must be an int ≥ 1, got {v!r}")
    if tp > 1 and ep > 1 and ep % tp:
        raise ValueError(f"ep: {ep} is not a multiple of tp {tp} (attention groups of tp ranks "
                         f"over the ep ranks)")
    return ep // tp if tp > 1 and ep > tp else 1


def check_pair(local_tp: int, remote_tp: int) -> list[tuple[int, int]]:
    """The rank pairing of a prefill → decode hand-off.

    Returns:
        ``[(prefill rank r, decode rank r)]`` for r in ``range(tp)``.

    Raises:
        ParallelMismatch: ``local_tp != remote_tp`` (the message names ``tp``).
    """
    if local_tp != remote_tp:
        raise ParallelMismatch("tp", local_tp, remote_tp)
    return [(r, r) for r in range(local_tp)]


__all__ = [
    "ParallelMismatch",
    "RankCacheSpec",
    "attention_groups",
    "check_pair",
    "instance_cache_bytes",
    "rank_cache_spec",
]
