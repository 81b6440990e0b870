"""KDA decode in Triton: the recurrent step over the state pool, and the short-conv step beside it.

Both kernels read and write the persistent pools in place through the row indices
``slots`` (INTERFACES.md §1): no gather / scatter copies, and the pools may be strided views
(one layer's slice ``kda_state[j]`` / ``conv_state[j]``); strides are passed explicitly.

* :func:`fused_recurrent_kda_step_triton` — the KDA recurrence (Kimi Linear arXiv 2510.26692
  §3) for one token of ``N`` sequences. One program per (sequence, head, V-block) holds a
  ``[K, BV]`` fp32 tile of the state in registers: read once, written once, so the step moves
  ``2 · N · H · K · V · 4`` bytes of state — the traffic the roofline counts.
* :func:`causal_conv_step_triton` — the depthwise causal conv (kernel W, no bias) + SiLU for one
  token per sequence over the pre-conv ``q | k | v`` channels, shifting the conv state
  ``[S, W-1, C]`` (oldest first) in place. It runs right before the KDA step in a decode layer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _kda_step_kernel(
    q,
    k,
    v,
    g,
    beta,
    pool,
    slots,
    o,
    scale,
    s_slot,
    s_h,
    s_k,
    s_v,
    H: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BV: tl.constexpr,
    FLAT: tl.constexpr,
    EVICT: tl.constexpr,
):
    if FLAT:
        # 1-D grid, V-block fastest: neighbouring programs stream neighbouring state bytes
        NVB: tl.constexpr = (V + BV - 1) // BV
        i = tl.program_id(0).to(tl.int64)
        i_v = i % NVB
        i_h = (i // NVB) % H
        i_n = i // (NVB * H)
    else:
        i_n, i_h, i_v = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)
    slot = tl.load(slots + i_n).to(tl.int64)
    o_k = tl.arange(0, K)
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    p_qk = (i_n * H + i_h) * K + o_k
    b_q = tl.load(q + p_qk).to(tl.float32) * scale
    b_k = tl.load(k + p_qk).to(tl.float32)
    b_g = tl.load(g + p_qk).to(tl.float32)
    b_v = tl.load(v + (i_n * H + i_h) * V + o_v, mask=m_v, other=0.0).to(tl.float32)
    b_b = tl.load(beta + i_n * H + i_h).to(tl.float32)
    p_s = pool + slot * s_slot + i_h * s_h + o_k[:, None] * s_k + o_v[None, :] * s_v
    if EVICT:  # the state is touched once per step: keep it from crowding L2
        S = tl.load(p_s, mask=m_v[None, :], other=0.0, eviction_policy="evict_first").to(tl.float32)
    else:
        S = tl.load(p_s, mask=m_v[None, :], other=0.0).to(tl.float32)
    S = S * tl.exp(b_g)[:, None]
    b_u = b_b * (b_v - tl.sum(b_k[:, None] * S, 0))
    S = S + b_k[:, None] * b_u[None, :]
    b_o = tl.sum(b_q[:, None] * S, 0)
    if EVICT:
        tl.store(p_s, S.to(pool.dtype.element_ty), mask=m_v[None, :], eviction_policy="evict_first")
    else:
        tl.store(p_s, S.to(pool.dtype.element_ty), mask=m_v[None, :])
    tl.store(o + (i_n * H + i_h) * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)


def fused_recurrent_kda_step_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state_pool: torch.Tensor,
    slots: torch.Tensor,
    scale: float | None = None,
    *,
    block_v: int | None = None,
    num_warps: int = 4,
    flat_grid: bool = True,
    evict_first: bool = False,
) -> torch.Tensor:
    r"""One KDA decode step in place on ``state_pool[slots]``; same contract as
    :func:`k3serve.kernels.kda.fused_recurrent_kda_step`.

    Args:
        q, k, g (torch.Tensor): ``[N, H, K]`` (q, k L2-normalised; g ≤ 0 log-decay).
        v (torch.Tensor): ``[N, H, V]``.
        beta (torch.Tensor): ``[N, H]``.
        state_pool (torch.Tensor): ``[S, H, K, V]`` fp32, any strides (a view is fine); mutated.
        slots (torch.Tensor): ``[N]`` int, distinct rows of ``state_pool``.
        scale (float, optional): default ``K ** -0.5``.
        block_v (int, optional): V columns per program (default 64: best of the H200 sweep in
            ``docs/results/gpu_kernels.md``).
        num_warps (int): warps per program (tuning knob).
        flat_grid (bool): one grid axis with the V-block fastest (neighbouring programs read
            neighbouring state bytes) instead of a ``(N, H, V-blocks)`` grid.
        evict_first (bool): L2 eviction hint on the state load / store.

    Returns:
        ``o [N, H, V]`` in ``v.dtype``.

    Raises:
        ValueError: inconsistent shapes, or K not a power of two.
    """
    N, H, K = q.shape
    V = v.shape[-1]
    if k.shape != q.shape or g.shape != q.shape or v.shape != (N, H, V) or beta.shape != (N, H):
        raise ValueError("decode step wants q, k, g [N, H, K], v [N, H, V], beta [N, H]")
    if state_pool.dim() != 4 or tuple(state_pool.shape[1:]) != (H, K, V):
        raise ValueError(f"state_pool must be [S, {H}, {K}, {V}], got {tuple(state_pool.shape)}")
    if slots.shape != (N,):
        raise ValueError(f"slots must be [N={N}], got {tuple(slots.shape)}")
    if K & (K - 1):
        raise ValueError(f"K={K} must be a power of two")
    if scale is None:
        scale = K**-0.5
    BV = block_v or min(64, triton.next_power_of_2(V))
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    o = torch.empty(N, H, V, dtype=v.dtype, device=v.device)
    if N == 0:
        return o
    nvb = triton.cdiv(V, BV)
    grid = (N * H * nvb,) if flat_grid else (N, H, nvb)
    _kda_step_kernel[grid](
        q, k, v, g, beta, state_pool, slots, o, scale, *state_pool.stride(),
        H=H, K=K, V=V, BV=BV, FLAT=flat_grid, EVICT=evict_first, num_warps=num_warps,
    )  # fmt: skip
    return o


@triton.jit
def _conv_step_kernel(
    x,
    pool,
    weight,
    slots,
    y,
    C,
    s_slot,
    s_w,
    s_c,
    W: tl.constexpr,
    BLOCK: tl.constexpr,
):
    i_n, i_b = tl.program_id(0).to(tl.int64), tl.program_id(1)
    slot = tl.load(slots + i_n).to(tl.int64)
    o_c = i_b * BLOCK + tl.arange(0, BLOCK)
    m = o_c < C
    b_x = tl.load(x + i_n * C + o_c, mask=m, other=0.0)
    acc = b_x.to(tl.float32) * tl.load(weight + o_c * W + (W - 1), mask=m, other=0.0).to(tl.float32)
    base = pool + slot * s_slot + o_c * s_c
    for j in tl.static_range(W - 1):
        b_h = tl.load(base + j * s_w, mask=m, other=0.0)
        acc += b_h.to(tl.float32) * tl.load(weight + o_c * W + j, mask=m, other=0.0).to(tl.float32)
        if j >= 1:
            tl.store(base + (j - 1) * s_w, b_h, mask=m)  # shift: oldest drops out
    tl.store(base + (W - 2) * s_w, b_x.to(pool.dtype.element_ty), mask=m)
    tl.store(y + i_n * C + o_c, (acc * tl.sigmoid(acc)).to(y.dtype.element_ty), mask=m)


def causal_conv_step_triton(
    x: torch.Tensor,
    conv_pool: torch.Tensor,
    weight: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    r"""Depthwise causal conv + SiLU for one new token per sequence, updating the conv state.

    ``y = silu(Σ_{j<W-1} state[j] · w[:, j] + x · w[:, W-1])`` (fp32 accumulation), then the state
    becomes ``[state[1:], x]`` (oldest first), in place. Matches the decode case of the model's
    ``causal_conv_varlen`` (one token per sequence).

    Args:
        x (torch.Tensor): ``[N, C]`` pre-conv inputs (channels ``q | k | v``), model dtype.
        conv_pool (torch.Tensor): ``[S, W-1, C]`` any strides; rows ``slots`` are mutated.
        weight (torch.Tensor): ``[C, W]`` taps (``weight[:, W-1]`` hits the current token).
        slots (torch.Tensor): ``[N]`` int, distinct rows.

    Returns:
        ``y [N, C]`` in ``x.dtype``.

    Raises:
        ValueError: inconsistent shapes, or ``W < 2``.
    """
    N, C = x.shape
    W = weight.shape[-1]
    if W < 2 or weight.shape != (C, W) or conv_pool.dim() != 3 or tuple(conv_pool.shape[1:]) != (W - 1, C):
        raise ValueError(
            f"conv step wants x [N, C], weight [C, W>=2], conv_pool [S, W-1, C]; got x {tuple(x.shape)}, "
            f"weight {tuple(weight.shape)}, conv_pool {tuple(conv_pool.shape)}"
        )
    x, weight = x.contiguous(), weight.contiguous()
    y = torch.empty_like(x)
    if N == 0:
        return y
    BLOCK = min(1024, triton.next_power_of_2(C))
    _conv_step_kernel[(N, triton.cdiv(C, BLOCK))](
        x, conv_pool, weight, slots, y, C, *conv_pool.stride(), W=W, BLOCK=BLOCK, num_warps=4
    )
    return y


@triton.jit
def _conv_channels(proj, pool, weight, row, slot, c, s_pn, s_slot, s_w, s_c, W: tl.constexpr):
    """Causal conv + SiLU of channels ``c`` for one token (``_conv_step_kernel``'s math),
    shifting those channels of the conv state in place; float32 result. Every history row is
    read before the barrier and written after it: threads holding replicated copies of a
    channel never see a half-shifted state."""
    b_x = tl.load(proj + row * s_pn + c)
    acc = b_x.to(tl.float32) * tl.load(weight + c * W + (W - 1)).to(tl.float32)
    base = pool + slot * s_slot + c * s_c
    if W == 4:  # K3 / Kimi Linear: three history rows, kept in registers across the barrier
        h0 = tl.load(base)
        h1 = tl.load(base + s_w)
        h2 = tl.load(base + 2 * s_w)
        acc += h0.to(tl.float32) * tl.load(weight + c * W).to(tl.float32)
        acc += h1.to(tl.float32) * tl.load(weight + c * W + 1).to(tl.float32)
        acc += h2.to(tl.float32) * tl.load(weight + c * W + 2).to(tl.float32)
        tl.debug_barrier()
        tl.store(base, h1)
        tl.store(base + s_w, h2)
    else:  # generic W: history copied shifted through registers one row at a time
        for j in tl.static_range(W - 1):
            acc += tl.load(base + j * s_w).to(tl.float32) * tl.load(weight + c * W + j).to(
                tl.float32
            )
        for j in tl.static_range(1, W - 1):
            b_h = tl.load(base + j * s_w)
            tl.debug_barrier()
            tl.store(base + (j - 1) * s_w, b_h)
            tl.debug_barrier()
    tl.store(base + (W - 2) * s_w, b_x.to(pool.dtype.element_ty))
    return acc * tl.sigmoid(acc)


@triton.jit
def _kda_decode_fused_kernel(
    proj, fb, cpool, cw, spool, slots, a_log, dt_bias, nw, out,
    s_pn, s_fn, s_cslot, s_cw, s_cc, s_slot, s_h, s_k, s_v, s_on,
    scale, lb, eps, g_off, b_off,
    H: tl.constexpr, K: tl.constexpr, W: tl.constexpr, LB: tl.constexpr, BV: tl.constexpr,
):  # fmt: skip
    i = tl.program_id(0).to(tl.int64)
    i_n = i // H
    i_h = i % H
    DT = out.dtype.element_ty
    slot = tl.load(slots + i_n).to(tl.int64)
    o_k = tl.arange(0, K)
    HK: tl.constexpr = H * K
    c_q = i_h * K + o_k
    # short conv (state shifted in place) + SiLU, rounded as the model's conv output is
    y_q = _conv_channels(proj, cpool, cw, i_n, slot, c_q, s_pn, s_cslot, s_cw, s_cc, W)
    y_k = _conv_channels(proj, cpool, cw, i_n, slot, c_q + HK, s_pn, s_cslot, s_cw, s_cc, W)
    y_q = y_q.to(DT).to(tl.float32)
    y_k = y_k.to(DT).to(tl.float32)
    # fla l2norm (eps 1e-6), rounded to the model dtype
    b_q = (y_q * tl.rsqrt(tl.sum(y_q * y_q, 0) + 1e-6)).to(DT).to(tl.float32) * scale
    b_k = (y_k * tl.rsqrt(tl.sum(y_k * y_k, 0) + 1e-6)).to(DT).to(tl.float32)
    # forget gate (kda_gate) and β = σ(b)
    f = tl.load(fb + i_n * s_fn + c_q).to(tl.float32) + tl.load(dt_bias + c_q).to(tl.float32)
    a = tl.exp(tl.load(a_log + i_h).to(tl.float32))
    if LB:
        b_g = lb * tl.sigmoid(a * f)
    else:
        b_g = -a * tl.where(f > 20.0, f, tl.log(1.0 + tl.exp(f)))
    decay = tl.exp(b_g)
    b_b = tl.sigmoid(tl.load(proj + i_n * s_pn + b_off + i_h).to(tl.float32))
    # the recurrence, BV state columns at a time (columns are independent): each [K, BV]
    # tile of the state is read once and written once
    sq = tl.zeros((), dtype=tl.float32)
    for v0 in tl.static_range(0, K, BV):
        o_v = v0 + tl.arange(0, BV)
        b_v = _conv_channels(proj, cpool, cw, i_n, slot, 2 * HK + i_h * K + o_v, s_pn, s_cslot,
                             s_cw, s_cc, W).to(DT).to(tl.float32)  # fmt: skip
        p_s = spool + slot * s_slot + i_h * s_h + o_k[:, None] * s_k + o_v[None, :] * s_v
        S = tl.load(p_s).to(tl.float32) * decay[:, None]
        b_u = b_b * (b_v - tl.sum(b_k[:, None] * S, 0))
        S = S + b_k[:, None] * b_u[None, :]
        b_o = tl.sum(b_q[:, None] * S, 0).to(DT)
        tl.store(p_s, S.to(spool.dtype.element_ty))
        sq += tl.sum(b_o.to(tl.float32) * b_o.to(tl.float32), 0)
        tl.store(out + i_n * s_on + i_h * K + o_v, b_o)  # o in the model dtype, normed below
    tl.debug_barrier()
    # gated output RMSNorm (GatedRMSNorm): o · rsqrt(mean(o²) + eps) · w · σ(gate)
    b_o = tl.load(out + i_n * s_on + c_q).to(tl.float32)
    b_o = b_o * tl.rsqrt(sq / K + eps) * tl.load(nw + o_k).to(tl.float32)
    gate = tl.load(proj + i_n * s_pn + g_off + c_q).to(tl.float32)
    tl.debug_barrier()
    tl.store(out + i_n * s_on + c_q, (b_o * tl.sigmoid(gate)).to(DT))


def kda_decode_fused_triton(
    proj: torch.Tensor,
    fb: torch.Tensor,
    conv_pool: torch.Tensor,
    conv_weight: torch.Tensor,
    state_pool: torch.Tensor,
    slots: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    lower_bound: float | None,
    norm_weight: torch.Tensor,
    eps: float,
    num_heads: int,
    g_off: int,
    b_off: int,
    scale: float | None = None,
    block_v: int = 32,
    num_warps: int = 4,
) -> torch.Tensor:
    r"""A whole KDA decode step after the input projections, in one launch per step: short conv
    (+ SiLU, conv state shifted in place) → l2norm(q, k) → gate ``g`` and ``β = σ(b)`` → the
    recurrence on ``state_pool[slots]`` (in place) → gated output RMSNorm. Same result as
    :func:`k3serve.kernels.kda.recurrent.kda_decode_fused` (the plain-torch reference, built
    from the model's own ops), with the model's roundings (conv output, l2norm, ``o`` in the
    model dtype). One program per (sequence, head) walks that head's ``[K, K]`` state in
    ``[K, block_v]`` tiles (read once, written once).

    Args:
        proj: ``[N, P]`` one token per sequence; columns ``[0, 3HK)`` the pre-conv ``q | k | v``,
            ``[g_off, g_off + HK)`` the output-gate pre-activation, ``b_off + h`` the β logit
            of head ``h`` (rows may be strided; columns contiguous).
        fb: ``[N, HK]`` gate projection output ``f`` (before ``dt_bias``).
        conv_pool: ``[S, W-1, 3HK]`` conv states (any strides); rows ``slots`` mutated.
        conv_weight: ``[3HK, W]`` taps (``[:, W-1]`` hits the current token).
        state_pool: ``[S, H, K, K]`` float32 KDA states (any strides); rows ``slots`` mutated.
        slots: ``[N]`` int distinct rows.
        A_log: ``[H]``; dt_bias: ``[HK]``; lower_bound: K3's gate bound, or None (softplus
            gate of Kimi Linear) — :func:`k3serve.kernels.kda.naive.kda_gate`.
        norm_weight: ``[K]`` output norm weight; eps: its epsilon.
        num_heads: ``H``; g_off, b_off: column offsets in ``proj``.
        scale: q scale (default ``K ** -0.5``).

    Returns:
        ``[N, HK]`` in ``proj.dtype``: ``RMSNorm_head(o) · w · σ(gate)``, ready for ``o_proj``.

    Raises:
        ValueError: inconsistent shapes, or K not a power of two.
    """
    n = proj.shape[0]
    h = num_heads
    hk = fb.shape[-1]
    k = hk // h
    w = conv_weight.shape[-1]
    if k * h != hk or k & (k - 1) or conv_weight.shape != (3 * hk, w) or w < 2:
        raise ValueError(f"fb [N, H·K] with K a power of two and conv_weight [3·H·K, W≥2]: got "
                         f"fb {tuple(fb.shape)}, H {h}, conv_weight {tuple(conv_weight.shape)}")  # fmt: skip
    if tuple(state_pool.shape[1:]) != (h, k, k) or tuple(conv_pool.shape[1:]) != (w - 1, 3 * hk):
        raise ValueError(f"state_pool [S, {h}, {k}, {k}] / conv_pool [S, {w - 1}, {3 * hk}]: got "
                         f"{tuple(state_pool.shape)} / {tuple(conv_pool.shape)}")  # fmt: skip
    if proj.shape[1] < max(3 * hk, g_off + hk, b_off + h) or proj.stride(1) != 1 or fb.stride(1) != 1:
        raise ValueError(f"proj: {tuple(proj.shape)} too narrow for g_off {g_off} / b_off {b_off}, "
                         "or columns not contiguous")  # fmt: skip
    if slots.shape != (n,) or fb.shape[0] != n:
        raise ValueError(f"slots / fb: need {n} rows, got {tuple(slots.shape)} / {tuple(fb.shape)}")
    out = torch.empty(n, hk, dtype=proj.dtype, device=proj.device)
    if n == 0:
        return out
    cw = conv_weight.contiguous()
    _kda_decode_fused_kernel[(n * h,)](
        proj, fb, conv_pool, cw, state_pool, slots, A_log, dt_bias, norm_weight, out,
        proj.stride(0), fb.stride(0), *conv_pool.stride(), *state_pool.stride(), out.stride(0),
        float(k**-0.5 if scale is None else scale), float(lower_bound or 0.0), float(eps),
        g_off, b_off, H=h, K=k, W=w, LB=lower_bound is not None, BV=min(block_v, k),
        num_warps=num_warps,
    )  # fmt: skip
    return out


__all__ = ["causal_conv_step_triton", "fused_recurrent_kda_step_triton", "kda_decode_fused_triton"]
