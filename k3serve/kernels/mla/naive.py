"""Plain-torch MLA attention references over the paged latent cache (DeepSeek-V2 §2.1, no rotary).

Cache: ``latent_pool [P, B, D]`` with ``D = kv_lora + rope`` holding ``[c_kv ; k_pe]`` per token
(``c_kv`` after ``kv_a_layernorm``); a sequence's tokens live in the pages of its block-table row.

Two equivalent forms (DESIGN.md §2). With ``W_kv = kv_b_proj.weight`` viewed ``[H, nope+v, kv_lora]``
and split into ``W_uk [H, nope, kv_lora]`` and ``W_uv [H, v, kv_lora]``:

* naive (prefill): ``k_h = [W_uk,h c ; k_pe]``, ``v_h = W_uv,h c``, softmax(q·k·s)·v per head;
* absorbed (decode): ``q̂_h = [W_uk,hᵀ q_nope,h ; q_pe,h]`` (width kv_lora + rope), MQA over the
  latents ``[c ; k_pe]`` with V = ``c`` (width kv_lora), then ``o_h = W_uv,h ô_h``.

Both use the softmax scale ``s = (nope + rope)^-1/2`` (not the absorbed width's). Computation in
float32 (float64 inputs stay float64).
"""

from __future__ import annotations

import torch


def gather_latents(
    latent_pool: torch.Tensor, block_table_row: torch.Tensor, length: int
) -> torch.Tensor:
    """The first ``length`` cached latents of one sequence, in position order.

    Args:
        latent_pool: ``[P, B, D]`` one MLA layer's pages.
        block_table_row: ``[max_blocks]`` int64 page ids (−1 padding past the end).
        length: tokens to gather.

    Returns:
        ``[length, D]`` in the pool dtype.

    Raises:
        ValueError: the block table row covers fewer than ``length`` tokens.
    """
    bs = latent_pool.shape[1]
    nblk = -(-length // bs)
    pages = block_table_row[:nblk]
    if pages.shape[0] < nblk or bool((pages < 0).any()):
        raise ValueError(f"block_table: row covers fewer than {length} tokens")
    return latent_pool[pages].reshape(-1, latent_pool.shape[-1])[:length]


def _ctype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def mla_attention_naive(
    q: torch.Tensor,
    latents: torch.Tensor,
    kv_b_weight: torch.Tensor,
    qk_nope: int,
    v_dim: int,
    scale: float,
    q_start: int,
) -> torch.Tensor:
    """Decompressed causal MLA attention for one sequence.

    Args:
        q: ``[Tq, H, nope+rope]`` queries of positions ``q_start .. q_start+Tq-1``.
        latents: ``[L, kv_lora+rope]`` latents of positions ``0 .. L-1`` (L ≥ q_start + Tq).
        kv_b_weight: ``[H*(nope+v), kv_lora]`` the ``kv_b_proj`` weight.
        qk_nope: nope width; the rope width is ``q.shape[-1] - qk_nope``.
        v_dim: value head width.
        scale: softmax scale (``(nope+rope)^-1/2``).
        q_start: absolute position of the first query.

    Returns:
        ``[Tq, H, v]`` float32 (float64 for float64 inputs). Query i attends keys ``≤ q_start+i``.
    """
    ct = _ctype(q)
    tq, h, _ = q.shape
    kv_lora = kv_b_weight.shape[1]
    c, k_pe = latents[:, :kv_lora].to(ct), latents[:, kv_lora:].to(ct)
    kv = (c @ kv_b_weight.to(ct).t()).view(-1, h, qk_nope + v_dim)
    k_nope, v = kv[..., :qk_nope], kv[..., qk_nope:]
    qf = q.to(ct)
    s = torch.einsum("thd,lhd->htl", qf[..., :qk_nope], k_nope) + torch.einsum(
        "thr,lr->htl", qf[..., qk_nope:], k_pe
    )
    pos_q = torch.arange(tq, device=q.device) + q_start
    mask = torch.arange(latents.shape[0], device=q.device)[None, :] > pos_q[:, None]
    p = torch.softmax((s * scale).masked_fill(mask, float("-inf")), dim=-1)
    return torch.einsum("htl,lhv->thv", p, v)


def mla_prefill_naive_paged(
    q: torch.Tensor,
    latent_pool: torch.Tensor,
    block_table: torch.Tensor,
    cu_seqlens: torch.Tensor,
    num_cached: torch.Tensor,
    kv_b_weight: torch.Tensor,
    qk_nope: int,
    v_dim: int,
    scale: float,
) -> torch.Tensor:
    """Naive MLA over [cached latents ; new latents] of N packed sequences (new latents already
    written to the pool).

    Args:
        q: ``[T, H, nope+rope]`` queries of the new tokens, packed by ``cu_seqlens``.
        latent_pool: ``[P, B, D]`` one layer's pages.
        block_table: ``[N, max_blocks]`` int64.
        cu_seqlens: ``[N+1]`` int64.
        num_cached: ``[N]`` int64 tokens cached before the new ones.
        kv_b_weight, qk_nope, v_dim, scale: as in :func:`mla_attention_naive`.

    Returns:
        ``[T, H, v]`` float32 (float64 for float64 queries).

    Raises:
        ValueError: a block-table row covers fewer than ``num_cached + new`` tokens.
    """
    out = []
    cu, nc = cu_seqlens.tolist(), num_cached.tolist()
    for i in range(len(nc)):
        qi = q[cu[i] : cu[i + 1]]
        lat = gather_latents(latent_pool, block_table[i], nc[i] + qi.shape[0])
        out.append(mla_attention_naive(qi, lat, kv_b_weight, qk_nope, v_dim, scale, nc[i]))
    return torch.cat(out, 0)


def mla_decode_absorbed_paged(
    q_lat: torch.Tensor,
    latent_pool: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    kv_lora: int,
    scale: float,
) -> torch.Tensor:
    """Absorbed MLA decode: MQA of one query per sequence over its paged latents.

    Args:
        q_lat: ``[N, H, kv_lora+rope]`` absorbed queries ``[W_ukᵀ q_nope ; q_pe]``.
        latent_pool: ``[P, B, kv_lora+rope]`` one layer's pages (K = the whole latent, V = the
            first ``kv_lora`` channels).
        block_table: ``[N, max_blocks]`` int64.
        seq_lens: ``[N]`` int64 tokens to attend (the new token included).
        kv_lora: latent width (V width).
        scale: softmax scale (``(nope+rope)^-1/2``, not ``(kv_lora+rope)^-1/2``).

    Returns:
        ``[N, H, kv_lora]`` float32 (float64 for float64 queries) latent outputs (apply
        ``W_uv`` afterwards).

    Raises:
        ValueError: a block-table row covers fewer than its ``seq_lens`` tokens.
    """
    ct = _ctype(q_lat)
    out = []
    for i, n in enumerate(seq_lens.tolist()):
        lat = gather_latents(latent_pool, block_table[i], n).to(ct)
        p = torch.softmax((q_lat[i].to(ct) @ lat.t()) * scale, dim=-1)  # [H, L]
        out.append(p @ lat[:, :kv_lora])
    return torch.stack(out, 0)


__all__ = [
    "gather_latents",
    "mla_attention_naive",
    "mla_decode_absorbed_paged",
    "mla_prefill_naive_paged",
]
