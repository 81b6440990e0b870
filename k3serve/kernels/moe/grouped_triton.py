"""Routed experts in Triton: two grouped-GEMM launches over expert-aligned row blocks, with the
GLU fused into the first and the routing weight into the second; bf16 or MXFP4 expert weights.

Block alignment (vLLM ``moe_align_block_size``, here in plain torch ops with static shapes)::

    sorted positions  | e0 e0 e0 | e1 | e3 e3 e3 e3 e3 |          (T·k assignments by expert)
    padded layout     | e0 e0 e0 ·· | e1 ·· ·· ·· | e3 e3 e3 e3 | e3 ·· ·· ·· | (unused blocks)
                      '--block 0---''--block 1---''--block 2---''--block 3---'
    slot_assign[p]  = assignment index t·k + j at padded position p, or T·k for padding
    block_expert[b] = expert of block b, or E for a block past the last expert's run

Each expert's run is padded up to a multiple of ``BM`` so a block of ``BM`` rows belongs to one
expert; ``P = ⌈(T·k + min(E, T·k)·(BM − 1)) / BM⌉ · BM`` bounds the padded length for ANY
routing, so the grids are static and nothing is read back to the host (CUDA-graph safe).
Blocks with ``block_expert = E`` return at once.

Kernel 1 (gate/up + GLU): program (block b, column tile n) loads the ``BM`` token rows of ``z``
named by ``slot_assign // k`` (the gather is folded into the load), multiplies them by expert
``e``'s gate and up tiles and writes ``h[p] = act(g, u)`` (``[P, I]`` in the compute dtype).
Kernel 2 (down): ``y[slot_assign[p]] = w[slot_assign[p]] · (h[p] W2_eᵀ)`` in float32
(``[T·k, W]``); the host side sums the ``k`` slots of each token (deterministic, no atomics).

MXFP4 (``k3serve/kernels/mxfp4.py`` layout, OCP MX v1.0 §5): weight tiles are loaded as packed
bytes ``[BN, BK/2]`` + E8M0 scales ``[BN, BK/32]`` and dequantised in registers to bf16 (exact:
a 2-bit significand times a power of two) before ``tl.dot`` — Hopper has no FP4 MMA. Scale
bytes decode as ``exp2(s − 127)``: scale 0 (2⁻¹²⁷, a float32 subnormal) may flush to 0 and the
NaN byte 0xFF decodes to +inf rather than NaN; neither occurs in a finite, non-zero weight
block. The reference is ``k3serve.kernels.moe.naive.routed_experts_loop`` on the dequantised
weights.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from k3serve.kernels.moe.grouped import sort_by_expert

MX_SPLIT = False
"""Default MXFP4 tile form (see ``routed_experts_triton``'s ``mx_split``), set from
``docs/results/gpu_moe.md``."""

ALIGN_TRITON_MAX = 4096
"""Up to this many assignments ``T·k`` (decode batches), :func:`align_blocks` runs as one Triton
launch (``route_triton.align_blocks_triton``, same layout) where ``dispatch.fused_decode``
allows; above it (prefill) the torch sort."""

ACTS = {"situ": 0, "silu": 1}
"""GLU codes of the fused epilogue: ``situ`` (K3 SiTU-GLU) and ``silu`` (SwiGLU)."""


class BlockLayout(NamedTuple):
    """Expert-aligned padded layout (see the module diagram).

    Fields:
        slot_assign: ``[P]`` int32 assignment index per padded position (``T·k`` = padding).
        block_expert: ``[P / BM]`` int32 expert per block (``E`` = unused block).
        block_m: ``BM``.
    """

    slot_assign: torch.Tensor
    block_expert: torch.Tensor
    block_m: int


def align_blocks(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> BlockLayout:
    """Pad each expert's run of sorted assignments to a multiple of ``block_m`` (no host sync).

    Args:
        topk_ids: ``[T, k]`` integer expert ids in ``[0, E)``.
        num_experts: ``E``.
        block_m: rows per block ``BM`` (≥ 16 for ``tl.dot``).

    Returns:
        :class:`BlockLayout` with static shapes ``P = ⌈(T·k + min(E, T·k)(BM−1)) / BM⌉·BM``.
    """
    m = topk_ids.numel()
    if m <= ALIGN_TRITON_MAX and m > 0:
        from k3serve.kernels.backend import fused_decode

        if fused_decode(topk_ids.device):
            from k3serve.kernels.moe.route_triton import align_blocks_triton

            p_len = triton.cdiv(m + min(num_experts, m) * (block_m - 1), block_m) * block_m
            return BlockLayout(*align_blocks_triton(topk_ids, num_experts, block_m, p_len), block_m)
    s = sort_by_expert(topk_ids, num_experts)
    dev = topk_ids.device
    ends = s.ends.long()
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    padded = (counts + block_m - 1) // block_m * block_m
    pad_ends = torch.cumsum(padded, 0)
    starts = ends - counts
    pos = torch.arange(m, device=dev)
    e_of = s.sorted_ids
    dest = (pad_ends - padded)[e_of] + pos - starts[e_of]
    p_len = triton.cdiv(m + min(num_experts, m) * (block_m - 1), block_m) * block_m
    slot = torch.full((p_len,), m, dtype=torch.int32, device=dev)
    slot.index_copy_(0, dest, s.order.to(torch.int32))
    block_start = torch.arange(0, p_len, block_m, device=dev)
    block_expert = torch.searchsorted(pad_ends, block_start, right=True, out_int32=True)
    return BlockLayout(slot, block_expert, block_m)


@triton.jit
def _tanh(x):
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def _e2m1(c):
    """e2m1 codes (int32, low 4 bits) → float32 values × 2⁻¹⁴, by placing sign, the two exponent
    bits and the mantissa bit into an fp16 (bits 15, 11–10, 9): the e2m1 subnormal (E = 0) lands
    on the fp16 subnormal, so every code converts exactly (0.5 → 2⁻¹⁵) with no table or select.
    """
    bits = ((c & 8) << 12) | ((c & 7) << 9)
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _scales(s_ptr, e, offs_n, mask_n, k0, s_se, s_sn, BN: tl.constexpr, BK: tl.constexpr,
            REP: tl.constexpr):  # fmt: skip
    """E8M0 bytes of the tile as ``2^(s − 127) · 2¹⁴`` (undoing :func:`_e2m1`'s 2⁻¹⁴), each
    repeated ``REP`` times along K: ``[BN, BK / 32 · REP]``."""
    offs_s = k0 // 32 + tl.arange(0, BK // 32)
    sc = tl.load(
        s_ptr + e * s_se + offs_n[:, None] * s_sn + offs_s[None, :], mask=mask_n[:, None], other=0
    ).to(tl.float32)
    sc = tl.exp2(sc - 113.0)
    return tl.reshape(tl.broadcast_to(sc[:, :, None], (BN, BK // 32, REP)), (BN, BK // 32 * REP))


@triton.jit
def _load_wt(
    w_ptr, s_ptr, e, offs_n, mask_n, k0, s_we, s_wn, s_se, s_sn,
    BN: tl.constexpr, BK: tl.constexpr, MX: tl.constexpr, DT: tl.constexpr,
):  # fmt: skip
    """Weight tile ``[BK, BN]`` (transposed) of expert ``e``, rows ``offs_n``, cols ``k0 + [0, BK)``;
    ``MX = 1``: dequantised from MXFP4 (nibbles interleaved back into K order)."""
    if MX == 1:
        offs_b = k0 // 2 + tl.arange(0, BK // 2)
        pk = tl.load(
            w_ptr + e * s_we + offs_n[:, None] * s_wn + offs_b[None, :],
            mask=mask_n[:, None],
            other=0,
        ).to(tl.int32)
        val = _e2m1(tl.reshape(tl.join(pk & 15, pk >> 4), (BN, BK)))
        w = (val * _scales(s_ptr, e, offs_n, mask_n, k0, s_se, s_sn, BN, BK, 32)).to(DT)
    else:
        offs_k = k0 + tl.arange(0, BK)
        w = tl.load(
            w_ptr + e * s_we + offs_n[:, None] * s_wn + offs_k[None, :],
            mask=mask_n[:, None],
            other=0.0,
        ).to(DT)
    return tl.trans(w)


@triton.jit
def _load_wt_split(
    w_ptr, s_ptr, e, offs_n, mask_n, k0, s_we, s_wn, s_se, s_sn,
    BN: tl.constexpr, BK: tl.constexpr, DT: tl.constexpr,
):  # fmt: skip
    """MXFP4 tile as two ``[BK/2, BN]`` halves: elements ``k0 + 2j`` (low nibbles) and
    ``k0 + 2j + 1`` (high nibbles). The caller multiplies them by the even and odd columns of
    its input (a K permutation leaves the dot product unchanged), so no interleave is needed."""
    offs_b = k0 // 2 + tl.arange(0, BK // 2)
    pk = tl.load(
        w_ptr + e * s_we + offs_n[:, None] * s_wn + offs_b[None, :], mask=mask_n[:, None], other=0
    ).to(tl.int32)
    sc = _scales(s_ptr, e, offs_n, mask_n, k0, s_se, s_sn, BN, BK, 16)
    lo = (_e2m1(pk & 15) * sc).to(DT)
    hi = (_e2m1(pk >> 4) * sc).to(DT)
    return tl.trans(lo), tl.trans(hi)


@triton.jit
def _gate_up_kernel(
    z, w, ws, slot, bexp, h,
    M, E, N, K, TOPK,
    s_zt, s_we, s_wn, s_se, s_sn, s_hp,
    beta, beta_l,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    MX: tl.constexpr, ACT: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    pid_b = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(bexp + pid_b).to(tl.int64)
    if e >= E:
        return
    offs_p = pid_b * BM + tl.arange(0, BM)
    a_idx = tl.load(slot + offs_p)
    m_row = a_idx < M
    tok = (a_idx // TOPK).to(tl.int64)
    offs_n = pid_n * BN + tl.arange(0, BN)
    m_n = offs_n < N
    DT = h.dtype.element_ty
    acc_g = tl.zeros((BM, BN), dtype=tl.float32)
    acc_u = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        if MX == 2:
            offs_k = k0 + 2 * tl.arange(0, BK // 2)
            p_a = z + tok[:, None] * s_zt + offs_k[None, :]
            a_e = tl.load(p_a, mask=m_row[:, None], other=0.0).to(DT)
            a_o = tl.load(p_a + 1, mask=m_row[:, None], other=0.0).to(DT)
            g_lo, g_hi = _load_wt_split(w, ws, e, offs_n, m_n, k0, s_we, s_wn, s_se, s_sn,
                                        BN, BK, DT)  # fmt: skip
            u_lo, u_hi = _load_wt_split(w, ws, e, offs_n + N, m_n, k0, s_we, s_wn, s_se, s_sn,
                                        BN, BK, DT)  # fmt: skip
            acc_g = tl.dot(a_e, g_lo, acc_g, input_precision=PREC)
            acc_g = tl.dot(a_o, g_hi, acc_g, input_precision=PREC)
            acc_u = tl.dot(a_e, u_lo, acc_u, input_precision=PREC)
            acc_u = tl.dot(a_o, u_hi, acc_u, input_precision=PREC)
        else:
            offs_k = k0 + tl.arange(0, BK)
            a = tl.load(z + tok[:, None] * s_zt + offs_k[None, :], mask=m_row[:, None], other=0.0)
            a = a.to(DT)
            wg = _load_wt(w, ws, e, offs_n, m_n, k0, s_we, s_wn, s_se, s_sn, BN, BK, MX, DT)
            wu = _load_wt(w, ws, e, offs_n + N, m_n, k0, s_we, s_wn, s_se, s_sn, BN, BK, MX, DT)
            acc_g = tl.dot(a, wg, acc_g, input_precision=PREC)
            acc_u = tl.dot(a, wu, acc_u, input_precision=PREC)
    if ACT == 0:
        out = beta * _tanh(acc_g / beta) * tl.sigmoid(acc_g) * (beta_l * _tanh(acc_u / beta_l))
    else:
        out = acc_g * tl.sigmoid(acc_g) * acc_u
    tl.store(
        h + offs_p.to(tl.int64)[:, None] * s_hp + offs_n[None, :],
        out.to(DT),
        mask=m_row[:, None] & m_n[None, :],
    )


@triton.jit
def _down_kernel(
    h, w, ws, slot, bexp, tw, y,
    M, E, N, K,
    s_hp, s_we, s_wn, s_se, s_sn, s_ym,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    MX: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    pid_b = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(bexp + pid_b).to(tl.int64)
    if e >= E:
        return
    offs_p = pid_b * BM + tl.arange(0, BM)
    a_idx = tl.load(slot + offs_p)
    m_row = a_idx < M
    offs_n = pid_n * BN + tl.arange(0, BN)
    m_n = offs_n < N
    DT = h.dtype.element_ty
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    p_h = h + offs_p.to(tl.int64)[:, None] * s_hp
    for k0 in range(0, K, BK):
        if MX == 2:
            offs_k = k0 + 2 * tl.arange(0, BK // 2)
            a_e = tl.load(p_h + offs_k[None, :], mask=m_row[:, None], other=0.0)
            a_o = tl.load(p_h + offs_k[None, :] + 1, mask=m_row[:, None], other=0.0)
            w_lo, w_hi = _load_wt_split(w, ws, e, offs_n, m_n, k0, s_we, s_wn, s_se, s_sn,
                                        BN, BK, DT)  # fmt: skip
            acc = tl.dot(a_e, w_lo, acc, input_precision=PREC)
            acc = tl.dot(a_o, w_hi, acc, input_precision=PREC)
        else:
            offs_k = k0 + tl.arange(0, BK)
            a = tl.load(p_h + offs_k[None, :], mask=m_row[:, None], other=0.0)
            wt = _load_wt(w, ws, e, offs_n, m_n, k0, s_we, s_wn, s_se, s_sn, BN, BK, MX, DT)
            acc = tl.dot(a, wt, acc, input_precision=PREC)
    rw = tl.load(tw + a_idx, mask=m_row, other=0.0).to(tl.float32)
    tl.store(
        y + a_idx.to(tl.int64)[:, None] * s_ym + offs_n[None, :],
        acc * rw[:, None],
        mask=m_row[:, None] & m_n[None, :],
    )


def _pick_bk(k: int) -> int:
    for bk in (256, 128, 64, 32):
        if k % bk == 0:
            return bk
    raise ValueError(f"expert width {k}: must be a multiple of 32")


class Tiles(NamedTuple):
    """Launch shape of the two grouped-GEMM kernels: ``BM`` rows per block (the layout's
    padding unit), ``BN`` output columns per program, ``BK`` cap of the reduction step (the
    largest power of two ≤ it dividing the width is used), warps, pipeline stages, and for
    MXFP4 the tile form (``split``, see :func:`routed_experts_triton`'s ``mx_split``; None: the
    module's :data:`MX_SPLIT`)."""

    bm: int
    bn: int
    bk: int
    warps: int
    stages: int
    split: bool | None = None


TILE_TABLE: dict[tuple[bool, int], Tiles] = {
    (True, 1): Tiles(16, 32, 256, 4, 3),  # k3-mini T=1 (8 of 64 experts): 23.5 vs 23.9/24.2 µs
    (True, 8): Tiles(16, 64, 128, 4, 4),  # k3-mini T=64: 99.1 vs 103.0/102.8 µs
}
"""Measured per-shape tiles: ``(MXFP4?, upper bound of the mean rows per expert) → Tiles``;
:func:`_config` takes the entry with the smallest bound ≥ the batch's mean rows per expert,
else its heuristic. From the device sweep ``benchmarks/gpu_moe_tiles.py`` (one H200, one
k3-mini MoE layer's routed experts, the heuristic timed twice): an entry only where a candidate beat the heuristic by more than that spread —
at T=256 (32 rows per expert) and for bf16 experts the heuristic stayed the fastest."""


def _config(m: int, num_experts: int, mx: bool = False) -> Tiles:
    """Tiles for ``m`` assignments over ``num_experts``: :data:`TILE_TABLE` where it has an
    entry for this format and size, else from the mean rows per expert — decode gets small row
    blocks and narrow column tiles (more programs streaming the weights); shared memory per
    stage (``BM·BK + 2·BN·BK`` elements in the gate/up kernel) stays under ~80 KB."""
    per_expert = m / max(num_experts, 1)
    fits = [b for (f, b) in TILE_TABLE if f == mx and per_expert <= b]
    if fits:
        return TILE_TABLE[(mx, min(fits))]
    if per_expert <= 16:
        return Tiles(16, 32, 128, 4, 4)
    if per_expert <= 64:
        return Tiles(32, 64, 128, 4, 3)
    if per_expert <= 256:
        return Tiles(64, 128, 64, 4, 3)
    return Tiles(128, 128, 64, 8, 3)


class TritonExperts(NamedTuple):
    """Expert weights in the layout the kernels read.

    Fields:
        w13: ``[E, 2I, W]`` bf16/fp16/fp32, or MXFP4 packed ``uint8 [E, 2I, W/2]``.
        w2: ``[E, W, I]``, or packed ``uint8 [E, W, I/2]``.
        s13: ``None`` or E8M0 scales ``uint8 [E, 2I, W/32]``.
        s2: ``None`` or ``uint8 [E, W, I/32]``.
    """

    w13: torch.Tensor
    w2: torch.Tensor
    s13: torch.Tensor | None = None
    s2: torch.Tensor | None = None


def routed_experts_triton(
    z: torch.Tensor,
    experts: TritonExperts,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    act: str,
    beta: float = 4.0,
    beta_l: float = 25.0,
    mx_split: bool | None = None,
    tiles: Tiles | None = None,
) -> torch.Tensor:
    """Weighted expert sum ``Σ_j w[t, j] E_{ids[t, j]}(z[t])`` in two Triton launches.

    Args:
        z: ``[T, W]`` bf16/fp16/fp32 expert inputs (the GEMMs run in ``z.dtype``, fp32 accumulate).
        experts: :class:`TritonExperts` (dense in ``z.dtype``, or MXFP4 packed + scales).
        topk_ids: ``[T, k]`` int64 expert ids in ``[0, E)``, each at most once per token.
        topk_weights: ``[T, k]`` float32.
        act: ``"situ"`` or ``"silu"``.
        beta, beta_l: SiTU-GLU bounds (``cfg.situ_beta``, ``cfg.situ_beta_linear``).
        mx_split: MXFP4 only: multiply low / high nibbles by the even / odd input columns
            (two half-K dots, no register interleave) instead of re-interleaving the tile;
            None: the module's :data:`MX_SPLIT`.
        tiles: launch shape (:class:`Tiles`); None: :func:`_config`'s choice for this size.

    Returns:
        ``[T, W]`` float32.

    Raises:
        ValueError: unknown ``act``, or shapes that do not pair up.
    """
    if act not in ACTS:
        raise ValueError(f"act: {act!r} is not one of {sorted(ACTS)}")
    mx = experts.s13 is not None
    t, width = z.shape
    topk = topk_ids.shape[1]
    num_e = experts.w13.shape[0]
    inter = experts.w2.shape[-1] * (2 if mx else 1)
    if experts.w13.shape[1] != 2 * inter or experts.w13.shape[2] * (2 if mx else 1) != width:
        raise ValueError(
            f"experts.w13: {tuple(experts.w13.shape)} does not match z [T, {width}] and w2 "
            f"{tuple(experts.w2.shape)}"
        )
    if mx and (experts.s2 is None or experts.w13.dtype != torch.uint8):
        raise ValueError("experts: MXFP4 needs uint8 w13/w2 and both scale tensors")
    if z.stride(-1) != 1:  # row-strided z (a column slice of a fused GEMM) is read in place
        z = z.contiguous()
    m = t * topk
    if m == 0:
        return torch.zeros(t, width, dtype=torch.float32, device=z.device)
    tl_ = tiles if tiles is not None else _config(m, num_e, mx)
    bm, bn, bk_cap, warps, stages = tl_.bm, tl_.bn, tl_.bk, tl_.warps, tl_.stages
    if mx_split is None:
        mx_split = MX_SPLIT if tl_.split is None else tl_.split
    mx_mode = 0 if not mx else 2 if mx_split else 1
    lay = align_blocks(topk_ids, num_e, bm)
    p_len = lay.slot_assign.numel()
    h = torch.empty(p_len, inter, dtype=z.dtype, device=z.device)
    y = torch.empty(m, width, dtype=torch.float32, device=z.device)
    prec = "ieee" if z.dtype == torch.float32 else "tf32"
    w13, w2 = experts.w13, experts.w2
    s13 = experts.s13 if mx else w13
    s2 = experts.s2 if mx else w2
    sse13, ssn13 = (s13.stride(0), s13.stride(1)) if mx else (0, 0)
    sse2, ssn2 = (s2.stride(0), s2.stride(1)) if mx else (0, 0)
    nblk = p_len // bm
    _gate_up_kernel[(nblk, triton.cdiv(inter, bn))](
        z, w13, s13, lay.slot_assign, lay.block_expert, h,
        m, num_e, inter, width, topk,
        z.stride(0), w13.stride(0), w13.stride(1), sse13, ssn13, h.stride(0),
        float(beta), float(beta_l),
        BM=bm, BN=bn, BK=min(bk_cap, _pick_bk(width)), MX=mx_mode, ACT=ACTS[act], PREC=prec,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    tw = topk_weights.reshape(-1).float().contiguous()
    _down_kernel[(nblk, triton.cdiv(width, bn))](
        h, w2, s2, lay.slot_assign, lay.block_expert, tw, y,
        m, num_e, width, inter,
        h.stride(0), w2.stride(0), w2.stride(1), sse2, ssn2, y.stride(0),
        BM=bm, BN=bn, BK=min(bk_cap, _pick_bk(inter)), MX=mx_mode, PREC=prec,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return y.view(t, topk, width).sum(1)


LARGE_M_ROWS_PER_EXPERT = 64
"""Mean rows per expert (``T·k / E``) from which :func:`routed_experts_large_m` takes over
(k3-mini: 4,096 assignments, 512 tokens — a prefill chunk; its decode batches, ≤ 256 sequences
in the CUDA-graph buckets, stay below; k3: 3,584 tokens). Device sweep
(``benchmarks/gpu_prefill_profile.py``, one H200, one k3-mini MoE layer): 512 / 2,048 /
8,192 tokens took 0.650 / 0.647 / 1.548 ms in the MXFP4 two-launch kernels and 0.409 / 0.610 /
0.843 ms here."""


@triton.jit
def _glu_rows_kernel(gu, h, M, N, s_g, s_h, beta, beta_l,
                     ACT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):  # fmt: skip
    """``h[p] = act(gu[p, :N], gu[p, N:])`` row by row (no split copies of ``gu``)."""
    offs_m = tl.program_id(0) * BM + tl.arange(0, BM)
    offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
    m = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    row = offs_m.to(tl.int64)[:, None] * s_g + offs_n[None, :]
    g = tl.load(gu + row, mask=m, other=0.0).to(tl.float32)
    u = tl.load(gu + row + N, mask=m, other=0.0).to(tl.float32)
    if ACT == 0:
        out = beta * _tanh(g / beta) * tl.sigmoid(g) * (beta_l * _tanh(u / beta_l))
    else:
        out = g * tl.sigmoid(g) * u
    tl.store(h + offs_m.to(tl.int64)[:, None] * s_h + offs_n[None, :], out.to(h.dtype.element_ty),
             mask=m)  # fmt: skip


@triton.jit
def _combine_kernel(ys, pos, tw, out, T, W, s_y, s_o,
                    TOPK: tl.constexpr, BT: tl.constexpr, BW: tl.constexpr):  # fmt: skip
    """``out[t] = Σ_j tw[t·k + j] · ys[pos[t·k + j]]`` in float32 (fixed order, no atomics)."""
    offs_t = tl.program_id(0) * BT + tl.arange(0, BT)
    offs_w = tl.program_id(1) * BW + tl.arange(0, BW)
    m_t = offs_t < T
    m = m_t[:, None] & (offs_w < W)[None, :]
    acc = tl.zeros((BT, BW), dtype=tl.float32)
    for j in tl.static_range(TOPK):
        a = offs_t.to(tl.int64) * TOPK + j
        p = tl.load(pos + a, mask=m_t, other=0).to(tl.int64)
        wt = tl.load(tw + a, mask=m_t, other=0.0).to(tl.float32)
        v = tl.load(ys + p[:, None] * s_y + offs_w[None, :], mask=m, other=0.0).to(tl.float32)
        acc += wt[:, None] * v
    tl.store(out + offs_t.to(tl.int64)[:, None] * s_o + offs_w[None, :], acc, mask=m)


def routed_experts_large_m(
    z: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    act: str,
    beta: float = 4.0,
    beta_l: float = 25.0,
) -> torch.Tensor:
    """Weighted expert sum for prefill-sized batches: ``torch._grouped_mm`` (CUTLASS grouped
    GEMM on sm90) on the dense expert weights, the GLU and the weighted un-sort in Triton.

    At thousands of rows per expert the weights are read once per layer whatever their format,
    so their storage saves nothing and the in-loop MXFP4 decode of :func:`routed_experts_triton`
    only costs issue slots; the dense weights the model holds are the dequantised MXFP4 bytes
    (``k3serve.model.checkpoint``), so this is the same function. Contract of
    :func:`routed_experts_triton` except that ``w13 [E, 2I, W]`` / ``w2 [E, W, I]`` are dense in
    ``z.dtype``. The expert outputs are rounded to ``z.dtype`` once before the float32 weighted
    sum (the two-launch kernel keeps them in float32).

    Raises:
        ValueError: unknown ``act``, or weights not dense in ``z.dtype``.
    """
    if act not in ACTS:
        raise ValueError(f"act: {act!r} is not one of {sorted(ACTS)}")
    if w13.dtype != z.dtype or w2.dtype != z.dtype:
        raise ValueError(f"w13/w2: dense {z.dtype} weights needed, got {w13.dtype}/{w2.dtype}")
    t, topk = topk_ids.shape
    num_e, two_i, width = w13.shape
    inter = two_i // 2
    m = t * topk
    if m == 0:
        return torch.zeros(t, width, dtype=torch.float32, device=z.device)
    s = sort_by_expert(topk_ids, num_e)
    a = z.index_select(0, s.order // topk)
    gu = torch._grouped_mm(a, w13.transpose(1, 2), offs=s.ends)  # [M, 2I]
    h = torch.empty(m, inter, dtype=z.dtype, device=z.device)
    _glu_rows_kernel[(triton.cdiv(m, 32), triton.cdiv(inter, 128))](
        gu, h, m, inter, gu.stride(0), h.stride(0), float(beta), float(beta_l),
        ACT=ACTS[act], BM=32, BN=128, num_warps=4,
    )  # fmt: skip
    ys = torch._grouped_mm(h, w2.transpose(1, 2), offs=s.ends)  # [M, W] sorted by expert
    pos = torch.empty_like(s.order).scatter_(
        0, s.order, torch.arange(m, device=z.device, dtype=s.order.dtype)
    )  # assignment t·k + j → its sorted row
    out = torch.empty(t, width, dtype=torch.float32, device=z.device)
    tw = topk_weights.reshape(-1).float().contiguous()
    _combine_kernel[(triton.cdiv(t, 16), triton.cdiv(width, 256))](
        ys, pos, tw, out, t, width, ys.stride(0), out.stride(0),
        TOPK=topk, BT=16, BW=256, num_warps=4,
    )  # fmt: skip
    return out


__all__ = ["ACTS", "LARGE_M_ROWS_PER_EXPERT", "TILE_TABLE", "BlockLayout", "Tiles",
           "TritonExperts", "align_blocks", "routed_experts_large_m", "routed_experts_triton"]  # fmt: skip
