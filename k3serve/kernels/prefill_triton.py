"""Prefill-only fused kernels in Triton: the KDA short causal conv over packed sequences, and the
Block-AttnRes mix over many tokens, and the KDA q / k L2 norm. They replace eager float32 chains that, at prefill sizes
(thousands of tokens), move several times the bytes of their input through memory.

References (the spec; these kernels compute the same function in float32 and round once):

* :func:`conv_varlen_triton` — ``k3serve.kernels.kda.naive.causal_conv_varlen``: depthwise causal conv
  (``W`` taps, no bias) + SiLU over packed sequences continuing a per-sequence history of the
  last ``W − 1`` pre-conv inputs. The reference builds an ``[T + N(W−1), C]`` extended copy and
  ``W`` float32 temporaries of ``[T, C]`` (≈ 6 GB of traffic per k3-mini KDA layer at 8k tokens);
  here one pass reads ``x`` (taps served by L1/L2) and writes ``y``, and no sequence length is
  read back to the host (the reference's ``repeat_interleave`` does).
* :func:`attn_res_mix_triton` — ``k3serve.kernels.naive.attn_res_mix`` (arXiv 2603.15031):
  ``Σ_s softmax_s(w · (γ ⊙ RMSNorm(v_s))) · v_s``. The reference stacks the ``S`` sources in
  float32 and runs norm, product, softmax and sum as separate launches (≈ 10·S·T·d·4 bytes);
  here each program reads its rows of every source twice (scores, then the weighted sum) and
  writes the result once. ``w · (γ ⊙ RMSNorm(v))`` is computed as ``rsqrt(mean(v²) + ε) ·
  Σ_d v_d γ_d w_d`` (the same sum, another order).

* :func:`l2norm_heads_triton` — ``k3serve.kernels.naive.l2norm`` of q and k in one launch.

All are used on the prefill path only (``k3serve/model/kda.py`` varlen branch,
``K3ForCausalLM.forward`` when the batch is not a decode step); decode keeps its own kernels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ATTN_RES_MAX_SOURCES = 8
"""Sources :func:`attn_res_mix_triton` takes (the scalar offsets it is passed); more → ValueError."""


@triton.jit
def _conv_varlen_kernel(
    x, w, hist, seq, cu, y,
    T, C, s_xt, s_hn, s_hw, s_yt,
    W: tl.constexpr, HAS_H: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
):  # fmt: skip
    pid_t = tl.program_id(0)
    pid_c = tl.program_id(1)
    offs_t = pid_t * BT + tl.arange(0, BT)
    m_t = offs_t < T
    offs_c = pid_c * BC + tl.arange(0, BC)
    m_c = offs_c < C
    sq = tl.load(seq + offs_t, mask=m_t, other=0)
    rel = offs_t - tl.load(cu + sq, mask=m_t, other=0)  # position inside its sequence
    acc = tl.zeros((BT, BC), dtype=tl.float32)
    for j in tl.static_range(W):
        back = W - 1 - j  # tap j multiplies the input `back` tokens before the current one
        p = rel - back
        in_x = p >= 0
        m2 = m_c[None, :] & (m_t & in_x)[:, None]
        v = tl.load(x + (offs_t - back).to(tl.int64)[:, None] * s_xt + offs_c[None, :], mask=m2,
                    other=0.0)  # fmt: skip
        if HAS_H:
            mh = m_c[None, :] & (m_t & (p < 0))[:, None]
            hv = tl.load(hist + sq.to(tl.int64)[:, None] * s_hn + (W - 1 + p)[:, None] * s_hw
                         + offs_c[None, :], mask=mh, other=0.0)  # fmt: skip
            v = tl.where(in_x[:, None], v, hv.to(v.dtype))
        wj = tl.load(w + offs_c * W + j, mask=m_c, other=0.0).to(tl.float32)
        acc += v.to(tl.float32) * wj[None, :]
    out = acc * tl.sigmoid(acc)
    tl.store(y + offs_t.to(tl.int64)[:, None] * s_yt + offs_c[None, :],
             out.to(y.dtype.element_ty), mask=m_t[:, None] & m_c[None, :])  # fmt: skip


def conv_varlen_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    cu_seqlens: torch.Tensor,
    history: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv + SiLU over packed sequences (``causal_conv_varlen`` contract).

    Args:
        x: ``[T, C]`` pre-conv inputs of the new tokens, packed by ``cu_seqlens`` (rows may be
            strided; columns contiguous).
        weight: ``[C, W]`` taps (``weight[:, W-1]`` multiplies the current token).
        cu_seqlens: ``[N+1]`` int64 boundaries (on ``x``'s device; never read by the host).
        history: ``[N, W-1, C]`` last ``W − 1`` pre-conv inputs per sequence, oldest first, or
            None (zeros).

    Returns:
        ``(y [T, C] in x.dtype, new_history [N, W-1, C] in x.dtype)`` — float32 accumulation
        in tap order, SiLU in float32, one rounding.

    Raises:
        ValueError: shapes that do not pair up.
    """
    t, c = x.shape
    n = cu_seqlens.shape[0] - 1
    wt = weight.shape[-1]
    if weight.shape != (c, wt):
        raise ValueError(f"weight: shape {tuple(weight.shape)}, expected [{c}, W]")
    if history is not None and history.shape != (n, wt - 1, c):
        raise ValueError(f"history: shape {tuple(history.shape)}, expected [{n}, {wt - 1}, {c}]")
    dev = x.device
    if x.stride(-1) != 1:  # row-strided x (a column slice of a stacked GEMM) is read in place
        x = x.contiguous()
    cu = cu_seqlens.to(device=dev, dtype=torch.int64)
    hist = None if history is None else history.contiguous()
    y = torch.empty(t, c, dtype=x.dtype, device=dev)
    if t:
        seq = torch.searchsorted(cu[1:], torch.arange(t, device=dev), right=True)
        bt, bc = 32, 128
        _conv_varlen_kernel[(triton.cdiv(t, bt), triton.cdiv(c, bc))](
            x, weight.contiguous(), hist if hist is not None else x, seq, cu, y,
            t, c, x.stride(0), hist.stride(0) if hist is not None else 0,
            hist.stride(1) if hist is not None else 0, y.stride(0),
            W=wt, HAS_H=hist is not None, BT=bt, BC=bc, num_warps=4,
        )  # fmt: skip
    # new history: the last W-1 inputs of each sequence, reaching into the old history when the
    # sequence is shorter than W-1 (position p < 0 → old history row W-1+p)
    lens = cu[1:] - cu[:-1]
    p = lens[:, None] - (wt - 1) + torch.arange(wt - 1, device=dev)  # [N, W-1]
    from_x = (p >= 0)[..., None]
    xi = (cu[:-1, None] + p).clamp(0, max(t - 1, 0))
    xs = x[xi] if t else x.new_zeros(n, wt - 1, c)
    if hist is None:
        old = x.new_zeros(n, wt - 1, c)
    else:
        hi = (wt - 1 + p).clamp(0, wt - 2)
        old = hist.to(x.dtype).gather(1, hi[..., None].expand(n, wt - 1, c))
    return y, torch.where(from_x, xs, old)


