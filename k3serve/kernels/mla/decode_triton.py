"""Weight-absorbed MLA decode in Triton over the paged latent cache, split along the context.

DeepSeek-V2 §2.1 (MLA), in the absorbed form of DESIGN.md §2: each of the ``H`` heads has one
query ``q̂ = [W_ukᵀ q_nope ; q_pe]`` of width ``D = kv_lora + rope`` (K3: 512 + 64), and all
heads attend the same per-token latents ``[c_kv ; k_pe]`` (MQA) with value ``c_kv``. The torch
reference is ``k3serve.kernels.mla.naive.mla_decode_absorbed_paged``.

Layout: one layer's pool ``latent_pool [P, B, D]`` (pages of ``B`` tokens), a sequence's
position ``t`` lives at page ``block_table[n, t // B]``, offset ``t % B``.

Split-K (flash-decoding): the context of each sequence is cut into ``num_splits`` contiguous
ranges; program ``(n, head-block, split)`` streams its range once for a block of ``BH`` heads
(so each latent byte is read once per head block — the whole point of MQA), keeping an online
softmax ``(m, l, acc)``; a second launch merges the splits::

    o = Σ_s exp(m_s − M) acc_s / Σ_s exp(m_s − M) l_s,   M = max_s m_s

Traffic ≈ ``Σ_n len_n · D · bytes`` per head block: the roofline counts exactly that.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl


@triton.jit
def _mla_split_kernel(
    q,
    pool,
    bt,
    lens,
    acc_out,
    ml_out,
    o,
    scale,
    H,
    s_qn,
    s_qh,
    s_p,
    s_b,
    s_btn,
    NS,
    PAGE: tl.constexpr,
    DC: tl.constexpr,
    DR: tl.constexpr,
    BH: tl.constexpr,
    BN: tl.constexpr,
    PREC: tl.constexpr,
    SINGLE: tl.constexpr,
):
    i_n, i_hb, i_s = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)
    L = tl.load(lens + i_n).to(tl.int64)
    per = tl.cdiv(tl.cdiv(L, NS), BN) * BN  # a multiple of BN: blocks stay aligned to BN
    start = i_s * per
    end = tl.minimum(start + per, L)
    o_h = i_hb * BH + tl.arange(0, BH)
    m_h = o_h < H
    o_c = tl.arange(0, DC)
    o_r = tl.arange(0, DR)
    p_q = q + i_n * s_qn + o_h[:, None] * s_qh
    b_qc = tl.load(p_q + o_c[None, :], mask=m_h[:, None], other=0.0)
    b_qr = tl.load(p_q + DC + o_r[None, :], mask=m_h[:, None], other=0.0)
    DT = pool.dtype.element_ty
    b_qc = b_qc.to(DT)
    b_qr = b_qr.to(DT)
    b_m = tl.full([BH], float("-inf"), dtype=tl.float32)
    b_l = tl.zeros([BH], dtype=tl.float32)
    b_acc = tl.zeros([BH, DC], dtype=tl.float32)
    o_t = tl.arange(0, BN)
    # token-row offsets inside one block, loop-invariant (int32)
    off_c = o_t[:, None] * s_b + o_c[None, :]
    off_r = o_t[:, None] * s_b + DC + o_r[None, :]
    p_bt = bt + i_n * s_btn
    for t in range(start, end, BN):
        m_t = (t + o_t) < end
        if PAGE % BN == 0:
            # the block lies inside one page: one page-table read per block
            page = tl.load(p_bt + t // PAGE).to(tl.int64)
            base = pool + page * s_p + (t % PAGE) * s_b
            b_c = tl.load(base + off_c, mask=m_t[:, None], other=0.0)
            b_r = tl.load(base + off_r, mask=m_t[:, None], other=0.0)
        else:
            # the block spans pages (BN > PAGE) or PAGE is not a multiple of BN: one page id
            # per token row (BN // PAGE distinct ones when BN is a multiple of PAGE)
            pos = t + o_t
            page = tl.load(p_bt + pos // PAGE, mask=m_t, other=0).to(tl.int64)
            p_tok = pool + page * s_p + (pos % PAGE) * s_b
            b_c = tl.load(p_tok[:, None] + o_c[None, :], mask=m_t[:, None], other=0.0)
            b_r = tl.load(p_tok[:, None] + DC + o_r[None, :], mask=m_t[:, None], other=0.0)
        b_s = tl.dot(b_qc, tl.trans(b_c), input_precision=PREC)
        b_s += tl.dot(b_qr, tl.trans(b_r), input_precision=PREC)
        b_s = tl.where(m_t[None, :], b_s * scale, float("-inf"))
        m_new = tl.maximum(b_m, tl.max(b_s, 1))
        b_p = tl.exp(b_s - m_new[:, None])
        alpha = tl.exp(b_m - m_new)
        b_l = b_l * alpha + tl.sum(b_p, 1)
        b_acc = b_acc * alpha[:, None] + tl.dot(b_p.to(DT), b_c, input_precision=PREC)
        b_m = m_new
    if SINGLE:
        # one split: normalise here, no merge launch
        tl.store(o + (i_n * H + o_h)[:, None] * DC + o_c[None, :], b_acc / b_l[:, None], mask=m_h[:, None])
    else:
        base_o = (i_n * H + o_h) * NS + i_s  # [BH]
        tl.store(acc_out + base_o[:, None] * DC + o_c[None, :], b_acc, mask=m_h[:, None])
        tl.store(ml_out + base_o * 2, b_m, mask=m_h)
        tl.store(ml_out + base_o * 2 + 1, b_l, mask=m_h)


@triton.jit
def _mla_merge_kernel(acc, ml, o, NS, DC: tl.constexpr, BS: tl.constexpr):
    i_nh = tl.program_id(0).to(tl.int64)
    o_s = tl.arange(0, BS)
    m_s = o_s < NS
    b_m = tl.load(ml + (i_nh * NS + o_s) * 2, mask=m_s, other=float("-inf"))
    b_l = tl.load(ml + (i_nh * NS + o_s) * 2 + 1, mask=m_s, other=0.0)
    M = tl.max(b_m, 0)
    w = tl.where(m_s & (b_l > 0), tl.exp(b_m - M), 0.0)
    o_c = tl.arange(0, DC)
    b_acc = tl.load(acc + (i_nh * NS + o_s[:, None]) * DC + o_c[None, :], mask=m_s[:, None], other=0.0)
    out = tl.sum(w[:, None] * b_acc, 0) / tl.sum(w * b_l, 0)
    tl.store(o + i_nh * DC + o_c, out)


def default_num_splits(num_seqs: int, head_blocks: int, max_len: int, num_sms: int = 132) -> int:
    """Context splits per sequence (flash-decoding) for shapes the tuned table does not cover.

    About two programs per SM (``round(2 · num_sms / (num_seqs · head_blocks))``), at least 512
    tokens a split: the rule behind every entry of :data:`TUNED` (an H200 sweep, where one
    program of BLOCK_N 64 with 2 stages fills an SM's shared memory).
    """
    progs = max(1, num_seqs * head_blocks)
    return int(max(1, min(round(2 * num_sms / progs), triton.cdiv(max(1, max_len), 512))))


# (sequences × head blocks, context) → (splits, block_n, num_warps, num_stages): the best of an
# H200 sweep (``benchmarks/gpu_kernels_sweep.py``; bf16 latents, D = 512 + 64,
# 16 heads = one head block, pages of 64). ``mla_decode_config`` picks the nearest entry.
TUNED: dict[tuple[int, int], tuple[int, int, int, int]] = {
    (64, 4096): (4, 64, 4, 2),
    (64, 32768): (4, 64, 4, 2),
    (256, 4096): (1, 64, 4, 2),
    (256, 32768): (1, 64, 4, 2),
}
DEFAULT_KNOBS = (64, 4, 2)  # block_n, num_warps, num_stages off the table


def mla_decode_config(num_seqs: int, head_blocks: int, max_len: int, num_sms: int = 132) -> tuple[int, int, int, int]:
    """``(num_splits, block_n, num_warps, num_stages)`` for a decode batch.

    The entry of :data:`TUNED` nearest in ``log2`` of (programs = ``num_seqs · head_blocks``,
    ``max_len``) when both are within a factor 2 of it; its splits are scaled by the ratio of
    programs (so the grid keeps about the same size) and capped at one block per split. Other
    shapes: :func:`default_num_splits` with :data:`DEFAULT_KNOBS`. The table was measured on 132
    SMs; other SM counts scale the split count by ``num_sms / 132``.
    """
    progs = max(1, num_seqs * head_blocks)
    best, dist = None, 2.0
    for (p0, l0), cfg in TUNED.items():
        dp, dl = abs(math.log2(progs / p0)), abs(math.log2(max(1, max_len) / l0))
        if dp <= 1.0 and dl <= 1.0 and dp + dl < dist:
            best, dist = (p0, cfg), dp + dl
    if best is None:
        bn, nw, st = DEFAULT_KNOBS
        return default_num_splits(num_seqs, head_blocks, max_len, num_sms), bn, nw, st
    p0, (s0, bn, nw, st) = best
    splits = round(s0 * p0 / progs * num_sms / 132)
    return int(max(1, min(splits, triton.cdiv(max(1, max_len), bn)))), bn, nw, st


def mla_decode_absorbed_paged_triton(
    q_lat: torch.Tensor,
    latent_pool: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    kv_lora: int,
    scale: float,
    *,
    num_splits: int | None = None,
    max_seq_len: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    r"""Absorbed MLA decode over paged latents; same contract as
    :func:`k3serve.kernels.mla.naive.mla_decode_absorbed_paged`.

    Args:
        q_lat (torch.Tensor): ``[N, H, kv_lora + rope]`` absorbed queries (cast to the pool dtype
            for the products).
        latent_pool (torch.Tensor): ``[P, B, kv_lora + rope]`` one layer's pages (bf16 on GPU);
            the last dim must be contiguous.
        block_table (torch.Tensor): ``[N, max_blocks]`` int page ids (−1 past the end: never read).
        seq_lens (torch.Tensor): ``[N]`` int tokens to attend (new token included, ≥ 1).
        kv_lora (int): value width (a power of two; K3: 512); rope = D − kv_lora (power of two).
        scale (float): softmax scale (``(nope + rope)^-1/2``).
        num_splits (int, optional): context splits; 1 writes the output from the one launch (no
            merge). Knobs left None come from :func:`mla_decode_config` (the tuned table).
        max_seq_len (int, optional): longest ``seq_lens`` (avoids a host sync when the table is
            consulted).
        block_n (int, optional): tokens per step (power of two ≥ 16); when it divides the page
            size each step reads the page table once, else once per token row.
        num_warps, num_stages (int, optional): launch config.

    Returns:
        ``[N, H, kv_lora]`` float32 latent outputs (apply ``W_uv`` afterwards).

    Raises:
        ValueError: bad shapes or widths that are not powers of two.
    """
    N, H, D = q_lat.shape
    DR = D - kv_lora
    if latent_pool.dim() != 3 or latent_pool.shape[-1] != D or latent_pool.stride(-1) != 1:
        raise ValueError(f"latent_pool must be [P, B, {D}] with a contiguous last dim")
    for name, d in (("kv_lora", kv_lora), ("rope", DR)):
        if d < 16 or d & (d - 1):
            raise ValueError(f"mla decode: {name}={d} must be a power of two >= 16")
    if block_table.shape[0] != N or seq_lens.shape != (N,):
        raise ValueError("block_table [N, max_blocks] and seq_lens [N] must match q_lat's N")
    page = latent_pool.shape[1]
    BH = max(16, min(64, triton.next_power_of_2(H)))
    hb = triton.cdiv(H, BH)
    if None in (num_splits, block_n, num_warps, num_stages):
        if max_seq_len is None:
            max_seq_len = int(seq_lens.max()) if N else 1
        props = torch.cuda.get_device_properties(q_lat.device) if q_lat.is_cuda else None
        cfg = mla_decode_config(N, hb, max_seq_len, props.multi_processor_count if props else 132)
        num_splits, block_n, num_warps, num_stages = (
            c if v is None else v for v, c in zip((num_splits, block_n, num_warps, num_stages), cfg)
        )
    if num_splits < 1 or block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"mla decode: num_splits={num_splits} must be >= 1, block_n={block_n} a power of two >= 16")
    out = torch.empty(N, H, kv_lora, dtype=torch.float32, device=q_lat.device)
    if N == 0:
        return out
    q_lat = q_lat if q_lat.stride(-1) == 1 else q_lat.contiguous()
    single = num_splits == 1
    acc = out if single else torch.empty(N, H, num_splits, kv_lora, dtype=torch.float32, device=q_lat.device)
    ml = out if single else torch.empty(N, H, num_splits, 2, dtype=torch.float32, device=q_lat.device)
    _mla_split_kernel[(N, hb, num_splits)](
        q_lat, latent_pool, block_table, seq_lens, acc, ml, out, scale, H,
        q_lat.stride(0), q_lat.stride(1), latent_pool.stride(0), latent_pool.stride(1),
        block_table.stride(0), num_splits,
        PAGE=page, DC=kv_lora, DR=DR, BH=BH, BN=block_n,
        PREC="ieee" if latent_pool.dtype == torch.float32 else "tf32", SINGLE=single,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    if single:
        return out
    _mla_merge_kernel[(N * H,)](
        acc, ml, out, num_splits, DC=kv_lora, BS=max(2, triton.next_power_of_2(num_splits)), num_warps=4
    )
    return out


__all__ = ["TUNED", "default_num_splits", "mla_decode_absorbed_paged_triton", "mla_decode_config"]
