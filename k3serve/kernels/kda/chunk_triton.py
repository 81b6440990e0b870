"""Chunked KDA prefill in Triton (forward only): varlen, initial/final states, fused bounded gate.

Same algebra as ``chunk.py`` (Kimi Linear arXiv 2510.26692 §4; see that module's docstring),
in three launches (four with ``KNOBS["fuse_gate"] = 0``), split the way fla-core splits its
``chunk_kda`` forward::

    1. _intra         per (chunk, head): G = in-chunk cumsum of g (optionally g = gate(f)),
                      Aqk and β·Akk (16-token sub-chunks), then T = (I + β·Akk)⁻¹ once as a
                      64×64 matrix (the four 16×16 diagonal inverses in one forward
                      substitution, then ``_block_solve`` with the identity on the right), and
                      W = T·β(exp(G)⊙K), Ũ = T·βV as 64-row products, Kd = K ⊙ exp(G_C − G)
    2. _state         per (sequence, head, V-block), sequential over chunks:
                      h_c = S;  v_new = Ũ − W S;  S ← diag(exp(G_C)) S + Kdᵀ v_new
    3. _output        per (chunk, head, V-block): O = (exp(G)⊙Q·scale) h_c + Aqk v_new

Inside a kernel, tensors are addressed from a 64-bit scalar base (the chunk's first row) plus
32-bit tile offsets: 64-bit offset tiles cost two registers per element and made run 4's intra
kernel spill (255 registers and a 736-byte stack in Triton 3.9's sm_90 build at 4 warps).

Decay factorisation. Pairwise decays ``exp(G_t − G_i)`` (i ≤ t) enter as matmuls: for the
queries of sub-chunk ``s`` the exponent is split at a reference row ``m`` in the middle of
``s`` — ``(G_t − G_m) + (G_m − G_i)`` — so each factor has an exponent of at most
``8·|g|max`` in size (``KNOBS["a_cols"] = 1`` keeps that split for the diagonal blocks only
and splits the blocks below the diagonal at the last row of the key block, where both factors
are ≤ 1). That is exact and finite for any gate with ``g ≥ −10`` per step (K3's
bounded gate ``g > lb = −5`` gives factors within e^±40; the same premise as fla's
``safe_gate``). Per-step log-decays below ``G_MIN = −10`` (a kept fraction < 4.5e-5) are
clamped to −10 — the only departure from ``chunk_kda``, and only for unbounded gates.

Dtypes: q, k, v (bf16/fp16/fp32, "io dtype") feed the tensor cores; g, G, β and all states
are fp32; intermediates W, Ũ, Kd, v_new, h and Aqk are stored in the io dtype (as fla does).
fp32 inputs run every product in IEEE fp32 (for tests); bf16 inputs use bf16/tf32 products.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from k3serve.kernels.kda.naive import check_kda_inputs

G_MIN = -10.0
BT = 64  # chunk
BC = 16  # sub-chunk

# Launch knobs and code paths (``*_stages`` None = Triton's default). Set from the H200 runs in
# ``benchmarks/RESULTS_gpu_kernels.md``; ``benchmarks/gpu_kda_prefill_ab.py`` (intra kernel) and
# ``benchmarks/gpu_kernels_sweep.py`` (state / output) vary them.
KNOBS: dict[str, int | None] = {
    # intra kernel: run 5's best of 10 (4 warps, no software pipelining, 64-wide Aqk/Akk steps,
    # 32-wide W/Ũ steps; 8 warps were 1.2–1.5× slower)
    "intra_warps": 4,
    "intra_stages": 1,
    "intra_bk": 64,  # K columns per step of the intra kernel's Aqk / Akk products
    "intra_bw": 32,  # K / V columns per step of its W = T·R, Ũ = T·R products
    "wy_lowp": 0,  # 1: W = T·R and Ũ = T·R with T, R in the io dtype (bf16), as fla does; 0: tf32
    "fuse_gate": 1,  # 1: the gate + cumsum run inside the intra kernel (no separate launch)
    "a_cols": 0,  # 1: Aqk / Akk by 64-row products (diagonal blocks, then column strips)
    "state_bv": 32,  # V columns per state program (for K > 64; 64 otherwise)
    "state_warps": 4,
    "state_stages": None,
    "out_bv": 64,
    "out_warps": 4,
    "out_stages": None,
}


def _launch(warps, stages) -> dict:
    kw = {"num_warps": warps}
    if stages is not None:
        kw["num_stages"] = stages
    return kw


# ----------------------------------------------------------------------------- kernels


@triton.jit
def _gate_cumsum_tile(g, A_log, dt_bias, lower_bound, p, m_t, i_h, o_k, GATE: tl.constexpr,
                      HAS_BIAS: tl.constexpr, G_MIN: tl.constexpr):
    """In-chunk cumsum (axis 0) of the ``[BT, BK]`` log-decay tile at offsets ``p``, fp32.

    GATE 0: g given; 1: ``lb·σ(exp(A)·(f+b))`` (K3); 2: ``−exp(A)·softplus(f+b)`` (Kimi Linear).
    ``dt_bias`` points at head ``i_h``'s K biases; rows outside ``m_t`` contribute 0.
    """
    b_g = tl.load(g + p, mask=m_t[:, None], other=0.0).to(tl.float32)
    if GATE != 0:
        if HAS_BIAS:
            b_g = b_g + tl.load(dt_bias + o_k).to(tl.float32)[None, :]
        a = tl.exp(tl.load(A_log + i_h).to(tl.float32))
        if GATE == 1:
            b_g = lower_bound * tl.sigmoid(a * b_g)
        else:
            sp = tl.where(b_g > 20.0, b_g, tl.log(1.0 + tl.exp(tl.minimum(b_g, 20.0))))
            b_g = -a * sp
        b_g = tl.where(m_t[:, None], b_g, 0.0)
    b_g = tl.maximum(b_g, G_MIN)
    return tl.cumsum(b_g, axis=0)


@triton.jit
def _gate_cumsum_kernel(
    g,
    G,
    A_log,
    dt_bias,
    lower_bound,
    cu,
    cidx,
    H: tl.constexpr,
    K: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    GATE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    G_MIN: tl.constexpr,
):
    """G = in-chunk cumsum of the (optionally fused) gate; only when ``KNOBS["fuse_gate"]`` is off."""
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    i_n = tl.load(cidx + 2 * i_c).to(tl.int64)
    i_j = tl.load(cidx + 2 * i_c + 1).to(tl.int64)
    bos, eos = tl.load(cu + i_n).to(tl.int64), tl.load(cu + i_n + 1).to(tl.int64)
    t0 = bos + i_j * BT
    L = tl.minimum(eos - t0, BT)
    o_t = tl.arange(0, BT)
    m_t = o_t < L
    for kb in tl.static_range(0, K, BK):
        o_k = kb + tl.arange(0, BK)
        p = ((t0 + o_t[:, None]) * H + i_h) * K + o_k[None, :]
        b_G = _gate_cumsum_tile(g, A_log, dt_bias + i_h * K, lower_bound, p, m_t, i_h, o_k, GATE, HAS_BIAS, G_MIN)
        tl.store(G + p, b_G, mask=m_t[:, None])


@triton.jit
def _inv_diag16_x4(A, L, SA: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    """(I + N_b)⁻¹ of the four 16×16 diagonal blocks of β·Akk at once, as a ``[4, 16, 16]`` tile.

    ``A`` points at the chunk's first row of β·Akk (row stride ``SA``). Forward substitution, one
    row of every block per step (14 steps for the four blocks, not 4 × 14):
    ``X_i = a_i + Σ_{m<i} a_i[m] X_m`` with ``a_i = −N[i, :i]``; rows ≥ L are identity.
    """
    o_b = tl.arange(0, BT // BC)
    o = tl.arange(0, BC)
    rows = o_b[:, None, None] * BC + o[None, :, None]
    m = (rows < L) & (o[None, None, :] < o[None, :, None])
    X = -tl.load(A + rows * SA + o_b[:, None, None] * BC + o[None, None, :], mask=m, other=0.0)
    r2 = o_b[:, None] * BC
    p2 = A + r2 * SA + r2 + o[None, :]
    for i in tl.static_range(2, BC):
        a = -tl.load(p2 + i * SA, mask=((r2 + i) < L) & (o[None, :] < i), other=0.0)
        a = a + tl.sum(a[:, :, None] * X, 1)
        X = tl.where((o == i)[None, :, None], a[:, None, :], X)
    return X + (o[:, None] == o[None, :]).to(tl.float32)[None, :, :]


@triton.jit
def _block_solve(Ai0, Ai1, Ai2, Ai3, L10, L20, L21, L30, L31, L32, R0, R1, R2, R3, PREC: tl.constexpr):
    """X = (I + β·Akk)⁻¹ R for a 64-row chunk by 16-row blocks: ``X_i = Ai_i (R_i − Σ_j<i L_ij X_j)``."""
    X0 = tl.dot(Ai0, R0, input_precision=PREC)
    X1 = tl.dot(Ai1, R1 - tl.dot(L10, X0, input_precision=PREC), input_precision=PREC)
    X2 = tl.dot(
        Ai2,
        R2 - tl.dot(L20, X0, input_precision=PREC) - tl.dot(L21, X1, input_precision=PREC),
        input_precision=PREC,
    )
    X3 = tl.dot(
        Ai3,
        R3
        - tl.dot(L30, X0, input_precision=PREC)
        - tl.dot(L31, X1, input_precision=PREC)
        - tl.dot(L32, X2, input_precision=PREC),
        input_precision=PREC,
    )
    return X0, X1, X2, X3


@triton.jit
def _load_blk16(A, r0: tl.constexpr, c0: tl.constexpr, L, SA: tl.constexpr, BC: tl.constexpr):
    o = tl.arange(0, BC)
    return tl.load(A + (r0 + o[:, None]) * SA + c0 + o[None, :], mask=(r0 + o[:, None]) < L, other=0.0)


@triton.jit
def _pick(X, b: tl.constexpr):
    """Block ``b`` of a ``[NB, 16, 16]`` tile as a ``[16, 16]`` tile."""
    return tl.sum(tl.where((tl.arange(0, X.shape[0]) == b)[:, None, None], X, 0.0), 0)


@triton.jit
def _eye_rows(r0: tl.constexpr, BC: tl.constexpr, BT: tl.constexpr):
    """Rows ``r0 … r0+15`` of the 64×64 identity, ``[16, 64]`` fp32."""
    return ((r0 + tl.arange(0, BC))[:, None] == tl.arange(0, BT)[None, :]).to(tl.float32)


@triton.jit
def _a_by_rows(
    q, k, G, beta, Aqk, Akk, L, scale, SK: tl.constexpr, SA: tl.constexpr, H: tl.constexpr,
    K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr,
):
    """Aqk and β·Akk of one chunk by 16-row strips: strip s against columns ≤ its last row, with
    the reference row in the middle of s for both factors (exponents ≤ 8·|g|max, see the module
    docstring). Pointers are at the chunk's first row."""
    o_r = tl.arange(0, BC)
    o_c = tl.arange(0, BT)
    m_t = o_c < L
    for s in range(BT // BC):
        rows = s * BC + o_r
        m_r = rows < L
        m_c = (o_c < (s + 1) * BC) & m_t
        ref = tl.minimum(s * BC + BC // 2, L - 1)
        b_aq = tl.zeros([BC, BT], dtype=tl.float32)
        b_ak = tl.zeros([BC, BT], dtype=tl.float32)
        for k0 in range(0, K, BK):
            o_k = k0 + tl.arange(0, BK)
            p_r = rows[:, None] * SK + o_k[None, :]
            p_c = o_c[:, None] * SK + o_k[None, :]
            b_Gm = tl.load(G + ref * SK + o_k)
            b_Gr = tl.load(G + p_r, mask=m_r[:, None], other=0.0)
            e_r = tl.exp(tl.where(m_r[:, None], b_Gr - b_Gm[None, :], 0.0))
            b_q = tl.load(q + p_r, mask=m_r[:, None], other=0.0).to(tl.float32) * (e_r * scale)
            b_kr = tl.load(k + p_r, mask=m_r[:, None], other=0.0).to(tl.float32) * e_r
            b_Gc = tl.load(G + p_c, mask=m_c[:, None], other=0.0)
            e_c = tl.exp(tl.where(m_c[:, None], b_Gm[None, :] - b_Gc, 0.0))
            b_kc = tl.load(k + p_c, mask=m_c[:, None], other=0.0).to(tl.float32) * e_c
            b_kc = tl.where(m_c[:, None], b_kc, 0.0)
            b_aq += tl.dot(b_q, tl.trans(b_kc), input_precision=PREC)
            b_ak += tl.dot(b_kr, tl.trans(b_kc), input_precision=PREC)
        m_valid = m_r[:, None] & m_t[None, :]
        b_aq = tl.where(m_valid & (o_c[None, :] <= rows[:, None]), b_aq, 0.0)
        b_beta = tl.load(beta + rows * H, mask=m_r, other=0.0).to(tl.float32)
        b_ak = tl.where(m_valid & (o_c[None, :] < rows[:, None]), b_ak * b_beta[:, None], 0.0)
        p_A = rows[:, None] * SA + o_c[None, :]
        tl.store(Aqk + p_A, b_aq.to(Aqk.dtype.element_ty), mask=m_r[:, None])
        tl.store(Akk + p_A, b_ak, mask=m_r[:, None])


@triton.jit
def _a_by_columns(
    q, k, G, beta, Aqk, Akk, L, scale, SK: tl.constexpr, SA: tl.constexpr, H: tl.constexpr,
    K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr,
):
    """Aqk and β·Akk of one chunk with 64-row products: the four diagonal 16×16 blocks in one
    64×64 product (each row and column scaled about the middle row of its own block, so only the
    diagonal blocks are kept), then column block j against the rows below it, about j's last row
    (both factors ≤ 1, exact for any gate). Pointers are at the chunk's first row."""
    o_r = tl.arange(0, BC)
    o_c = tl.arange(0, BT)
    m_t = o_c < L
    blk = o_c // BC
    r_m = tl.minimum(blk * BC + BC // 2, L - 1)
    b_aq = tl.zeros([BT, BT], dtype=tl.float32)
    b_ak = tl.zeros([BT, BT], dtype=tl.float32)
    for k0 in range(0, K, BK):
        o_k = k0 + tl.arange(0, BK)
        p = o_c[:, None] * SK + o_k[None, :]
        b_G = tl.load(G + p, mask=m_t[:, None], other=0.0)
        d = tl.where(m_t[:, None], b_G - tl.load(G + r_m[:, None] * SK + o_k[None, :]), 0.0)
        e = tl.exp(d)
        b_k = tl.load(k + p, mask=m_t[:, None], other=0.0).to(tl.float32)
        b_kt = tl.where(m_t[:, None], b_k * tl.exp(-d), 0.0)
        b_qe = tl.load(q + p, mask=m_t[:, None], other=0.0).to(tl.float32) * (e * scale)
        b_aq += tl.dot(b_qe, tl.trans(b_kt), input_precision=PREC)
        b_ak += tl.dot(b_k * e, tl.trans(b_kt), input_precision=PREC)
    b_beta = tl.load(beta + o_c * H, mask=m_t, other=0.0).to(tl.float32)
    same = blk[:, None] == blk[None, :]
    low = o_c[None, :] <= o_c[:, None]
    p_A = o_c[:, None] * SA + o_c[None, :]
    # diagonal blocks (causal inside) and the zero upper triangle; the strips below fill the rest
    b_aq = tl.where(same & low & m_t[None, :], b_aq, 0.0)
    tl.store(Aqk + p_A, b_aq.to(Aqk.dtype.element_ty), mask=m_t[:, None] & (same | ~low))
    b_ak = tl.where(same & (o_c[None, :] < o_c[:, None]) & m_t[None, :], b_ak * b_beta[:, None], 0.0)
    tl.store(Akk + p_A, b_ak, mask=m_t[:, None] & same)
    for j in tl.static_range(BT // BC - 1):
        c0 = j * BC
        ref = tl.minimum(c0 + BC - 1, L - 1)
        m_o = (o_c >= c0 + BC) & m_t
        m_j = (c0 + o_r) < L
        s_q = tl.zeros([BT, BC], dtype=tl.float32)
        s_k = tl.zeros([BT, BC], dtype=tl.float32)
        for k0 in range(0, K, BK):
            o_k = k0 + tl.arange(0, BK)
            p = o_c[:, None] * SK + o_k[None, :]
            b_gl = tl.load(G + ref * SK + o_k)
            b_G = tl.load(G + p, mask=m_o[:, None], other=0.0)
            e = tl.where(m_o[:, None], tl.exp(tl.where(m_o[:, None], b_G - b_gl[None, :], 0.0)), 0.0)
            p_j = (c0 + o_r[:, None]) * SK + o_k[None, :]
            b_Gj = tl.load(G + p_j, mask=m_j[:, None], other=0.0)
            b_kj = tl.load(k + p_j, mask=m_j[:, None], other=0.0).to(tl.float32)
            b_kj = tl.where(m_j[:, None], b_kj * tl.exp(b_gl[None, :] - b_Gj), 0.0)
            b_qe = tl.load(q + p, mask=m_o[:, None], other=0.0).to(tl.float32) * (e * scale)
            b_ke = tl.load(k + p, mask=m_o[:, None], other=0.0).to(tl.float32) * e
            s_q += tl.dot(b_qe, tl.trans(b_kj), input_precision=PREC)
            s_k += tl.dot(b_ke, tl.trans(b_kj), input_precision=PREC)
        p_S = o_c[:, None] * SA + c0 + o_r[None, :]
        m_S = m_o[:, None] & m_j[None, :]
        tl.store(Aqk + p_S, tl.where(m_S, s_q, 0.0).to(Aqk.dtype.element_ty), mask=m_o[:, None])
        tl.store(Akk + p_S, tl.where(m_S, s_k * b_beta[:, None], 0.0), mask=m_o[:, None])


@triton.jit
def _intra_kernel(
    q,
    k,
    v,
    g,
    beta,
    G,
    A_log,
    dt_bias,
    lower_bound,
    Aqk,
    Akk,
    W,
    U,
    Kd,
    cu,
    cidx,
    scale,
    H: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BT: tl.constexpr,
    BC: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,  # K / V columns per W / Ũ product
    PREC: tl.constexpr,
    FUSE_GATE: tl.constexpr,
    WY_LOWP: tl.constexpr,
    A_COLS: tl.constexpr,
    GATE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    G_MIN: tl.constexpr,
):
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    i_n = tl.load(cidx + 2 * i_c).to(tl.int64)
    i_j = tl.load(cidx + 2 * i_c + 1).to(tl.int64)
    bos, eos = tl.load(cu + i_n).to(tl.int64), tl.load(cu + i_n + 1).to(tl.int64)
    t0 = bos + i_j * BT
    L = tl.minimum(eos - t0, BT).to(tl.int32)
    # the chunk's first row of every [T, H, D] tensor (64-bit scalars); tiles add 32-bit offsets
    hk = (t0 * H + i_h) * K
    q, k, G, g, Kd, W = q + hk, k + hk, G + hk, g + hk, Kd + hk, W + hk
    v, U = v + (t0 * H + i_h) * V, U + (t0 * H + i_h) * V
    Aqk, Akk = Aqk + (t0 * H + i_h) * BT, Akk + (t0 * H + i_h) * BT
    beta = beta + t0 * H + i_h
    SK: tl.constexpr = H * K
    SV: tl.constexpr = H * V
    SA: tl.constexpr = H * BT
    o_r = tl.arange(0, BC)
    o_c = tl.arange(0, BT)
    m_t = o_c < L

    # --- 0. (fused) G = in-chunk cumsum of the gate; read back below through L1/L2
    if FUSE_GATE:
        for kb in tl.static_range(0, K, BK):
            o_g = kb + tl.arange(0, BK)
            p_g = o_c[:, None] * SK + o_g[None, :]
            b_cum = _gate_cumsum_tile(g, A_log, dt_bias + i_h * K, lower_bound, p_g, m_t, i_h, o_g, GATE, HAS_BIAS, G_MIN)
            tl.store(G + p_g, b_cum, mask=m_t[:, None])
        tl.debug_barrier()

    # --- 1. Aqk (i ≤ t, q scaled) and β·Akk (i < t)
    if A_COLS:
        _a_by_columns(q, k, G, beta, Aqk, Akk, L, scale, SK, SA, H, K, BT, BC, BK, PREC)
    else:
        _a_by_rows(q, k, G, beta, Aqk, Akk, L, scale, SK, SA, H, K, BT, BC, BK, PREC)
    tl.debug_barrier()

    # --- 2. T = (I + β·Akk)⁻¹ once, as a 64×64 matrix: the four 16×16 diagonal inverses in one
    #        pass, then the block substitution with the identity on the right (rows of T by blocks)
    X = _inv_diag16_x4(Akk, L, SA, BT, BC)
    T0, T1, T2, T3 = _block_solve(
        _pick(X, 0), _pick(X, 1), _pick(X, 2), _pick(X, 3),
        _load_blk16(Akk, BC, 0, L, SA, BC),
        _load_blk16(Akk, 2 * BC, 0, L, SA, BC),
        _load_blk16(Akk, 2 * BC, BC, L, SA, BC),
        _load_blk16(Akk, 3 * BC, 0, L, SA, BC),
        _load_blk16(Akk, 3 * BC, BC, L, SA, BC),
        _load_blk16(Akk, 3 * BC, 2 * BC, L, SA, BC),
        _eye_rows(0, BC, BT), _eye_rows(BC, BC, BT), _eye_rows(2 * BC, BC, BT), _eye_rows(3 * BC, BC, BT),
        PREC,
    )  # fmt: skip
    tl.debug_barrier()  # every read of β·Akk is done: T overwrites it
    p_T = o_r[:, None] * SA + o_c[None, :]
    tl.store(Akk + p_T, T0, mask=(o_r < L)[:, None])
    tl.store(Akk + BC * SA + p_T, T1, mask=(BC + o_r < L)[:, None])
    tl.store(Akk + 2 * BC * SA + p_T, T2, mask=(2 * BC + o_r < L)[:, None])
    tl.store(Akk + 3 * BC * SA + p_T, T3, mask=(3 * BC + o_r < L)[:, None])
    tl.debug_barrier()
    if WY_LOWP:  # T and the right-hand sides in the io dtype (bf16/fp16 tensor-core products)
        DW = W.dtype.element_ty
    else:
        DW = tl.float32
    b_T = tl.load(Akk + o_c[:, None] * SA + o_c[None, :], mask=m_t[:, None], other=0.0).to(DW)

    # --- 3. W = T·β(exp(G)⊙K), Kd = K ⊙ exp(G_C − G), Ũ = T·βV: one 64-row product each
    b_b = tl.load(beta + o_c * H, mask=m_t, other=0.0).to(tl.float32)
    for kw in range(0, K, BV):
        o_w = kw + tl.arange(0, BV)
        p_w = o_c[:, None] * SK + o_w[None, :]
        b_k = tl.load(k + p_w, mask=m_t[:, None], other=0.0).to(tl.float32)
        b_G = tl.load(G + p_w, mask=m_t[:, None], other=0.0)
        gC = tl.load(G + (L - 1) * SK + o_w)
        tl.store(Kd + p_w, (b_k * tl.exp(gC[None, :] - b_G)).to(Kd.dtype.element_ty), mask=m_t[:, None])
        b_w = tl.dot(b_T, (b_k * tl.exp(b_G) * b_b[:, None]).to(DW), input_precision=PREC)
        tl.store(W + p_w, b_w.to(W.dtype.element_ty), mask=m_t[:, None])
    for vb in range(0, V, BV):
        o_v = vb + tl.arange(0, BV)
        p_v = o_c[:, None] * SV + o_v[None, :]
        b_v = tl.load(v + p_v, mask=m_t[:, None], other=0.0).to(tl.float32)
        b_u = tl.dot(b_T, (b_v * b_b[:, None]).to(DW), input_precision=PREC)
        tl.store(U + p_v, b_u.to(U.dtype.element_ty), mask=m_t[:, None])


@triton.jit
def _state_kernel(
    W,
    U,
    Kd,
    G,
    h,
    vnew,
    h0,
    ht,
    cu,
    coff,
    H: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BT: tl.constexpr,
    BV: tl.constexpr,
    HAS_H0: tl.constexpr,
    STORE_HT: tl.constexpr,
    PREC: tl.constexpr,
):
    i_n, i_h, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_n = i_n.to(tl.int64)
    bos, eos = tl.load(cu + i_n).to(tl.int64), tl.load(cu + i_n + 1).to(tl.int64)
    c0 = tl.load(coff + i_n).to(tl.int64)
    NT = tl.cdiv(eos - bos, BT)
    o_k = tl.arange(0, K)
    o_v = i_v * BV + tl.arange(0, BV)
    o_t = tl.arange(0, BT)
    p_s = ((i_n * H + i_h) * K + o_k[:, None]) * V + o_v[None, :]
    if HAS_H0:
        S = tl.load(h0 + p_s).to(tl.float32)
    else:
        S = tl.zeros([K, BV], dtype=tl.float32)
    DT = W.dtype.element_ty
    for j in range(NT):
        t0 = bos + j * BT
        L = tl.minimum(eos - t0, BT)
        m_t = o_t < L
        tl.store(h + (((c0 + j) * H + i_h) * K + o_k[:, None]) * V + o_v[None, :], S.to(DT))
        b_w = tl.load(W + ((t0 + o_t[:, None]) * H + i_h) * K + o_k[None, :], mask=m_t[:, None], other=0.0)
        p_u = ((t0 + o_t[:, None]) * H + i_h) * V + o_v[None, :]
        b_u = tl.load(U + p_u, mask=m_t[:, None], other=0.0).to(tl.float32)
        b_vn = b_u - tl.dot(b_w, S.to(DT), input_precision=PREC)
        tl.store(vnew + p_u, b_vn.to(DT), mask=m_t[:, None])
        b_kd = tl.load(Kd + ((t0 + o_t[:, None]) * H + i_h) * K + o_k[None, :], mask=m_t[:, None], other=0.0)
        gC = tl.load(G + ((t0 + L - 1) * H + i_h) * K + o_k)
        S = S * tl.exp(gC)[:, None] + tl.dot(tl.trans(b_kd), b_vn.to(DT), input_precision=PREC)
    if STORE_HT:
        tl.store(ht + p_s, S)


@triton.jit
def _output_kernel(
    q,
    G,
    Aqk,
    h,
    vnew,
    o,
    cu,
    cidx,
    scale,
    H: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BT: tl.constexpr,
    BV: tl.constexpr,
    PREC: tl.constexpr,
):
    i_c, i_h, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_n = tl.load(cidx + 2 * i_c).to(tl.int64)
    i_j = tl.load(cidx + 2 * i_c + 1).to(tl.int64)
    bos, eos = tl.load(cu + i_n).to(tl.int64), tl.load(cu + i_n + 1).to(tl.int64)
    t0 = bos + i_j * BT
    L = tl.minimum(eos - t0, BT)
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, K)
    o_v = i_v * BV + tl.arange(0, BV)
    m_t = o_t < L
    DT = vnew.dtype.element_ty
    # 64-bit scalar bases, 32-bit tile offsets (64-bit offset tiles spill registers)
    hk = (t0 * H + i_h) * K
    hv = (t0 * H + i_h) * V
    p_q = o_t[:, None] * (H * K) + o_k[None, :]
    b_q = tl.load(q + hk + p_q, mask=m_t[:, None], other=0.0).to(tl.float32)
    b_G = tl.load(G + hk + p_q, mask=m_t[:, None], other=0.0)
    b_qg = (b_q * tl.exp(b_G) * scale).to(DT)
    b_h = tl.load(h + (i_c.to(tl.int64) * H + i_h) * K * V + o_k[:, None] * V + o_v[None, :])
    b_o = tl.dot(b_qg, b_h, input_precision=PREC)
    b_A = tl.load(
        Aqk + (t0 * H + i_h) * BT + o_t[:, None] * (H * BT) + o_t[None, :],
        mask=m_t[:, None] & m_t[None, :],
        other=0.0,
    ).to(DT)
    p_v = o_t[:, None] * (H * V) + o_v[None, :]
    b_vn = tl.load(vnew + hv + p_v, mask=m_t[:, None], other=0.0)
    b_o += tl.dot(b_A, b_vn, input_precision=PREC)
    tl.store(o + hv + p_v, b_o.to(o.dtype.element_ty), mask=m_t[:, None])


# ----------------------------------------------------------------------------- host side


def _chunk_index(cu_seqlens: torch.Tensor | None, B: int, T: int, device) -> tuple:
    """``(cu [N+1] int64, cidx [NCH, 2] int32 (seq, chunk-in-seq), coff [N+1] int64, NCH)``."""
    if cu_seqlens is None:
        NT = triton.cdiv(T, BT)
        cu = torch.arange(0, B + 1, device=device, dtype=torch.int64) * T
        seq = torch.arange(B, device=device).repeat_interleave(NT)
        j = torch.arange(NT, device=device).repeat(B)
        coff = torch.arange(0, B + 1, device=device, dtype=torch.int64) * NT
        return cu, torch.stack([seq, j], 1).to(torch.int32).contiguous(), coff, B * NT
    cu = cu_seqlens.to(device=device, dtype=torch.int64)
    nts = (cu[1:] - cu[:-1] + BT - 1) // BT
    coff = torch.cat([cu.new_zeros(1), nts.cumsum(0)])
    nch = int(coff[-1])  # one host sync: the grid size
    seq = torch.repeat_interleave(torch.arange(nts.numel(), device=device), nts, output_size=nch)
    j = torch.arange(nch, device=device) - coff[seq]
    return cu, torch.stack([seq, j], 1).to(torch.int32).contiguous(), coff, nch


def chunk_kda_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 64,
    *,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    lower_bound: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    r"""Chunked KDA prefill in Triton; same contract as :func:`k3serve.kernels.kda.chunk_kda`.

    Forward only (no autograd): the serving path. Kimi Linear arXiv 2510.26692 §4.

    Args:
        q (torch.Tensor): ``[B, T, H, K]`` bf16/fp16/fp32 (L2-normalised by the caller).
        k (torch.Tensor): ``[B, T, H, K]``, q's dtype.
        v (torch.Tensor): ``[B, T, H, V]``, q's dtype.
        g (torch.Tensor): ``[B, T, H, K]`` log-decay (any float dtype; read as fp32), or, when
            ``A_log`` is given, the raw gate input ``f`` (the gate is then fused, see below).
        beta (torch.Tensor): ``[B, T, H]``.
        scale (float, optional): default ``K ** -0.5``.
        initial_state (torch.Tensor, optional): ``[N, H, K, V]`` fp32 (read as fp32).
        output_final_state (bool): also return ``[N, H, K, V]`` fp32.
        cu_seqlens (torch.Tensor, optional): ``[N+1]`` (``B == 1``); costs one host sync.
        chunk_size (int): must be 64.
        A_log (torch.Tensor, optional): ``[H]``; fuses ``kda_gate(g, A_log, dt_bias, lower_bound)``.
        dt_bias (torch.Tensor, optional): ``[H * K]``.
        lower_bound (float, optional): K3's bound (e.g. −5); None → Kimi Linear softplus gate.

    Returns:
        ``(o [B, T, H, V]`` in q's dtype, ``final_state [N, H, K, V]`` fp32 or ``None)``.

    Raises:
        ValueError: bad shapes, ``chunk_size != 64``, or K / V not a power of two (≥ 16).
    """
    N = check_kda_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    B, T, H, K = q.shape
    V = v.shape[-1]
    if chunk_size != BT:
        raise ValueError(f"chunk_kda_triton: chunk_size must be {BT}, got {chunk_size}")
    for name, d in (("K", K), ("V", V)):
        if d < 16 or d & (d - 1):
            raise ValueError(f"chunk_kda_triton: {name}={d} must be a power of two >= 16")
    if scale is None:
        scale = K**-0.5
    dev = q.device
    io = q.dtype
    if not (k.dtype == v.dtype == io):
        raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    prec = "ieee" if io == torch.float32 else "tf32"
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    cu, cidx, coff, nch = _chunk_index(cu_seqlens, B, T, dev)
    o = torch.empty(B, T, H, V, dtype=io, device=dev)
    ht = torch.empty(N, H, K, V, dtype=torch.float32, device=dev) if output_final_state else None
    if nch == 0:
        if ht is not None:
            ht.copy_(initial_state if initial_state is not None else torch.zeros_like(ht))
        return o, ht
    BK = min(KNOBS["intra_bk"], K)
    BV = min(KNOBS["out_bv"], V)
    Gc = torch.empty(B, T, H, K, dtype=torch.float32, device=dev)
    gate = 0 if A_log is None else (1 if lower_bound is not None else 2)
    gargs = (g, A_log if A_log is not None else g, dt_bias if dt_bias is not None else g, float(lower_bound or 0.0))
    gkw = {"GATE": gate, "HAS_BIAS": dt_bias is not None, "G_MIN": G_MIN}
    fuse = bool(KNOBS["fuse_gate"])
    if not fuse:
        _gate_cumsum_kernel[(nch, H)](g, Gc, *gargs[1:], cu, cidx, H=H, K=K, BT=BT, BK=BK, **gkw)
    Aqk = torch.empty(B, T, H, BT, dtype=io, device=dev)
    Akk = torch.empty(B, T, H, BT, dtype=torch.float32, device=dev)  # β·Akk, then T in place
    W = torch.empty(B, T, H, K, dtype=io, device=dev)
    Kd = torch.empty(B, T, H, K, dtype=io, device=dev)
    U = torch.empty(B, T, H, V, dtype=io, device=dev)
    _intra_kernel[(nch, H)](
        q, k, v, gargs[0], beta, Gc, *gargs[1:], Aqk, Akk, W, U, Kd, cu, cidx, scale,
        H=H, K=K, V=V, BT=BT, BC=BC, BK=BK, BV=min(KNOBS["intra_bw"], K, V), PREC=prec, FUSE_GATE=fuse,
        WY_LOWP=bool(KNOBS["wy_lowp"]) and io != torch.float32, A_COLS=bool(KNOBS["a_cols"]), **gkw,
        **_launch(KNOBS["intra_warps"], KNOBS["intra_stages"]),
    )  # fmt: skip
    h = torch.empty(nch, H, K, V, dtype=io, device=dev)
    vnew = torch.empty(B, T, H, V, dtype=io, device=dev)
    BVs = min(KNOBS["state_bv"] if K > 64 else 64, V)
    h0 = initial_state.contiguous() if initial_state is not None else None
    _state_kernel[(N, H, triton.cdiv(V, BVs))](
        W, U, Kd, Gc, h, vnew, h0 if h0 is not None else h, ht if ht is not None else h, cu, coff,
        H=H, K=K, V=V, BT=BT, BV=BVs, HAS_H0=h0 is not None, STORE_HT=ht is not None, PREC=prec,
        **_launch(KNOBS["state_warps"], KNOBS["state_stages"]),
    )  # fmt: skip
    _output_kernel[(nch, H, triton.cdiv(V, BV))](
        q, Gc, Aqk, h, vnew, o, cu, cidx, scale,
        H=H, K=K, V=V, BT=BT, BV=BV, PREC=prec, **_launch(KNOBS["out_warps"], KNOBS["out_stages"]),
    )  # fmt: skip
    return o, ht


__all__ = ["G_MIN", "KNOBS", "chunk_kda_triton"]