@triton.jit(do_not_specialize=["o1", "o2", "o3", "o4", "o5", "o6", "o7"])
def _attn_res_kernel(
    base, o1, o2, o3, o4, o5, o6, o7, nw, q, y,
    T, D, s_t, s_yt, eps,
    S: tl.constexpr, SP: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    offs_t = pid * BT + tl.arange(0, BT)
    m_t = offs_t < T
    rows = offs_t.to(tl.int64)[:, None] * s_t
    cols = tl.arange(0, SP)
    logits = tl.full((BT, SP), float("-inf"), dtype=tl.float32)
    for s in tl.static_range(S):
        off = 0 if s == 0 else o1 if s == 1 else o2 if s == 2 else o3 if s == 3 else \
            o4 if s == 4 else o5 if s == 5 else o6 if s == 6 else o7  # fmt: skip
        ss = tl.zeros((BT,), dtype=tl.float32)
        dot = tl.zeros((BT,), dtype=tl.float32)
        for d0 in range(0, D, BD):
            offs_d = d0 + tl.arange(0, BD)
            m_d = offs_d < D
            v = tl.load(base + off + rows + offs_d[None, :], mask=m_t[:, None] & m_d[None, :],
                        other=0.0).to(tl.float32)  # fmt: skip
            gw = (tl.load(nw + offs_d, mask=m_d, other=0.0).to(tl.float32)
                  * tl.load(q + offs_d, mask=m_d, other=0.0).to(tl.float32))  # fmt: skip
            ss += tl.sum(v * v, 1)
            dot += tl.sum(v * gw[None, :], 1)
        lg = dot * tl.rsqrt(ss / D + eps)
        logits = tl.where(cols[None, :] == s, lg[:, None], logits)
    mx = tl.max(logits, 1)
    ex = tl.exp(logits - mx[:, None])
    alpha = ex / tl.sum(ex, 1)[:, None]
    for d0 in range(0, D, BD):
        offs_d = d0 + tl.arange(0, BD)
        m2 = m_t[:, None] & (offs_d < D)[None, :]
        acc = tl.zeros((BT, BD), dtype=tl.float32)
        for s in tl.static_range(S):
            off = 0 if s == 0 else o1 if s == 1 else o2 if s == 2 else o3 if s == 3 else \
                o4 if s == 4 else o5 if s == 5 else o6 if s == 6 else o7  # fmt: skip
            a_s = tl.sum(tl.where(cols[None, :] == s, alpha, 0.0), 1)
            v = tl.load(base + off + rows + offs_d[None, :], mask=m2, other=0.0).to(tl.float32)
            acc += a_s[:, None] * v
        tl.store(y + offs_t.to(tl.int64)[:, None] * s_yt + offs_d[None, :],
                 acc.to(y.dtype.element_ty), mask=m2)  # fmt: skip


def attn_res_mix_triton(
    sources: list[torch.Tensor], norm_weight: torch.Tensor, query: torch.Tensor, eps: float
) -> torch.Tensor:
    """Block-AttnRes mix (``k3serve.kernels.naive.attn_res_mix`` contract) in one launch.

    Args:
        sources: ``S`` (1 ≤ S ≤ :data:`ATTN_RES_MAX_SOURCES`) tensors ``[T, d]`` of one dtype on
            one device (the stored block vectors, then the partial sum).
        norm_weight: ``[d]`` γ. query: ``[1, d]`` or ``[d]`` pseudo-query w.
        eps: RMSNorm epsilon.

    Returns:
        ``[T, d]`` in ``sources[0].dtype``; scores, softmax and sum in float32.

    Raises:
        ValueError: no sources, more than :data:`ATTN_RES_MAX_SOURCES`, or mismatched
            shapes / dtypes.
    """
    if not sources:
        raise ValueError("sources: need at least one vector to mix")
    if len(sources) == 1:
        return sources[0]
    if len(sources) > ATTN_RES_MAX_SOURCES:
        raise ValueError(f"sources: {len(sources)} > {ATTN_RES_MAX_SOURCES} supported")
    src = [s.contiguous() for s in sources]
    t, d = src[0].shape
    if any(s.shape != (t, d) or s.dtype != src[0].dtype or s.device != src[0].device
           for s in src):  # fmt: skip
        raise ValueError("sources: every source must be [T, d] of one dtype on one device")
    es = src[0].element_size()
    base = src[0]
    offs = [(s.data_ptr() - base.data_ptr()) // es for s in src[1:]]
    offs += [0] * (ATTN_RES_MAX_SOURCES - 1 - len(offs))
    y = torch.empty_like(base)
    if t:
        bt = 4
        _attn_res_kernel[(triton.cdiv(t, bt),)](
            base, *offs, norm_weight.contiguous(), query.reshape(-1).contiguous(), y,
            t, d, base.stride(0), y.stride(0), float(eps),
            S=len(src), SP=triton.next_power_of_2(len(src)), BT=bt,
            BD=min(1024, triton.next_power_of_2(d)), num_warps=4,
        )  # fmt: skip
    return y


@triton.jit
def _l2norm_heads_kernel(x, y, R, T, G, H, s_t, s_g, s_h, eps,
                         K: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr):  # fmt: skip
    """Rows ``r = (t·G + g)·H + h`` of ``x[t, g, h, :]`` (strided) → ``y[g, t, h, :]``."""
    offs_r = tl.program_id(0) * BR + tl.arange(0, BR)
    offs_k = tl.arange(0, BK)
    m_r = offs_r < R
    m = m_r[:, None] & (offs_k < K)[None, :]
    t = (offs_r // (G * H)).to(tl.int64)
    g = ((offs_r // H) % G).to(tl.int64)
    h = (offs_r % H).to(tl.int64)
    src = t * s_t + g * s_g + h * s_h
    v = tl.load(x + src[:, None] + offs_k[None, :], mask=m, other=0.0).to(tl.float32)
    inv = tl.rsqrt(tl.sum(v * v, 1) + eps)
    dst = ((g * T + t) * H + h) * K
    tl.store(y + dst[:, None] + offs_k[None, :], (v * inv[:, None]).to(y.dtype.element_ty), mask=m)


def l2norm_heads_triton(x: torch.Tensor, eps: float = 1e-6, dtype: torch.dtype | None = None
                        ) -> torch.Tensor:  # fmt: skip
    """fla's L2 norm over the last dim of ``G`` groups of heads, regrouped: one launch.

    ``y[g, t, h] = x[t, g, h] / sqrt(Σ_k x[t, g, h, k]² + eps)`` in float32, rounded once to
    ``dtype`` — ``k3serve.kernels.naive.l2norm`` of each group (the KDA prefill normalises q and k
    of the conv output, ``[T, 2, H, K]`` column slices of one tensor, so ``y[0]`` / ``y[1]``
    are contiguous q / k without extra copies).

    Args:
        x: ``[T, G, H, K]`` any float dtype, any strides with ``x.stride(-1) == 1``.
        eps: added to the sum of squares.
        dtype: output dtype (None: ``x.dtype``).

    Returns:
        ``[G, T, H, K]`` contiguous.

    Raises:
        ValueError: ``x`` not 4-D or its last dim strided.
    """
    if x.ndim != 4 or x.stride(-1) != 1:
        raise ValueError(f"x: need [T, G, H, K] with unit last stride, got {tuple(x.shape)}")
    t, g, h, k = x.shape
    y = torch.empty(g, t, h, k, dtype=dtype or x.dtype, device=x.device)
    r = t * g * h
    if r:
        bk = triton.next_power_of_2(k)
        br = max(1, min(64, 4096 // bk))
        _l2norm_heads_kernel[(triton.cdiv(r, br),)](
            x, y, r, t, g, h, x.stride(0), x.stride(1), x.stride(2), float(eps),
            K=k, BR=br, BK=bk, num_warps=4,
        )  # fmt: skip
    return y


__all__ = ["ATTN_RES_MAX_SOURCES", "attn_res_mix_triton", "conv_varlen_triton",
           "l2norm_heads_triton"]  # fmt: skip
