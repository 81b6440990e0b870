"""Pool sizes from the accelerator's memory (vLLM's ``gpu_memory_utilization``): bytes per
slot / snapshot / page, a profiled forward's activations, and the pages that fit."""

from __future__ import annotations

import dataclasses

import torch

from k3serve.cache.pools import KVPools
from k3serve.cache.specs import (
    CacheDtypes,
    KDAStateSpec,
    MLALatentSpec,
    auto_dense_snapshot_blocks,
)
from k3serve.config import ModelConfig
from k3serve.engine.config import EngineConfig


def pool_bytes(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """Bytes of one state slot, one snapshot and one latent page (all layers).

    Returns:
        ``(slot_bytes, snapshot_bytes, page_bytes)``: a slot / snapshot holds every KDA layer's
        ``[H, K, V]`` float32 state and ``[W-1, 3·H·K]`` conv state (``dtype``); a page holds
        every MLA layer's ``[B, D]`` latents (``dtype``) — the :class:`KVPools` layout.
    """
    es = torch.empty((), dtype=dtype).element_size()
    lk, h, k = cfg.num_kda_layers, cfg.kda_num_heads, cfg.kda_head_dim
    state = lk * (h * k * k * 4 + (cfg.kda_conv_kernel - 1) * cfg.kda_conv_dim * es)
    page = cfg.num_mla_layers * block_size * cfg.mla_latent_dim * es
    return state, state, page


def size_pools_from_memory(
    cfg: ModelConfig,
    total_bytes: int,
    free_bytes: int,
    utilization: float,
    reserve_bytes: int,
    block_size: int,
    num_slots: int,
    num_snapshots: int,
    dtype: torch.dtype,
    extra: int = 0,
    held_bytes: int | None = None,
) -> int:
    """Latent pages that fit the engine's memory share (vLLM's ``gpu_memory_utilization``).

    ``budget = min(utilization·total − held, free) − reserve`` bytes, where ``held`` is what
    this process already holds (its weights; ``held_bytes``, default ``total − free``: every
    process on the card) and ``reserve`` the activations (a profiled forward) and graph
    memory; the slots (``num_slots + extra``) and snapshots come out of the budget first, the
    pages take the rest. Counting only this process's bytes lets several engines share one
    card, each with its own share of the total.

    Args:
        cfg: model config. total_bytes, free_bytes: the accelerator's memory (bytes), as
            ``torch.cuda.mem_get_info`` reports it after the weights load.
        utilization: share in (0, 1]. reserve_bytes: activations + graphs (bytes).
        block_size: tokens per page. num_slots, num_snapshots: the other pools' sizes.
        dtype: latent / conv dtype. extra: scratch slots / pages the engine adds (CUDA graphs).
        held_bytes: bytes this process holds now (``torch.cuda.memory_reserved``).

    Returns:
        ``num_pages`` (≥ 1).

    Raises:
        ValueError: the budget cannot hold the slots, snapshots and one page (the message
            gives the figures: lower ``max_num_seqs`` / ``num_snapshots`` or raise the share).
    """
    slot_b, snap_b, page_b = pool_bytes(cfg, block_size, dtype)
    held = total_bytes - free_bytes if held_bytes is None else held_bytes
    budget = min(int(utilization * total_bytes) - held, free_bytes) - reserve_bytes
    left = budget - (num_slots + extra) * slot_b - num_snapshots * snap_b - extra * page_b
    pages = left // page_b if left > 0 else 0
    if pages < 1:
        gib = 1 << 30
        raise ValueError(
            f"EngineConfig.gpu_memory_utilization: {utilization} of {total_bytes / gib:.1f} GiB "
            f"leaves {budget / gib:.2f} GiB after {held / gib:.2f} GiB held "
            f"and {reserve_bytes / gib:.2f} GiB of activations; {num_slots} slots and "
            f"{num_snapshots} snapshots need {(num_slots * slot_b + num_snapshots * snap_b) / gib:.2f}"
            " GiB before any page"
        )
    return int(pages)


@torch.inference_mode()
def profile_activation_bytes(
    model: torch.nn.Module, cfg: ModelConfig, num_tokens: int, block_size: int,
    dtype: torch.dtype, device: torch.device,
) -> int:  # fmt: skip
    """Peak bytes a forward of ``num_tokens`` prompt tokens allocates beyond what is held
    (one throw-away sequence in tiny pools; CUDA only, as vLLM's profile run)."""
    from k3serve.model.batch import make_batch

    pages = -(-num_tokens // block_size)
    tmp = KVPools(cfg, 1, pages, block_size, 0, dtype, device)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    b = make_batch([num_tokens], [0], [0], [list(range(pages))], block_size, device=device)
    ids = torch.zeros(num_tokens, dtype=torch.int64, device=device)
    model(ids, b, tmp)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    del tmp, b, ids
    torch.cuda.empty_cache()
    return int(peak)


def fit_to_memory(
    c: EngineConfig, model: torch.nn.Module, cfg: ModelConfig, dtype: torch.dtype,
    device: torch.device, extra: int,
) -> EngineConfig:  # fmt: skip
    """``c`` with ``num_slots`` / ``num_pages`` sized from the accelerator's free memory
    (:func:`size_pools_from_memory`) when ``c.gpu_memory_utilization`` is set on CUDA; ``c``
    itself otherwise.

    Args:
        c: the engine config. model, cfg: the loaded model and its config (profiled).
        dtype: latent / conv pool dtype. device: where the pools go.
        extra: scratch slots / pages the engine adds (1 with CUDA graphs, else 0).

    Raises:
        ValueError: as :func:`size_pools_from_memory`.
    """
    if c.gpu_memory_utilization is None or device.type != "cuda":
        return c
    slots = max(c.num_slots, c.max_num_seqs or 0)
    reserve = profile_activation_bytes(
        model, cfg, c.max_num_batched_tokens, c.block_size, dtype, device
    )
    reserve = reserve * (2 if extra else 1)  # the graphs' pool beside the eager one
    free, total = torch.cuda.mem_get_info(device)
    pages = size_pools_from_memory(
        cfg, total, free, float(c.gpu_memory_utilization), reserve,
        c.block_size, slots, c.num_snapshots, dtype, extra,
        held_bytes=torch.cuda.memory_reserved(device),
    )  # fmt: skip
    return dataclasses.replace(c, num_slots=slots, num_pages=pages)


def dense_snapshot_blocks(c: EngineConfig, cfg: ModelConfig, dtype_name: str) -> int:
    """``c.dense_snapshot_blocks``, or for ``-1`` the count chosen from the specs' byte
    arithmetic (:func:`~k3serve.cache.specs.auto_dense_snapshot_blocks`)."""
    if c.dense_snapshot_blocks >= 0:
        return c.dense_snapshot_blocks
    return auto_dense_snapshot_blocks(
        MLALatentSpec.from_config(cfg, c.block_size, dtype_name),
        KDAStateSpec.from_config(cfg, CacheDtypes(dtype_name, dtype_name, "float32")),
    )


__all__ = [
    "dense_snapshot_blocks",
    "fit_to_memory",
    "pool_bytes",
    "profile_activation_bytes",
    "size_pools_from_memory",
]
