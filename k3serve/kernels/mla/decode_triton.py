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
):
    i_n, i_hb, i_s = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)
    L = tl.load(lens + i_n).to(tl.int64)
    per = tl.cdiv(tl.cdiv(L, NS), BN) * BN
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
    for t in range(start, end, BN):
        pos = t + o_t
        m_t = pos < end
        page = tl.load(bt + i_n * s_btn + pos // PAGE, mask=m_t, other=0).to(tl.int64)
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
    base = (i_n * H + o_h) * NS + i_s  # [BH]
    tl.store(acc_out + base[:, None] * DC + o_c[None, :], b_acc, mask=m_h[:, None])
    tl.store(ml_out + base * 2, b_m, mask=m_h)
    tl.store(ml_out + base * 2 + 1, b_l, mask=m_h)


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
    """Context splits per sequence (flash-decoding).

    At least 4 programs per SM; more (up to 16 per SM) while a split would exceed 1024 tokens.
    From the H200 sweep (``benchmarks/RESULTS_gpu_kernels.md``): 64 seqs × 32k latents run 1.22×
    faster at 33 splits than at 9; 256 seqs are best at 3–5 splits.
    """
    progs = max(1, num_seqs * head_blocks)
    want = triton.cdiv(4 * num_sms, progs)
    cap = triton.cdiv(16 * num_sms, progs)
    return int(max(1, min(max(want, triton.cdiv(max_len, 1024)), cap, 64, triton.cdiv(max_len, 64))))


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
    block_n: int = 32,
    num_warps: int = 4,
    num_stages: int = 2,
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
        num_splits (int, optional): context splits; default from :func:`default_num_splits`.
        max_seq_len (int, optional): longest ``seq_lens`` (avoids a host sync when splits are
            chosen automatically).
        block_n, num_warps, num_stages: tuning knobs (tokens per step, launch config).

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
    if num_splits is None:
        if max_seq_len is None:
            max_seq_len = int(seq_lens.max()) if N else 1
        props = torch.cuda.get_device_properties(q_lat.device) if q_lat.is_cuda else None
        num_splits = default_num_splits(N, hb, max_seq_len, props.multi_processor_count if props else 132)
    out = torch.empty(N, H, kv_lora, dtype=torch.float32, device=q_lat.device)
    if N == 0:
        return out
    q_lat = q_lat if q_lat.stride(-1) == 1 else q_lat.contiguous()
    acc = torch.empty(N, H, num_splits, kv_lora, dtype=torch.float32, device=q_lat.device)
    ml = torch.empty(N, H, num_splits, 2, dtype=torch.float32, device=q_lat.device)
    _mla_split_kernel[(N, hb, num_splits)](
        q_lat, latent_pool, block_table, seq_lens, acc, ml, scale, H,
        q_lat.stride(0), q_lat.stride(1), latent_pool.stride(0), latent_pool.stride(1),
        block_table.stride(0), num_splits,
        PAGE=page, DC=kv_lora, DR=DR, BH=BH, BN=block_n,
        PREC="ieee" if latent_pool.dtype == torch.float32 else "tf32",
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    _mla_merge_kernel[(N * H,)](
        acc, ml, out, num_splits, DC=kv_lora, BS=max(2, triton.next_power_of_2(num_splits)), num_warps=4
    )
    return out


__all__ = ["default_num_splits", "mla_decode_absorbed_paged_triton"]
