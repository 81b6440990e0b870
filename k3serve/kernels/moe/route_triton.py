"""MoE routing for decode-sized batches in Triton: the router (GEMM, sigmoid, biased top-k,
normalisation, load counters) in two launches, and the expert-aligned block layout in one more.

References (plain torch, the spec): ``k3serve.model.moe.Router.forward`` plus the
``expert_load`` update of ``MoE.forward`` for :func:`route_topk_triton` (sigmoid top-k with a
frozen correction bias, DeepSeek-V3 §2.1.2); :func:`k3serve.kernels.moe.grouped_triton.align_blocks`
(the sort + pad of vLLM's ``moe_align_block_size``, torch ops) for :func:`align_blocks_triton`,
which produces the same layout bit for bit: within an expert's run, assignments keep their
index order, as the stable sort does.

Both kernels have static grids and read nothing back to the host (CUDA-graph safe). They replace
~30 small launches per MoE layer (a decode step is launch-bound, ``docs/results/gpu_e2e.md``).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


@triton.jit
def _route_logits_kernel(x, w, part, T, E, D, s_x, s_w, KCH,
                         BT: tl.constexpr, BE: tl.constexpr, BK: tl.constexpr,
                         LOWP: tl.constexpr):  # fmt: skip
    """Partial router logits of one token block over one K slice: ``part[ks] = x[:, slice] ·
    W[:, slice]ᵀ`` (the slices are summed in order by ``_route_kernel``: deterministic)."""
    pid = tl.program_id(0)
    ks = tl.program_id(1)
    rows = pid * BT + tl.arange(0, BT)
    m_t = rows < T
    cols = tl.arange(0, BE)
    m_e = cols < E
    acc = tl.zeros((BT, BE), dtype=tl.float32)
    for k0 in range(ks * KCH, ks * KCH + KCH, BK):
        offs_k = k0 + tl.arange(0, BK)
        m_k = offs_k < D
        a = tl.load(x + rows.to(tl.int64)[:, None] * s_x + offs_k[None, :],
                    mask=m_t[:, None] & m_k[None, :], other=0.0)  # fmt: skip
        b = tl.load(w + cols.to(tl.int64)[None, :] * s_w + offs_k[:, None],
                    mask=m_e[None, :] & m_k[:, None], other=0.0)  # fmt: skip
        if LOWP:  # bf16 × bf16 products are exact in the fp32 accumulator (tensor cores)
            acc = tl.dot(a, b, acc)
        else:
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    off = (ks * T + rows.to(tl.int64))[:, None] * BE + cols[None, :]
    tl.store(part + off, acc, mask=m_t[:, None])


@triton.jit
def _route_kernel(
    part, bias, ids, tw, load, T, E, KS, scale,
    TOPK: tl.constexpr, KP: tl.constexpr, NORM: tl.constexpr, COUNT: tl.constexpr,
    BT: tl.constexpr, BE: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    rows = pid * BT + tl.arange(0, BT)
    m_t = rows < T
    cols = tl.arange(0, BE)
    m_e = cols < E
    acc = tl.zeros((BT, BE), dtype=tl.float32)
    for ks in range(KS):
        off = (ks * T + rows.to(tl.int64))[:, None] * BE + cols[None, :]
        acc += tl.load(part + off, mask=m_t[:, None], other=0.0)
    scores = tl.sigmoid(acc)
    sel = scores + tl.load(bias + cols, mask=m_e, other=0.0).to(tl.float32)[None, :]
    sel = tl.where(m_e[None, :], sel, float("-inf"))
    kcol = tl.arange(0, KP)
    w_sel = tl.zeros((BT, KP), dtype=tl.float32)
    i_sel = tl.zeros((BT, KP), dtype=tl.int32)
    for j in tl.static_range(TOPK):
        best = tl.argmax(sel, 1)  # [BT]
        hit = cols[None, :] == best[:, None]
        sj = tl.sum(tl.where(hit, scores, 0.0), 1)
        w_sel = tl.where(kcol[None, :] == j, sj[:, None], w_sel)
        i_sel = tl.where(kcol[None, :] == j, best[:, None], i_sel)
        sel = tl.where(hit, float("-inf"), sel)
    if NORM:
        w_sel = w_sel / (tl.sum(w_sel, 1)[:, None] + 1e-20)
    w_sel = w_sel * scale
    m_out = m_t[:, None] & (kcol[None, :] < TOPK)
    off = rows.to(tl.int64)[:, None] * TOPK + kcol[None, :]
    tl.store(ids + off, i_sel.to(tl.int64), mask=m_out)
    tl.store(tw + off, w_sel, mask=m_out)
    if COUNT:
        tl.atomic_add(load + i_sel, tl.full((BT, KP), 1, tl.int64), mask=m_out)


def route_topk_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    top_k: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
    expert_load: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sigmoid top-k routing in two launches (``Router.forward`` contract): the router GEMM split
    over K into per-slice partial logits, then one kernel summing them in order (deterministic),
    σ, biased top-k, normalisation, and the routed-token counts per expert into ``expert_load``
    (what ``MoE.forward`` adds).

    ``s = σ(x Wᵀ)`` in float32 (bf16/fp16 operands of one dtype: their products are exact, summed
    in a float32 accumulator; otherwise an IEEE float32 dot), experts =
    the ``top_k`` largest ``s + bias`` in descending order, weights ``s_e`` (divided by their
    sum + 1e-20 when ``norm_topk_prob``) × ``routed_scaling_factor``.

    Args:
        x: ``[T, d]`` any float dtype; weight: ``[E, d]`` router; bias: ``[E]`` correction bias.
        top_k: experts per token (≤ E); norm_topk_prob, routed_scaling_factor: as the config.
        expert_load: ``[E]`` int64 counters incremented in place (atomics), or None.

    Returns:
        ``(weights [T, top_k] float32, ids [T, top_k] int64)``.

    Raises:
        ValueError: shapes that do not pair up, or ``top_k`` out of ``[1, E]``.
    """
    t, d = x.shape
    e = weight.shape[0]
    if weight.shape != (e, d) or bias.shape != (e,) or not 1 <= top_k <= e:
        raise ValueError(f"weight [E, {d}], bias [E], 1 ≤ top_k ≤ E: got weight "
                         f"{tuple(weight.shape)}, bias {tuple(bias.shape)}, top_k {top_k}")  # fmt: skip
    if expert_load is not None and (expert_load.shape != (e,) or expert_load.dtype != torch.int64):
        raise ValueError(f"expert_load: want int64 [{e}], got {expert_load.dtype} "
                         f"{tuple(expert_load.shape)}")  # fmt: skip
    ids = torch.empty(t, top_k, dtype=torch.int64, device=x.device)
    tw = torch.empty(t, top_k, dtype=torch.float32, device=x.device)
    if t == 0:
        return tw, ids
    if x.stride(-1) != 1:
        x = x.contiguous()
    weight = weight.contiguous()
    bt = 16
    be = max(16, triton.next_power_of_2(e))
    # (the interpreter's bf16 dot is broken: CPU tests take the float32 dot)
    lowp = (x.dtype == weight.dtype and x.dtype in (torch.bfloat16, torch.float16)
            and os.environ.get("TRITON_INTERPRET") != "1")  # fmt: skip
    bk = (128 if lowp else 64) if be <= 64 else 32
    # K split so the router weight streams through many SMs (one program reading all of it
    # took 13.5 µs per layer on an H200)
    ks = max(1, min(16, d // bk))
    kch = triton.cdiv(triton.cdiv(d, ks), bk) * bk
    ks = triton.cdiv(d, kch)
    part = torch.empty(ks, t, be, dtype=torch.float32, device=x.device)
    _route_logits_kernel[(triton.cdiv(t, bt), ks)](
        x, weight, part, t, e, d, x.stride(0), weight.stride(0), kch,
        BT=bt, BE=be, BK=bk, LOWP=lowp, num_warps=4,
    )  # fmt: skip
    _route_kernel[(triton.cdiv(t, bt),)](
        part, bias, ids, tw, expert_load if expert_load is not None else ids,
        t, e, ks, float(routed_scaling_factor),
        TOPK=top_k, KP=triton.next_power_of_2(top_k), NORM=bool(norm_topk_prob),
        COUNT=expert_load is not None, BT=bt, BE=be, num_warps=4,
    )  # fmt: skip
    return tw, ids


@triton.jit
def _align_kernel(ids, slot, bexp, M, E, P, NB,
                  BM: tl.constexpr, BE: tl.constexpr, CH: tl.constexpr):  # fmt: skip
    cols = tl.arange(0, BE)
    m_e = cols < E
    offs = tl.arange(0, CH)
    for p0 in range(0, P, CH):  # padding marker everywhere first
        tl.store(slot + p0 + offs, tl.full((CH,), 0, tl.int32) + M, mask=p0 + offs < P)
    counts = tl.zeros((BE,), dtype=tl.int32)
    for a0 in range(0, M, CH):
        e_of = tl.load(ids + a0 + offs, mask=a0 + offs < M, other=-1).to(tl.int32)
        counts += tl.sum((e_of[:, None] == cols[None, :]).to(tl.int32), 0)
    padded = (counts + BM - 1) // BM * BM
    pad_ends = tl.cumsum(padded, 0)
    pad_starts = pad_ends - padded
    tl.debug_barrier()  # the fill above lands before the scatter below
    running = tl.zeros((BE,), dtype=tl.int32)
    for a0 in range(0, M, CH):
        m_a = a0 + offs < M
        e_of = tl.load(ids + a0 + offs, mask=m_a, other=-1).to(tl.int32)
        hot = (e_of[:, None] == cols[None, :]).to(tl.int32)
        # earlier same-expert assignments in the chunk: strictly-lower-triangular ones × one-hot
        # (integer counts ≤ CH, exact in fp16 products / fp32 sums) on the tensor cores
        tri = (offs[:, None] > offs[None, :]).to(tl.float16)
        prior = tl.dot(tri, hot.to(tl.float16)).to(tl.int32)
        before = prior + (running + pad_starts)[None, :]
        dest = tl.sum(hot * before, 1)
        tl.store(slot + dest, (a0 + offs).to(tl.int32), mask=m_a)
        running += tl.sum(hot, 0)
    for b0 in range(0, NB, CH):
        start = (b0 + offs) * BM
        le = (pad_ends[None, :] <= start[:, None]) & m_e[None, :]
        tl.store(bexp + b0 + offs, tl.sum(le.to(tl.int32), 1), mask=b0 + offs < NB)


def align_blocks_triton(topk_ids: torch.Tensor, num_experts: int, block_m: int, p_len: int):
    """:func:`k3serve.kernels.moe.grouped_triton.align_blocks` in one single-program launch
    (for decode-sized ``T·k``: it walks the assignments in chunks of up to 128).

    Args:
        topk_ids: ``[T, k]`` integer expert ids in ``[0, E)``.
        num_experts: ``E``; block_m: ``BM``; p_len: the padded length ``P`` (multiple of BM).

    Returns:
        ``(slot_assign [P] int32, block_expert [P / BM] int32)`` equal to the torch layout's.
    """
    m = topk_ids.numel()
    flat = topk_ids.reshape(-1)
    slot = torch.empty(p_len, dtype=torch.int32, device=topk_ids.device)
    nb = p_len // block_m
    bexp = torch.empty(nb, dtype=torch.int32, device=topk_ids.device)
    be = max(16, triton.next_power_of_2(num_experts))
    ch = max(16, min(128 if be <= 64 else 64, triton.next_power_of_2(m)))
    _align_kernel[(1,)](flat, slot, bexp, m, num_experts, p_len, nb,
                        BM=block_m, BE=be, CH=ch, num_warps=4)  # fmt: skip
    return slot, bexp


__all__ = ["align_blocks_triton", "route_topk_triton"]
