"""Fused elementwise kernels in Triton: RMSNorm (optionally × σ(gate)) and the GLUs, one launch
each instead of the 6–9 the torch expressions dispatch (a decode step is launch-bound).

References (the spec, :mod:`k3serve.kernels.naive`): ``rms_norm`` — ``x · rsqrt(mean(x²) + ε) · w``
in float32, cast back (Zhang & Sennrich 2019); ``GatedRMSNorm`` — that times ``σ(gate)`` (fla
``FusedRMSNormGated``); ``situ_glu`` — ``[β·tanh(g/β)·σ(g)]·[β_l·tanh(u/β_l)]`` (DESIGN.md §2);
``swiglu`` — ``silu(g)·u``. The kernels compute in float32 and round once at the end (the torch
GLU rounds after every op in the input dtype, so bf16 results differ by bf16 rounding).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


@triton.jit
def _tanh(x):
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def _rms_norm_kernel(x, w, g, y, D, s_x, s_g, s_y, eps,
                     HAS_W: tl.constexpr, HAS_G: tl.constexpr, BD: tl.constexpr,
                     ROUND: tl.constexpr = False):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BD)
    m = offs < D
    v = tl.load(x + row * s_x + offs, mask=m, other=0.0).to(tl.float32)
    if ROUND:  # x.to(out dtype) first, as ``norm(r.to(dtype))`` does
        v = v.to(y.dtype.element_ty).to(tl.float32)
    v = v * tl.rsqrt(tl.sum(v * v, 0) / D + eps)
    if HAS_W:
        v = v * tl.load(w + offs, mask=m, other=0.0).to(tl.float32)
    if HAS_G:
        v = v * tl.sigmoid(tl.load(g + row * s_g + offs, mask=m, other=0.0).to(tl.float32))
    tl.store(y + row * s_y + offs, v.to(y.dtype.element_ty), mask=m)


def rms_norm_triton(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float, gate: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None, round_input: bool = False,
) -> torch.Tensor:  # fmt: skip
    """RMSNorm over the last dim (× ``σ(gate)`` when given) in one launch.

    Args:
        x: ``[..., D]`` float; weight: ``[D]`` or None; gate: ``[..., D]`` like ``x`` or None.
        eps: added to the mean square.
        out_dtype: result dtype (``x.dtype`` if None).
        round_input: round ``x`` to ``out_dtype`` before normalising (``norm(x.to(dtype))``
            in one launch: the latent MoE's float32 expert sum).

    Returns:
        ``[..., D]`` in ``out_dtype``.

    Raises:
        ValueError: ``gate`` shape differs from ``x``, or ``D > 65536``.
    """
    d = x.shape[-1]
    if gate is not None and gate.shape != x.shape:
        raise ValueError(f"gate: shape {tuple(gate.shape)} != x shape {tuple(x.shape)}")
    if d > 65536:
        raise ValueError(f"x: last dim {d} > 65536 is not supported by the fused RMSNorm")
    x2 = x.reshape(-1, d)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    g2 = None if gate is None else gate.reshape(-1, d).contiguous()
    y = torch.empty(x2.shape, dtype=out_dtype or x.dtype, device=x.device)
    if x2.shape[0]:
        bd = triton.next_power_of_2(d)
        _rms_norm_kernel[(x2.shape[0],)](
            x2, weight if weight is not None else x2, g2 if g2 is not None else x2, y, d,
            x2.stride(0), g2.stride(0) if g2 is not None else 0, y.stride(0), float(eps),
            HAS_W=weight is not None, HAS_G=g2 is not None, BD=bd, ROUND=bool(round_input),
            num_warps=4 if bd <= 2048 else 8,
        )  # fmt: skip
    return y.view(x.shape)


@triton.jit
def _glu_kernel(g, u, y, n, beta, beta_l, ACT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    a = tl.load(g + offs, mask=m, other=0.0).to(tl.float32)
    b = tl.load(u + offs, mask=m, other=0.0).to(tl.float32)
    if ACT == 0:
        out = beta * _tanh(a / beta) * tl.sigmoid(a) * (beta_l * _tanh(b / beta_l))
    else:
        out = a * tl.sigmoid(a) * b
    tl.store(y + offs, out.to(y.dtype.element_ty), mask=m)


@triton.jit
def _glu2d_kernel(g, u, y, n, s_g, s_u, s_y, beta, beta_l, ACT: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    a = tl.load(g + row * s_g + offs, mask=m, other=0.0).to(tl.float32)
    b = tl.load(u + row * s_u + offs, mask=m, other=0.0).to(tl.float32)
    if ACT == 0:
        out = beta * _tanh(a / beta) * tl.sigmoid(a) * (beta_l * _tanh(b / beta_l))
    else:
        out = a * tl.sigmoid(a) * b
    tl.store(y + row * s_y + offs, out.to(y.dtype.element_ty), mask=m)


def glu_triton(
    gate: torch.Tensor, up: torch.Tensor, act: str, beta: float = 4.0, beta_l: float = 25.0
) -> torch.Tensor:
    """SiTU-GLU (``act="situ"``) or SwiGLU (``"silu"``) of same-shape ``gate``, ``up`` ``[..., I]``
    in one launch; result in ``gate.dtype``. 2-D ``gate`` / ``up`` may be row-strided column
    slices of one tensor (a fused gate | up GEMM output): read in place, no copies.

    Raises:
        ValueError: unknown ``act`` or mismatched shapes.
    """
    if act not in ("situ", "silu"):
        raise ValueError(f"act: {act!r} is not 'situ' or 'silu'")
    if gate.shape != up.shape:
        raise ValueError(f"up: shape {tuple(up.shape)} != gate shape {tuple(gate.shape)}")
    if (gate.dim() == 2 and gate.stride(-1) == 1 and up.stride(-1) == 1
            and not (gate.is_contiguous() and up.is_contiguous())):  # fmt: skip
        # column slices of one GEMM output (the fused gate | up projection): no copies
        t, i = gate.shape
        y = torch.empty(t, i, dtype=gate.dtype, device=gate.device)
        if y.numel():
            block = min(1024, triton.next_power_of_2(i))
            _glu2d_kernel[(t, triton.cdiv(i, block))](
                gate, up, y, i, gate.stride(0), up.stride(0), y.stride(0), float(beta),
                float(beta_l), ACT=0 if act == "situ" else 1, BLOCK=block,
            )  # fmt: skip
        return y
    g, u = gate.contiguous(), up.contiguous()
    y = torch.empty_like(g)
    n = g.numel()
    if n:
        block = 1024
        _glu_kernel[(triton.cdiv(n, block),)](
            g, u, y, n, float(beta), float(beta_l), ACT=0 if act == "situ" else 1, BLOCK=block
        )
    return y


__all__ = ["glu_triton", "rms_norm_triton"]


# ---------------------------------------------------------------- residual stream (decode)
MAX_RES_SOURCES = 8
"""Most AttnRes sources (stored blocks + the partial sum) one :func:`res_mix_norm_triton` takes."""


@triton.jit
def _pick(i: tl.constexpr, s0, s1, s2, s3, s4, s5, s6, s7):
    if i == 0:
        return s0
    elif i == 1:
        return s1
    elif i == 2:
        return s2
    elif i == 3:
        return s3
    elif i == 4:
        return s4
    elif i == 5:
        return s5
    elif i == 6:
        return s6
    else:
        return s7


@triton.jit
def _res_mix_norm_kernel(
    p, d1, d2, p_out, s0, s1, s2, s3, s4, s5, s6, s7, rw, rq, lw, h_out,
    D, s_p, s_d1, s_d2, s_po, s_s, s_h, res_eps, eps,
    NB: tl.constexpr, ND: tl.constexpr, MIX: tl.constexpr, HAS_LW: tl.constexpr,
    BD: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BD)
    m = offs < D
    DT = p_out.dtype.element_ty
    # the partial sum P (+ the sublayer outputs, each sum rounded like the torch adds)
    v_p = tl.load(p + row * s_p + offs, mask=m, other=0.0).to(tl.float32)
    if ND >= 1:
        delta = tl.load(d1 + row * s_d1 + offs, mask=m, other=0.0).to(tl.float32)
        if ND == 2:
            delta = delta + tl.load(d2 + row * s_d2 + offs, mask=m, other=0.0).to(tl.float32)
            delta = delta.to(DT).to(tl.float32)
        v_p = (v_p + delta).to(DT).to(tl.float32)
        tl.store(p_out + row * s_po + offs, v_p.to(DT), mask=m)
    if MIX:
        # AttnRes: logits l_s = w · (γ ⊙ RMSNorm(v_s)) over the NB blocks and P, softmax, mix;
        # one pass over the sources (online softmax), each read once
        gw = tl.load(rw + offs, mask=m, other=0.0).to(tl.float32) * tl.load(
            rq + offs, mask=m, other=0.0
        ).to(tl.float32)
        mx = tl.sum(v_p * gw, 0) * tl.rsqrt(tl.sum(v_p * v_p, 0) / D + res_eps)
        den = tl.full((), 1.0, tl.float32)
        acc = v_p
        for i in tl.static_range(NB):
            v = tl.load(_pick(i, s0, s1, s2, s3, s4, s5, s6, s7) + row * s_s + offs, mask=m,
                        other=0.0).to(tl.float32)  # fmt: skip
            lg = tl.sum(v * gw, 0) * tl.rsqrt(tl.sum(v * v, 0) / D + res_eps)
            m_new = tl.maximum(mx, lg)
            c_old = tl.exp(mx - m_new)
            c_new = tl.exp(lg - m_new)
            den = den * c_old + c_new
            acc = acc * c_old + c_new * v
            mx = m_new
        h = (acc / den).to(DT).to(tl.float32)
    else:
        h = v_p
    h = h * tl.rsqrt(tl.sum(h * h, 0) / D + eps)
    if HAS_LW:
        h = h * tl.load(lw + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(h_out + row * s_h + offs, h.to(h_out.dtype.element_ty), mask=m)


def res_mix_norm_triton(
    p: torch.Tensor,
    deltas: tuple[torch.Tensor, ...],
    blocks: list[torch.Tensor],
    res_norm_weight: torch.Tensor | None,
    res_query: torch.Tensor | None,
    res_eps: float,
    norm_weight: torch.Tensor | None,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sublayer boundary of the residual stream in one launch:
    ``P' = P + Σ deltas``, ``h = Mix(blocks ∪ {P'})`` (Block AttnRes; ``h = P'`` without
    ``res_query``), ``out = RMSNorm(h) · norm_weight``.

    The reference is :func:`k3serve.kernels.naive.res_mix_norm_ref` (the torch expressions of
    ``K3ForCausalLM._layers``): the sums round to ``P``'s dtype as the torch adds do (two
    deltas are added to each other first, as ``routed + shared`` is), the mix runs in float32
    (arXiv 2603.15031; ``k3serve.kernels.naive.attn_res_mix``) and rounds to ``P``'s dtype,
    then the RMSNorm (float32, rounded once).

    Args:
        p: ``[T, D]`` partial sum P (bf16/fp16/fp32), rows contiguous.
        deltas: 0, 1 or 2 tensors ``[T, D]`` to add to ``P`` (sublayer outputs).
        blocks: up to ``MAX_RES_SOURCES − 1`` stored block vectors ``[T, D]`` (same strides).
        res_norm_weight, res_query: AttnRes ``γ [D]`` and pseudo-query ``w [D]`` (``[1, D]``);
            None: a plain residual (``blocks`` must be empty).
        res_eps: the AttnRes RMSNorm epsilon; norm_weight / eps: the layer's RMSNorm.

    Returns:
        ``(P' [T, D]`` (``p`` itself when ``deltas`` is empty), ``out [T, D])`` in ``p.dtype``.

    Raises:
        ValueError: too many deltas / blocks, blocks without AttnRes weights, or shapes.
    """
    t, d = p.shape
    if len(deltas) > 2 or len(blocks) > MAX_RES_SOURCES - 1:
        raise ValueError(f"deltas: at most 2 (got {len(deltas)}); blocks: at most "
                         f"{MAX_RES_SOURCES - 1} (got {len(blocks)})")  # fmt: skip
    if blocks and res_query is None:
        raise ValueError("blocks: given without res_norm_weight / res_query")
    for x in (*deltas, *blocks):
        if x.shape != p.shape:
            raise ValueError(f"deltas/blocks: shape {tuple(x.shape)} != p shape {tuple(p.shape)}")
    if d > 16384:
        raise ValueError(f"p: width {d} > 16384 is not supported by the fused residual kernel")
    p_out = torch.empty_like(p) if deltas else p
    out = torch.empty_like(p)
    if t == 0:
        return p_out, out
    srcs = list(blocks) + [p] * (MAX_RES_SOURCES - len(blocks))
    s_s = blocks[0].stride(0) if blocks else 0
    if any(b.stride() != (s_s, 1) for b in blocks) or p.stride(-1) != 1:
        raise ValueError("blocks/p: rows must be contiguous and blocks share one row stride")
    d1 = deltas[0] if deltas else p
    d2 = deltas[1] if len(deltas) > 1 else d1
    mix = res_query is not None and len(blocks) > 0
    bd = triton.next_power_of_2(d)
    _res_mix_norm_kernel[(t,)](
        p, d1, d2, p_out, *srcs,
        res_norm_weight if mix else p, res_query.reshape(-1) if mix else p,
        norm_weight if norm_weight is not None else p, out,
        d, p.stride(0), d1.stride(0), d2.stride(0), p_out.stride(0), s_s, out.stride(0),
        float(res_eps), float(eps),
        NB=len(blocks) if mix else 0, ND=len(deltas), MIX=mix, HAS_LW=norm_weight is not None,
        BD=bd, num_warps=4 if bd <= 2048 else 8,
    )  # fmt: skip
    return p_out, out


__all__ += ["MAX_RES_SOURCES", "res_mix_norm_triton"]


# ---------------------------------------------------------------- MLA decode (absorbed form)
def _lowp(a: torch.Tensor, b: torch.Tensor) -> bool:
    """bf16/fp16 operands of one dtype take the tensor-core dot (exact products, fp32 sums);
    the interpreter's bf16 dot is broken, so CPU tests take the float32 dot."""
    return (a.dtype == b.dtype and a.dtype in (torch.bfloat16, torch.float16)
            and os.environ.get("TRITON_INTERPRET") != "1")  # fmt: skip


@triton.jit
def _mla_latent_write_kernel(proj, nw, slot_map, pool, ncached, seq_lens, s_pn, c_off, eps,
                             DC: tl.constexpr, DR: tl.constexpr):  # fmt: skip
    n = tl.program_id(0).to(tl.int64)
    o_c = tl.arange(0, DC)
    o_r = tl.arange(0, DR)
    c = tl.load(proj + n * s_pn + c_off + o_c).to(tl.float32)
    c = c * tl.rsqrt(tl.sum(c * c, 0) / DC + eps) * tl.load(nw + o_c).to(tl.float32)
    kpe = tl.load(proj + n * s_pn + c_off + DC + o_r)
    dst = pool + tl.load(slot_map + n).to(tl.int64) * (DC + DR)
    tl.store(dst + o_c, c.to(pool.dtype.element_ty))
    tl.store(dst + DC + o_r, kpe.to(pool.dtype.element_ty))
    tl.store(seq_lens + n, tl.load(ncached + n) + 1)


def mla_latent_write_triton(
    proj: torch.Tensor, c_off: int, norm_weight: torch.Tensor, eps: float,
    slot_mapping: torch.Tensor, latent_pool: torch.Tensor, num_cached: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """Decode tokens' latents ``[kv_a_layernorm(c) ; k_pe]`` written into their pages, one launch.

    Reference: ``MLAMixer.latents`` + the ``latent_pool[slot_mapping] = lat`` write of
    ``MLAMixer.forward`` (RMSNorm in float32, rounded once; ``k_pe`` copied).

    Args:
        proj: ``[N, ≥ c_off + DC + DR]`` rows holding ``[c ; k_pe]`` at column ``c_off``
            (``kv_a_proj_with_mqa`` output, possibly a column slice of a wider GEMM).
        norm_weight: ``[DC]`` ``kv_a_layernorm`` weight; eps: its epsilon.
        slot_mapping: ``[N]`` flat latent slot per token; latent_pool: ``[P, B, DC + DR]``
            contiguous (written in place).
        num_cached: ``[N]`` int cached tokens per sequence (one new token each).

    Returns:
        ``seq_lens [N]`` = ``num_cached + 1`` (same dtype), what the decode kernel attends.
    """
    n = proj.shape[0]
    dc = norm_weight.shape[0]
    d = latent_pool.shape[-1]
    if not latent_pool.is_contiguous() or proj.stride(1) != 1 or proj.shape[1] < c_off + d:
        raise ValueError("latent_pool: must be contiguous; proj: columns contiguous and wide "
                         "enough for [c ; k_pe] at c_off")  # fmt: skip
    seq_lens = torch.empty_like(num_cached)
    if n:
        _mla_latent_write_kernel[(n,)](
            proj, norm_weight, slot_mapping, latent_pool, num_cached, seq_lens, proj.stride(0),
            c_off, float(eps), DC=dc, DR=d - dc, num_warps=4,
        )  # fmt: skip
    return seq_lens


@triton.jit
def _mla_absorb_q_kernel(q, w, out, N, s_qn, s_wh, s_wd, s_on, s_oh,
                         DN: tl.constexpr, DR: tl.constexpr, DC: tl.constexpr,
                         BN: tl.constexpr, BK: tl.constexpr, BC: tl.constexpr,
                         LOWP: tl.constexpr):  # fmt: skip
    h = tl.program_id(0).to(tl.int64)
    c0 = tl.program_id(1) * BC
    rows = tl.program_id(2) * BN + tl.arange(0, BN)
    m_n = rows < N
    o_c = c0 + tl.arange(0, BC)
    acc = tl.zeros((BN, BC), dtype=tl.float32)
    for k0 in tl.static_range(0, DN, BK):
        o_k = k0 + tl.arange(0, BK)
        a = tl.load(q + rows.to(tl.int64)[:, None] * s_qn + h * (DN + DR) + o_k[None, :],
                    mask=m_n[:, None], other=0.0)  # fmt: skip
        b = tl.load(w + h * s_wh + o_k[:, None] * s_wd + o_c[None, :])
        if LOWP:  # bf16 × bf16 products are exact in the fp32 accumulator
            acc = tl.dot(a, b, acc)
        else:
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    p_o = out + rows.to(tl.int64)[:, None] * s_on + h * s_oh
    tl.store(p_o + o_c[None, :], acc.to(out.dtype.element_ty), mask=m_n[:, None])
    if c0 == 0:
        o_r = tl.arange(0, DR)
        pe = tl.load(q + rows.to(tl.int64)[:, None] * s_qn + h * (DN + DR) + DN + o_r[None, :],
                     mask=m_n[:, None], other=0.0)  # fmt: skip
        tl.store(p_o + DC + o_r[None, :], pe.to(out.dtype.element_ty), mask=m_n[:, None])


def mla_absorb_q_triton(q: torch.Tensor, kv_b_weight: torch.Tensor, num_heads: int, qk_nope: int,
                        out_dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
    """Absorbed decode queries ``[W_ukᵀ q_nope ; q_pe]`` in one launch (``MLAMixer.absorbed_query``:
    products in float32), rounded to ``out_dtype`` (the dtype the decode kernel multiplies in).

    Args:
        q: ``[N, H·(nope + rope)]`` (rows may be strided).
        kv_b_weight: ``[H·(nope + v), DC]`` ``kv_b_proj.weight``; rows ``[0, nope)`` of each
            head are ``W_uk``.
        num_heads, qk_nope: H and the no-position width.

    Returns:
        ``[N, H, DC + rope]`` in ``out_dtype``.
    """
    n = q.shape[0]
    h = num_heads
    dqk = q.shape[1] // h
    dr = dqk - qk_nope
    dc = kv_b_weight.shape[1]
    per_head = kv_b_weight.shape[0] // h
    if q.stride(1) != 1 or kv_b_weight.stride(1) != 1:
        raise ValueError("q / kv_b_weight: columns must be contiguous")
    out = torch.empty(n, h, dc + dr, dtype=out_dtype, device=q.device)
    if n:
        lowp = _lowp(q, kv_b_weight)
        bk = 64 if qk_nope % 64 == 0 else 16
        bc = min(dc, 128)
        _mla_absorb_q_kernel[(h, dc // bc, triton.cdiv(n, 16))](
            q, kv_b_weight, out, n, q.stride(0), per_head * kv_b_weight.stride(0),
            kv_b_weight.stride(0), out.stride(0), out.stride(1),
            DN=qk_nope, DR=dr, DC=dc, BN=16, BK=bk, BC=bc, LOWP=lowp, num_warps=4,
        )  # fmt: skip
    return out


@triton.jit
def _mla_absorb_out_kernel(o_lat, w, gate, out, N, s_ln, s_lh, s_wh, s_wv, s_gn, s_on,
                           DC: tl.constexpr, DV: tl.constexpr, BN: tl.constexpr,
                           BK: tl.constexpr, BV: tl.constexpr, HAS_G: tl.constexpr,
                           LOWP: tl.constexpr):  # fmt: skip
    h = tl.program_id(0).to(tl.int64)
    o_v = tl.program_id(1) * BV + tl.arange(0, BV)
    rows = tl.program_id(2) * BN + tl.arange(0, BN)
    m_n = rows < N
    acc = tl.zeros((BN, BV), dtype=tl.float32)
    for k0 in tl.static_range(0, DC, BK):
        o_k = k0 + tl.arange(0, BK)
        a = tl.load(o_lat + rows.to(tl.int64)[:, None] * s_ln + h * s_lh + o_k[None, :],
                    mask=m_n[:, None], other=0.0).to(tl.float32)  # fmt: skip
        b = tl.load(w + h * s_wh + o_v[None, :] * s_wv + o_k[:, None])
        if LOWP:  # float32 ô as bf16 hi + lo (≈ 16 significant bits) times the bf16 weight
            a_hi = a.to(b.dtype)
            a_lo = (a - a_hi.to(tl.float32)).to(b.dtype)
            acc = tl.dot(a_hi, b, acc)
            acc = tl.dot(a_lo, b, acc)
        else:
            acc = tl.dot(a, b.to(tl.float32), acc, input_precision="ieee")
    DT = out.dtype.element_ty
    o = acc.to(DT)
    if HAS_G:  # o ⊙ σ(g) in the model dtype, as the torch expression rounds
        g = tl.load(gate + rows.to(tl.int64)[:, None] * s_gn + h * DV + o_v[None, :],
                    mask=m_n[:, None], other=0.0).to(tl.float32)  # fmt: skip
        o = (o.to(tl.float32) * tl.sigmoid(g).to(DT).to(tl.float32)).to(DT)
    tl.store(out + rows.to(tl.int64)[:, None] * s_on + h * DV + o_v[None, :], o,
             mask=m_n[:, None])  # fmt: skip


def mla_absorb_out_triton(o_lat: torch.Tensor, kv_b_weight: torch.Tensor, qk_nope: int,
                          gate: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
    """``o = W_uv ô`` per head (``MLAMixer.absorbed_output``: float32; with a bf16 weight ô is
    split into bf16 high + low parts for the tensor cores, ~16 significant bits), rounded to
    ``out_dtype``, times ``σ(gate)`` when given (K3's output gate, in ``out_dtype`` as the
    torch ``o * sigmoid(g)`` rounds), in one launch.

    Args:
        o_lat: ``[N, H, DC]`` float32 latent outputs of the decode kernel.
        kv_b_weight: ``[H·(nope + v), DC]``; rows ``[nope, nope + v)`` of each head are ``W_uv``.
        qk_nope: nope width; gate: ``[N, H·v]`` pre-sigmoid (rows may be strided) or None.

    Returns:
        ``[N, H·v]`` in ``out_dtype`` (ready for ``o_proj``).
    """
    n, h, dc = o_lat.shape
    per_head = kv_b_weight.shape[0] // h
    dv = per_head - qk_nope
    if o_lat.stride(2) != 1 or kv_b_weight.stride(1) != 1 or (gate is not None and gate.stride(1) != 1):
        raise ValueError("o_lat / kv_b_weight / gate: last dims must be contiguous")
    out = torch.empty(n, h * dv, dtype=out_dtype, device=o_lat.device)
    if n:
        w_uv = kv_b_weight[qk_nope:]  # row offset of W_uv in head 0; head stride below
        bv = min(dv, 64)
        _mla_absorb_out_kernel[(h, dv // bv, triton.cdiv(n, 16))](
            o_lat, w_uv, gate if gate is not None else out, out, n, o_lat.stride(0),
            o_lat.stride(1), per_head * kv_b_weight.stride(0), kv_b_weight.stride(0),
            gate.stride(0) if gate is not None else 0, out.stride(0),
            DC=dc, DV=dv, BN=16, BK=64 if dc % 64 == 0 else 16, BV=bv, HAS_G=gate is not None,
            LOWP=kv_b_weight.dtype in (torch.bfloat16, torch.float16)
            and os.environ.get("TRITON_INTERPRET") != "1",
            num_warps=4,
        )  # fmt: skip
    return out


__all__ += ["mla_absorb_out_triton", "mla_absorb_q_triton", "mla_latent_write_triton"]
