"""MLA prefill over the paged latent cache through ``torch.nn.functional.scaled_dot_product_attention``.

The fast twin of :func:`k3serve.kernels.mla.naive.mla_prefill_naive_paged` (same arguments,
same function): per sequence the cached + new latents are gathered once, decompressed with one
``kv_b_proj`` matmul in the query dtype (``k_h = [W_uk,h c ; k_pe]``, ``v_h = W_uv,h c``), and
attended by SDPA — on CUDA a fused memory-efficient / flash kernel that never materialises the
``[H, Tq, L]`` score matrix the naive path builds in float32 (4.3 GB per 8k-token sequence at
16 heads). Queries continuing a cached prefix are aligned to the end of the keys
(``causal_lower_right``): query ``i`` attends keys ``≤ num_cached + i``.

Precision: matmuls run in ``q.dtype`` (bf16 on the GPU path, float32 accumulation inside the
kernels); the naive reference computes everything in float32. On float32 inputs the two agree
to float32 rounding (the CPU tests check this).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

PrefillHostMeta = tuple[list[int], list[int], list[list[int]]]
"""``(cu_seqlens, num_cached, block_table)`` of one forward as host lists."""


def make_host_meta(
    cu_seqlens: torch.Tensor, num_cached: torch.Tensor, block_table: torch.Tensor
) -> PrefillHostMeta:
    """The host copy :func:`mla_prefill_sdpa_paged` reads (one device → host read of each; the
    model's forward makes it once and hands it to every MLA layer)."""
    return cu_seqlens.tolist(), num_cached.tolist(), block_table.tolist()


def mla_prefill_sdpa_paged(
    q: torch.Tensor,
    latent_pool: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens: torch.Tensor,
    num_cached: torch.Tensor,
    kv_b_weight: torch.Tensor,
    qk_nope: int,
    v_dim: int,
    scale: float,
    host_meta: PrefillHostMeta | None = None,
) -> torch.Tensor:
    """MLA over [cached latents ; new latents] of N packed sequences (new latents already in
    the pool), one SDPA call per sequence.

    Args:
        q: ``[T, H, nope+rope]`` queries of the new tokens, packed by ``cu_seqlens``
            (bf16 / fp16 / fp32 / fp64; the compute dtype).
        latent_pool: ``[P, B, kv_lora+rope]`` one layer's pages.
        block_table: ``[N, max_blocks]`` int64.
        cu_seqlens: ``[N+1]`` int64.
        num_cached: ``[N]`` int64 tokens cached before the new ones.
        kv_b_weight: ``[H*(nope+v), kv_lora]`` the ``kv_b_proj`` weight.
        qk_nope: nope width; the rope width is ``q.shape[-1] - qk_nope``.
        v_dim: value head width.
        scale: softmax scale (``(nope+rope)^-1/2``).
        host_meta: ``cu_seqlens``, ``num_cached`` and ``block_table`` as host lists
            (:func:`make_host_meta`), read once per forward by the caller and shared by its MLA
            layers; None: read here (one device → host copy per call).

    Returns:
        ``[T, H, v]`` in ``q.dtype``.

    Raises:
        ValueError: a block-table row covers fewer than ``num_cached + new`` tokens.
    """
    dt = q.dtype
    t, h, _ = q.shape
    kv_lora = kv_b_weight.shape[1]
    w = kv_b_weight.to(dt)
    out = q.new_empty(t, h, v_dim)
    if host_meta is None:
        host_meta = make_host_meta(cu_seqlens, num_cached, block_table)
    cu, nc, bt = host_meta
    bs = latent_pool.shape[1]
    for i in range(len(nc)):
        tq = cu[i + 1] - cu[i]
        if tq == 0:
            continue
        length = nc[i] + tq
        nblk = -(-length // bs)
        if len(bt[i]) < nblk or min(bt[i][:nblk]) < 0:  # checked on the host copy: no sync
            raise ValueError(f"block_table: row {i} covers fewer than {length} tokens")
        lat = latent_pool[block_table[i, :nblk]].reshape(-1, latent_pool.shape[-1])[:length]
        c, k_pe = lat[:, :kv_lora].to(dt), lat[:, kv_lora:].to(dt)
        kv = (c @ w.t()).view(length, h, qk_nope + v_dim)
        k = torch.cat([kv[..., :qk_nope], k_pe[:, None, :].expand(length, h, k_pe.shape[-1])], -1)
        v = kv[..., qk_nope:]
        # [1, H, len, E]: the fused CUDA kernels (and CausalBias's dispatch) want 4-D inputs;
        # 3-D ones would fall back to the math path, which materialises the scores
        qi = q[cu[i] : cu[i + 1]].transpose(0, 1)[None]
        kt, vt = k.transpose(0, 1)[None], v.transpose(0, 1)[None]
        if nc[i] == 0:
            o = F.scaled_dot_product_attention(qi, kt, vt, is_causal=True, scale=scale)
        else:
            mask = causal_lower_right(tq, length)
            o = F.scaled_dot_product_attention(qi, kt, vt, attn_mask=mask, scale=scale)
        out[cu[i] : cu[i + 1]] = o[0].transpose(0, 1)
    return out


__all__ = ["PrefillHostMeta", "make_host_meta", "mla_prefill_sdpa_paged"]
