"""Chunked KDA prefill in Triton (forward only): varlen, initial/final states, fused bounded gate.

Same algebra as ``chunk.py`` (Kimi Linear arXiv 2510.26692 §4; see that module's docstring),
in three launches (four with ``KNOBS["fuse_gate"] = 0``, five with the state pass in segments),
split the way fla-core splits its ``chunk_kda`` forward::

    1. _intra         per (chunk, head): G = in-chunk cumsum of g (optionally g = gate(f)),
                      Aqk and β·Akk (16-token sub-chunks), then T = (I + β·Akk)⁻¹ once as a
                      64×64 matrix (the four 16×16 diagonal inverses in one forward
                      substitution, then ``_block_solve`` with the identity on the right), and
                      W = T·β(exp(G)⊙K), Ũ = T·βV as 64-row products, Kd = K ⊙ exp(G_C − G)
    2. _state         per (sequence, head, V-block), sequential over chunks:
                      h_c = S;  v_new = Ũ − W S;  S ← diag(exp(G_C)) S + Kdᵀ v_new
    3. _output        per (chunk, head, V-block): O = (exp(G)⊙Q·scale) h_c + Aqk v_new

When a batch has few (sequence, head, V-block) programs (one long prompt at K3's 12 heads per
GPU: 48), step 2 runs in segments of chunks instead (``_plan``/``_state_segments``): the
recurrence is affine in the state, ``S_end = M S_start + B`` over a segment, so

    2a. _state MODE 2 per (segment, head, column block of [M | B]): M from identity columns
                      without the Ũ term, B from zero with it (segments in parallel)
    2b. _seg_scan     per (sequence, head, V-block): S_start(s+1) = M_s S_start(s) + B_s
    2c. _state MODE 1 per (segment, head, V-block): step 2 from S_start(s)

(about 3× the state-pass FLOPs for ~#segments× the parallelism). For long layouts with few state programs
(``KNOBS["pipe"]``, T 32k at H 12 / 16) the chunk list is instead cut into pieces that are
pipelined (``_Plan.pieces``): the state pass (``_state`` MODE 3, the state crossing pieces
through ``S0``) and the output of piece p run on a side stream while the intra kernel does
piece p + 1. ``KNOBS["fuse_out"]`` folds
step 3 into step 2 / 2c (no h / v_new round trip through HBM). The chunk and segment tables
are cached per layout: per ``cu_seqlens`` tensor for as long as that tensor lives (a CUDA graph
that captured a launch keeps reading the tables it was given, so they must not be freed while
the graph's ``cu_seqlens`` can still be replayed), per ``(B, T)`` for fixed-length batches.

Inside a kernel, tensors are addressed from a 64-bit scalar base (the chunk's first row) plus
32-bit tile offsets: 64-bit offset tiles cost two registers per element and made an earlier intra
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

K3-gate mode (``KNOBS["k3_diag32"]``). fla-core 0.6.0's ``chunk_kda`` is faster with
``safe_gate=True`` than with g given because only then does it compute the diagonal 16×16
blocks by a tensor-core product about a reference row (``chunk_kda_fwd_kernel_intra_sub_chunk``
in ``fla/ops/kda/chunk_intra.py``, legal for log-gates in [lower_bound, 0) with
lower_bound ≥ −5); with g given it takes a token-parallel kernel (one program per token,
per-pair exponentials, no tensor cores). This module factorises in both modes already (the
G_MIN clamp). What K3's bound adds here is the block size: about the middle row of a 32-row
block every factor is within e^(16·5) = e^80 < 3.4e38 (fp32's largest, e^88.7), so Aqk / β·Akk
run as two 32×32 diagonal blocks plus the block below them (factors ≤ 1 there) — fewer
exponentials than 16-row strips (128 or 192 rows per K column against 240). Unbounded gates
(G_MIN −10: e^160) cannot take this path. Measured slower on the H200 (docs/results/gpu_kernels.md): off by default.

Dtypes: q, k, v (bf16/fp16/fp32, "io dtype") feed the tensor cores; g, G, β and all states
are fp32; intermediates W, Ũ, Kd, v_new, h and Aqk are stored in the io dtype (as fla does).
fp32 inputs run every product in IEEE fp32 (for tests); bf16 inputs use bf16/tf32 products.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import weakref
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from k3serve.kernels.kda.naive import check_kda_inputs

G_MIN = -10.0
BT = 64  # chunk
BC = 16  # sub-chunk

# Launch knobs and code paths (``*_stages`` None = Triton's default). Set from the H200 sweeps in
# ``docs/results/gpu_kernels.md``; ``benchmarks/gpu_kda_prefill_ab.py`` (intra kernel) and
# ``benchmarks/gpu_kernels_sweep.py`` (state / output) vary them.
KNOBS: dict[str, int | None] = {
    # intra kernel: the best of a 10-variant sweep (4 warps, no software pipelining, 64-wide Aqk/Akk steps,
    # 32-wide W/Ũ steps; 8 warps were 1.2–1.5× slower); the best of a later 33-variant sweep adds a_tri, t_regs,
    # wy_lowp and the register cap (intra_split, inv_x4 0, 8 warps, 2 stages, BK 32: slower)
    "intra_warps": 4,
    "intra_stages": 1,
    "intra_bk": 64,  # K columns per step of the intra kernel's Aqk / Akk products
    "intra_bw": 32,  # K / V columns per step of its W = T·R, Ũ = T·R products
    # 1: W = T·R and Ũ = T·R with T, R in the io dtype (bf16), as fla does; 0: tf32 (1 is
    # 1–3 % faster with the register cap below, error 5.5e-3 → 6.1e-3 vs the fp32 reference)
    "wy_lowp": 1,
    "fuse_gate": 1,  # 1: the gate + cumsum run inside the intra kernel (no separate launch)
    "a_cols": 0,  # 1: Aqk / Akk by 64-row products (diagonal blocks, then column strips)
    "a_tri": 1,  # 1: each 16-row strip of Aqk / β·Akk against only the columns it needs
    "inv_x4": 1,  # 1: the four 16×16 diagonal inverses in one [4, 16, 16] pass; 0: one at a time
    # 1: T = (I + β·Akk)⁻¹ stays in registers (its four 16-row blocks joined into one 64×64
    # tile, no store / barrier / reload through global memory); only with intra_split 0
    "t_regs": 1,
    # 1: W, Ũ, Kd in a second launch (``_wy_kernel``, its own warps / stages / registers), the
    # intra kernel stopping at T (stored fp32); 0: all in the intra kernel
    "intra_split": 0,
    "wy_split": 1,  # with intra_split: programs per (chunk, head), 2 = W/Kd and Ũ apart
    "wy_warps": 4,
    "wy_stages": None,
    "wy_bw": 32,  # K / V columns per step of _wy_kernel's products
    # ptxas register cap of the intra kernel (None: the compiler's pick, ~160 at 4 warps = 3
    # programs per SM). 96 (5 programs per SM, some spilling) was the fastest of None /
    # 128 / 112 / 96 at every shape from T 8k H 32 up; 112 by ≤ 2 % at T 8k H 12 / 16
    "intra_maxnreg": 96,
    "wy_maxnreg": None,
    "state_maxnreg": None,
    "out_maxnreg": None,
    "state_bv": 32,  # V columns per state program (for K > 64; 64 otherwise)
    "state_warps": 4,
    "state_stages": None,
    "state_bv_wide": 64,  # V columns per state program when programs are many (0: never)
    "state_bv_wide_progs": 256,  # … i.e. when N·H·V/64 reaches this (tuned at varlen 64×512 H 16)
    "state_seg": 0,  # state pass in segments of this many chunks; 0 auto (few programs), -1 off
    "state_split_below": 64,  # auto: split only when N·H·V-blocks < this (48 at H 12 splits) …
    "state_progs": 384,  # … into about this many programs …
    "seg_min": 64,  # … with segments of at least this many chunks …
    "seg_count_min": 4,  # … and at least this many segments in the longest sequence
    # pipelined pieces (``_pipe_pieces``): the chunk list cut into pieces; piece p's state pass and
    # output on a side stream while the intra kernel does piece p + 1. 0 off; 1 auto (when the
    # state pass has fewer than pipe_below programs; replaces the segments there); 2 always
    # Measured (8 pieces, intra at cap 128): −10 % at T 32k H 16, −3.5 % at T 32k H 12 (64
    # and 48 programs); +4 % at T 32k H 32 (128 programs) and 1.8–3.6× slower at T 8k (~3
    # launches per piece: the host's launch time then exceeds the GPU work, inferred), hence the
    # auto rule below. Not A/B'd in one call with the final intra settings (+1 % / −2 % vs the
    # unpipelined times of another call: within the spread between calls)
    "pipe": 1,
    "pipe_below": 128,
    "pipe_min_nch": 256,  # … and only for layouts of at least this many chunks (T ≥ 16k)
    "pipe_pieces": 8,
    "pipe_min_chunks": 16,  # … with at least this many chunks per piece
    "scan_bv": 32,  # V columns per program of the scan over segments
    "scan_warps": 8,
    # 1: the output O = QgS + Aqk·v_new inside the state pass (no h / v_new round trip); off: at
    # Triton's default 3 stages it asks 241 KB of shared memory on the H200 (232 KB)
    "fuse_out": 0,
    "out_bv": 64,
    "out_warps": 4,
    "out_stages": None,
    # K3-gate mode only (``A_log`` + ``lower_bound`` given; plain-mode calls ignore these).
    # k3_diag32 1: Aqk / β·Akk by 32-row blocks (two diagonal 32×32 blocks about their middle
    # row, legal only because K3's per-step gate is > lower_bound ≥ −5: factors within e^±80;
    # the block below the diagonal about its columns' last row, factors ≤ 1), see _a_diag32;
    # 2: the same in one pass over K with the lower block's factors taken from the diagonal
    # blocks' (_a_diag32_shared: 128 rows of exponentials per K column, a_tri's strips 240);
    # 0: a_tri / a_cols as in plain mode. Taken only for −5 ≤ lower_bound < 0 (fla's safe_gate
    # range). Registers (Triton 3.9 sm_90 build on the CPU box, cuobjdump, 4 warps, H 12; the
    # device runs 3.6): a_tri BK 64 139 uncapped / 96 + 144 B stack at cap 96 (the default K3 path);
    # k3_diag32 1 at BK 16: 130 / cap 128 + 24 B / cap 96 + 200 B; at BK 32: 160 / 128 + 72 B;
    # at BK 64: 220; k3_diag32 2 (six 32×32 accumulators live): 206 at BK 16, 250 at BK 32.
    # Measured on the H200 (docs/results/gpu_kernels.md, scripts/gpu/kda_prefill_vs_fla.sh, 12
    # variants, every one correct): k3_diag32 1 / 2 were 1-13 % SLOWER than the default path at
    # every shape (the 32×32 blocks' extra registers cost more than the exponentials they
    # save), as were caps and BK 32; the defaults are that path (0, plain mode's cap and BK),
    # the 32-row variants kept behind the knob for later A/B
    "k3_diag32": 0,
    "k3_maxnreg": None,  # the intra kernel's register cap in K3 mode (None: intra_maxnreg; 0: none)
    "k3_fuse_gate": None,  # the gate inside the intra kernel in K3 mode (None: fuse_gate)
    "k3_bk": None,  # K columns per step of the Aqk / Akk products in K3 mode (None: intra_bk)
}


def _knobs_from_env(spec: str | None) -> dict:
    """``"k3_diag32=1,k3_maxnreg=112"`` (``K3SERVE_KDA_KNOBS``) → KNOBS overrides ("None" → None).

    Raises:
        ValueError: a name that is not a knob, or a value that is not an int / ``None``.
    """
    out: dict = {}
    for part in (spec or "").split(","):
        if not part.strip():
            continue
        key, _, val = part.partition("=")
        key, val = key.strip(), val.strip()
        if key not in KNOBS:
            raise ValueError(f"K3SERVE_KDA_KNOBS: unknown knob {key!r} (known: {sorted(KNOBS)})")
        out[key] = None if val == "None" else int(val)
    return out


# the device scripts pick a variant at run time and hand it to every process through this
KNOBS.update(_knobs_from_env(os.environ.get("K3SERVE_KDA_KNOBS")))


def _launch(warps, stages, maxnreg=None) -> dict:
    kw = {"num_warps": warps}
    if stages is not None:
        kw["num_stages"] = stages
    if maxnreg:  # None / 0: no cap
        kw["maxnreg"] = maxnreg
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
def _inv_diag16(A, r0: tl.constexpr, L, SA: tl.constexpr, BC: tl.constexpr):
    """(I + N)⁻¹ of one 16×16 diagonal block (rows ``r0 … r0+15``) of β·Akk, ``[16, 16]`` fp32:
    the forward substitution of :func:`_inv_diag16_x4` for one block (fewer live registers)."""
    o = tl.arange(0, BC)
    rows = r0 + o
    m = (rows[:, None] < L) & (o[None, :] < o[:, None])
    X = -tl.load(A + rows[:, None] * SA + r0 + o[None, :], mask=m, other=0.0)
    for i in tl.static_range(2, BC):
        a = -tl.load(A + (r0 + i) * SA + r0 + o, mask=(o < i) & ((o * 0 + r0 + i) < L), other=0.0)
        a = a + tl.sum(a[:, None] * X, 0)
        X = tl.where((o == i)[:, None], a[None, :], X)
    return X + (o[:, None] == o[None, :]).to(tl.float32)


@triton.jit
def _join_rows4(X0, X1, X2, X3):
    """The ``[64, N]`` tile whose 16-row blocks are ``X0 … X3`` (``[16, N]`` each), in registers."""
    J = tl.join(tl.join(X0, X2), tl.join(X1, X3))  # [16, N, 2, 2]: J[r, c, x, y] = X_{2x+y}[r, c]
    J = tl.permute(J, (2, 3, 0, 1))  # [x, y, r, c]
    return tl.reshape(J, (4 * X0.shape[0], X0.shape[1]))


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
    docstring), each strip against all BT columns (:func:`_a_strip` with ``NC = BT``; the
    ``a_tri`` knob narrows them). Pointers are at the chunk's first row."""
    for s in tl.static_range(BT // BC):
        _a_strip(q, k, G, beta, Aqk, Akk, L, scale, s, BT, SK, SA, H, K, BT, BC, BK, PREC)


@triton.jit
def _a_strip(
    q, k, G, beta, Aqk, Akk, L, scale, s: tl.constexpr, NC: tl.constexpr, SK: tl.constexpr,
    SA: tl.constexpr, H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
    BK: tl.constexpr, PREC: tl.constexpr,
):
    """Strip ``s`` of :func:`_a_by_rows` against its first ``NC`` columns only (``NC`` ≥ the
    strip's last row + 1, a power of two); the Aqk columns ``NC … BT`` get their zeros stored."""
    o_r = tl.arange(0, BC)
    o_c = tl.arange(0, NC)
    rows = s * BC + o_r
    m_r = rows < L
    m_c = (o_c < (s + 1) * BC) & (o_c < L)
    ref = tl.minimum(s * BC + BC // 2, L - 1)
    b_aq = tl.zeros([BC, NC], dtype=tl.float32)
    b_ak = tl.zeros([BC, NC], dtype=tl.float32)
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
    m_valid = m_r[:, None] & (o_c < L)[None, :]
    b_aq = tl.where(m_valid & (o_c[None, :] <= rows[:, None]), b_aq, 0.0)
    b_beta = tl.load(beta + rows * H, mask=m_r, other=0.0).to(tl.float32)
    b_ak = tl.where(m_valid & (o_c[None, :] < rows[:, None]), b_ak * b_beta[:, None], 0.0)
    p_A = rows[:, None] * SA + o_c[None, :]
    tl.store(Aqk + p_A, b_aq.to(Aqk.dtype.element_ty), mask=m_r[:, None])
    tl.store(Akk + p_A, b_ak, mask=m_r[:, None])
    if NC < BT:
        o_z = tl.arange(0, BT)
        z = tl.zeros([BC, BT], dtype=Aqk.dtype.element_ty)
        tl.store(Aqk + rows[:, None] * SA + o_z[None, :], z, mask=m_r[:, None] & (o_z >= NC)[None, :])


@triton.jit
def _a_by_rows_tri(
    q, k, G, beta, Aqk, Akk, L, scale, SK: tl.constexpr, SA: tl.constexpr, H: tl.constexpr,
    K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr,
):
    """:func:`_a_by_rows` with each strip against the columns it needs (16, 32, 64, 64 of 64
    for BT 64: 176 of 256 column rows, fewer exponentials and smaller products)."""
    _a_strip(q, k, G, beta, Aqk, Akk, L, scale, 0, BC, SK, SA, H, K, BT, BC, BK, PREC)
    _a_strip(q, k, G, beta, Aqk, Akk, L, scale, 1, 2 * BC, SK, SA, H, K, BT, BC, BK, PREC)
    _a_strip(q, k, G, beta, Aqk, Akk, L, scale, 2, BT, SK, SA, H, K, BT, BC, BK, PREC)
    _a_strip(q, k, G, beta, Aqk, Akk, L, scale, 3, BT, SK, SA, H, K, BT, BC, BK, PREC)


@triton.jit
def _a_blk32(
    q, k, G, beta, Aqk, Akk, L, scale, r0: tl.constexpr, c0: tl.constexpr, SK: tl.constexpr,
    SA: tl.constexpr, H: tl.constexpr, K: tl.constexpr, BB: tl.constexpr, BK: tl.constexpr,
    PREC: tl.constexpr,
):
    """One ``[BB, BB]`` block (rows ``r0 …``, columns ``c0 …``) of Aqk and β·Akk, stored.

    Diagonal block (``r0 == c0``): both factors about the block's middle row ``m``:
    ``exp(G_t − G_i) = exp(G_t − G_m) · exp(G_m − G_i)``, exponents up to ``(BB/2)·|g|max``
    (e^±80 for BB 32 under K3's bound g > −5: inside fp32's e^±87; the non-causal entries may
    overflow in the accumulator, they are masked to 0), the column operand from the row tile
    (same rows: ``k · exp(−(G − G_m))``). Below the diagonal: about the column block's last row,
    both factors ≤ 1 (exact for any gate). Pointers are at the chunk's first row."""
    o_b = tl.arange(0, BB)
    rows = r0 + o_b
    m_r = rows < L
    DIAG: tl.constexpr = r0 == c0
    if DIAG:
        ref = tl.minimum(r0 + BB // 2, L - 1)
    else:
        ref = tl.minimum(c0 + BB - 1, L - 1)
    cols = c0 + o_b
    m_c = cols < L
    b_aq = tl.zeros([BB, BB], dtype=tl.float32)
    b_ak = tl.zeros([BB, BB], dtype=tl.float32)
    for k0 in range(0, K, BK):
        o_k = k0 + tl.arange(0, BK)
        p_r = rows[:, None] * SK + o_k[None, :]
        b_Gm = tl.load(G + ref * SK + o_k)
        d_r = tl.where(m_r[:, None], tl.load(G + p_r, mask=m_r[:, None], other=0.0) - b_Gm[None, :], 0.0)
        e_r = tl.exp(d_r)
        b_k = tl.load(k + p_r, mask=m_r[:, None], other=0.0).to(tl.float32)
        b_q = tl.load(q + p_r, mask=m_r[:, None], other=0.0).to(tl.float32) * (e_r * scale)
        if DIAG:
            b_kc = b_k * tl.exp(-d_r)
        else:
            p_c = cols[:, None] * SK + o_k[None, :]
            b_Gc = tl.load(G + p_c, mask=m_c[:, None], other=0.0)
            b_kc = tl.load(k + p_c, mask=m_c[:, None], other=0.0).to(tl.float32)
            b_kc = tl.where(m_c[:, None], b_kc * tl.exp(tl.where(m_c[:, None], b_Gm[None, :] - b_Gc, 0.0)), 0.0)
        b_aq += tl.dot(b_q, tl.trans(b_kc), input_precision=PREC)
        b_ak += tl.dot(b_k * e_r, tl.trans(b_kc), input_precision=PREC)
    m_valid = m_r[:, None] & m_c[None, :]
    b_beta = tl.load(beta + rows * H, mask=m_r, other=0.0).to(tl.float32)
    if DIAG:
        b_aq = tl.where(m_valid & (cols[None, :] <= rows[:, None]), b_aq, 0.0)
        b_ak = tl.where(m_valid & (cols[None, :] < rows[:, None]), b_ak * b_beta[:, None], 0.0)
    else:
        b_aq = tl.where(m_valid, b_aq, 0.0)
        b_ak = tl.where(m_valid, b_ak * b_beta[:, None], 0.0)
    p_A = rows[:, None] * SA + cols[None, :]
    tl.store(Aqk + p_A, b_aq.to(Aqk.dtype.element_ty), mask=m_r[:, None])
    tl.store(Akk + p_A, b_ak, mask=m_r[:, None])


@triton.jit
def _a_diag32(
    q, k, G, beta, Aqk, Akk, L, scale, SK: tl.constexpr, SA: tl.constexpr, H: tl.constexpr,
    K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr,
):
    """Aqk and β·Akk of one 64-row chunk by 32-row blocks (``KNOBS["k3_diag32"]``, K3's bounded
    gate only): the two diagonal blocks and the one below them (:func:`_a_blk32`), the Aqk
    block above the diagonal stored as zeros. 192 rows of exponentials per K column against
    :func:`_a_by_rows_tri`'s 240 (the diagonal blocks take the column factor from the row
    tile). fla-core's ``safe_gate`` (``chunk_kda_fwd_kernel_intra_sub_chunk``) uses the same
    bound for its 16-row diagonal blocks; 32 rows need ``|lower_bound| · 16 < 87``."""
    BB: tl.constexpr = BT // 2
    _a_blk32(q, k, G, beta, Aqk, Akk, L, scale, 0, 0, SK, SA, H, K, BB, BK, PREC)
    _a_blk32(q, k, G, beta, Aqk, Akk, L, scale, BB, BB, SK, SA, H, K, BB, BK, PREC)
    _a_blk32(q, k, G, beta, Aqk, Akk, L, scale, BB, 0, SK, SA, H, K, BB, BK, PREC)
    o_b = tl.arange(0, BB)
    z = tl.zeros([BB, BB], dtype=Aqk.dtype.element_ty)
    tl.store(Aqk + o_b[:, None] * SA + BB + o_b[None, :], z, mask=(o_b < L)[:, None])


@triton.jit
def _a_diag32_shared(
    q, k, G, beta, Aqk, Akk, L, scale, SK: tl.constexpr, SA: tl.constexpr, H: tl.constexpr,
    K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr,
):
    """:func:`_a_diag32` in one pass over K (``KNOBS["k3_diag32"] = 2``), the block below the
    diagonal taking its factors from the diagonal blocks' (128 rows of exponentials per K column
    instead of 192): with ``m0, m1`` the middle rows of the two halves and ``c`` = row 31,
    ``exp(G_t − G_c) = exp(G_t − G_m1) · exp(G_m1 − G_c)`` (rows t ≥ 32) and
    ``exp(G_c − G_i) = exp(G_m0 − G_i) · exp(G_c − G_m0)`` (columns i ≤ 31): each product is the
    decay it stands for (≤ 1), so a factor pair can only underflow where that decay is below
    e^-87 (negligible, as in :func:`_a_blk32`)."""
    BB: tl.constexpr = BT // 2
    o_b = tl.arange(0, BB)
    r1 = BB + o_b
    m0, m1 = o_b < L, r1 < L
    ref0 = tl.minimum(BB // 2, L - 1)
    ref1 = tl.minimum(BB + BB // 2, L - 1)
    refc = tl.minimum(BB - 1, L - 1)
    q00 = tl.zeros([BB, BB], dtype=tl.float32)
    k00 = tl.zeros([BB, BB], dtype=tl.float32)
    q11 = tl.zeros([BB, BB], dtype=tl.float32)
    k11 = tl.zeros([BB, BB], dtype=tl.float32)
    q10 = tl.zeros([BB, BB], dtype=tl.float32)
    k10 = tl.zeros([BB, BB], dtype=tl.float32)
    for k0 in range(0, K, BK):
        o_k = k0 + tl.arange(0, BK)
        p0 = o_b[:, None] * SK + o_k[None, :]
        p1 = p0 + BB * SK
        g_m0 = tl.load(G + ref0 * SK + o_k)
        g_m1 = tl.load(G + ref1 * SK + o_k)
        g_c = tl.load(G + refc * SK + o_k)
        d0 = tl.where(m0[:, None], tl.load(G + p0, mask=m0[:, None], other=0.0) - g_m0[None, :], 0.0)
        e0 = tl.exp(d0)
        b_k0 = tl.load(k + p0, mask=m0[:, None], other=0.0).to(tl.float32)
        c0 = b_k0 * tl.exp(-d0)  # k_i · exp(G_m0 − G_i)
        a0 = tl.load(q + p0, mask=m0[:, None], other=0.0).to(tl.float32) * (e0 * scale)
        q00 += tl.dot(a0, tl.trans(c0), input_precision=PREC)
        k00 += tl.dot(b_k0 * e0, tl.trans(c0), input_precision=PREC)
        c0 = tl.where(m0[:, None], c0 * tl.exp(g_c - g_m0)[None, :], 0.0)  # k_i · exp(G_c − G_i)
        d1 = tl.where(m1[:, None], tl.load(G + p1, mask=m1[:, None], other=0.0) - g_m1[None, :], 0.0)
        e1 = tl.exp(d1)
        b_k1 = tl.load(k + p1, mask=m1[:, None], other=0.0).to(tl.float32)
        c1 = b_k1 * tl.exp(-d1)
        a1 = tl.load(q + p1, mask=m1[:, None], other=0.0).to(tl.float32) * (e1 * scale)
        b1 = b_k1 * e1
        q11 += tl.dot(a1, tl.trans(c1), input_precision=PREC)
        k11 += tl.dot(b1, tl.trans(c1), input_precision=PREC)
        s1 = tl.exp(g_m1 - g_c)[None, :]  # exp(G_m1 − G_c): rows t ≥ 32 → exp(G_t − G_c)
        q10 += tl.dot(a1 * s1, tl.trans(c0), input_precision=PREC)
        k10 += tl.dot(b1 * s1, tl.trans(c0), input_precision=PREC)
    low = o_b[None, :] <= o_b[:, None]
    strict = o_b[None, :] < o_b[:, None]
    b0 = tl.load(beta + o_b * H, mask=m0, other=0.0).to(tl.float32)
    b1_ = tl.load(beta + r1 * H, mask=m1, other=0.0).to(tl.float32)
    v00 = m0[:, None] & m0[None, :]
    v11 = m1[:, None] & m1[None, :]
    v10 = m1[:, None] & m0[None, :]
    pA = o_b[:, None] * SA + o_b[None, :]
    DA = Aqk.dtype.element_ty
    tl.store(Aqk + pA, tl.where(v00 & low, q00, 0.0).to(DA), mask=m0[:, None])
    tl.store(Aqk + pA + BB, tl.zeros([BB, BB], dtype=DA), mask=m0[:, None])
    tl.store(Aqk + pA + BB * SA, tl.where(v10, q10, 0.0).to(DA), mask=m1[:, None])
    tl.store(Aqk + pA + BB * SA + BB, tl.where(v11 & low, q11, 0.0).to(DA), mask=m1[:, None])
    tl.store(Akk + pA, tl.where(v00 & strict, k00 * b0[:, None], 0.0), mask=m0[:, None])
    tl.store(Akk + pA + BB * SA, tl.where(v10, k10 * b1_[:, None], 0.0), mask=m1[:, None])
    tl.store(Akk + pA + BB * SA + BB, tl.where(v11 & strict, k11 * b1_[:, None], 0.0), mask=m1[:, None])


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
    INV_X4: tl.constexpr,
    A_TRI: tl.constexpr,
    T_REGS: tl.constexpr,
    WY: tl.constexpr,  # 1: step 3 here; 0: stop at T (stored in Akk) for _wy_kernel
    A_D32: tl.constexpr = 0,  # 1 / 2: Aqk / β·Akk by 32-row blocks (K3's bounded gate only)
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
    if A_D32 == 2:
        _a_diag32_shared(q, k, G, beta, Aqk, Akk, L, scale, SK, SA, H, K, BT, BK, PREC)
    elif A_D32:
        _a_diag32(q, k, G, beta, Aqk, Akk, L, scale, SK, SA, H, K, BT, BK, PREC)
    elif A_COLS:
        _a_by_columns(q, k, G, beta, Aqk, Akk, L, scale, SK, SA, H, K, BT, BC, BK, PREC)
    elif A_TRI:
        _a_by_rows_tri(q, k, G, beta, Aqk, Akk, L, scale, SK, SA, H, K, BT, BC, BK, PREC)
    else:
        _a_by_rows(q, k, G, beta, Aqk, Akk, L, scale, SK, SA, H, K, BT, BC, BK, PREC)
    tl.debug_barrier()

    # --- 2. T = (I + β·Akk)⁻¹ once, as a 64×64 matrix: the four 16×16 diagonal inverses in one
    #        pass, then the block substitution with the identity on the right (rows of T by blocks)
    if INV_X4:
        X = _inv_diag16_x4(Akk, L, SA, BT, BC)
        D0, D1, D2, D3 = _pick(X, 0), _pick(X, 1), _pick(X, 2), _pick(X, 3)
    else:
        D0 = _inv_diag16(Akk, 0, L, SA, BC)
        D1 = _inv_diag16(Akk, BC, L, SA, BC)
        D2 = _inv_diag16(Akk, 2 * BC, L, SA, BC)
        D3 = _inv_diag16(Akk, 3 * BC, L, SA, BC)
    T0, T1, T2, T3 = _block_solve(
        D0, D1, D2, D3,
        _load_blk16(Akk, BC, 0, L, SA, BC),
        _load_blk16(Akk, 2 * BC, 0, L, SA, BC),
        _load_blk16(Akk, 2 * BC, BC, L, SA, BC),
        _load_blk16(Akk, 3 * BC, 0, L, SA, BC),
        _load_blk16(Akk, 3 * BC, BC, L, SA, BC),
        _load_blk16(Akk, 3 * BC, 2 * BC, L, SA, BC),
        _eye_rows(0, BC, BT), _eye_rows(BC, BC, BT), _eye_rows(2 * BC, BC, BT), _eye_rows(3 * BC, BC, BT),
        PREC,
    )  # fmt: skip
    if WY_LOWP:  # T and the right-hand sides in the io dtype (bf16/fp16 tensor-core products)
        DW = W.dtype.element_ty
    else:
        DW = tl.float32
    if T_REGS and WY:
        b_T = _join_rows4(T0, T1, T2, T3).to(DW)  # rows ≥ L of T are the identity's: R is 0 there
    else:
        tl.debug_barrier()  # every read of β·Akk is done: T overwrites it
        p_T = o_r[:, None] * SA + o_c[None, :]
        tl.store(Akk + p_T, T0, mask=(o_r < L)[:, None])
        tl.store(Akk + BC * SA + p_T, T1, mask=(BC + o_r < L)[:, None])
        tl.store(Akk + 2 * BC * SA + p_T, T2, mask=(2 * BC + o_r < L)[:, None])
        tl.store(Akk + 3 * BC * SA + p_T, T3, mask=(3 * BC + o_r < L)[:, None])
        if WY:
            tl.debug_barrier()
            b_T = tl.load(Akk + o_c[:, None] * SA + o_c[None, :], mask=m_t[:, None], other=0.0).to(DW)

    # --- 3. W = T·β(exp(G)⊙K), Kd = K ⊙ exp(G_C − G), Ũ = T·βV: one 64-row product each
    #        (here, or in _wy_kernel with KNOBS["intra_split"])
    if WY:
        _wy_rows(b_T, k, v, G, beta, W, U, Kd, L, SK, SV, H, K, V, BT, BV, PREC, DW, True, True)


@triton.jit
def _wy_rows(
    b_T, k, v, G, beta, W, U, Kd, L, SK: tl.constexpr, SV: tl.constexpr, H: tl.constexpr,
    K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
    DW: tl.constexpr, DO_K: tl.constexpr, DO_V: tl.constexpr,
):
    """W = T·β(exp(G)⊙K) and Kd = K ⊙ exp(G_C − G) (``DO_K``), Ũ = T·βV (``DO_V``) of one chunk
    from ``b_T`` (``[BT, BT]``, T = (I + β·Akk)⁻¹, in ``DW``), ``BV`` columns per product.
    Pointers are at the chunk's first row."""
    o_c = tl.arange(0, BT)
    m_t = o_c < L
    b_b = tl.load(beta + o_c * H, mask=m_t, other=0.0).to(tl.float32)
    if DO_K:
        gC_row = (L - 1) * SK
        for kw in range(0, K, BV):
            o_w = kw + tl.arange(0, BV)
            p_w = o_c[:, None] * SK + o_w[None, :]
            b_k = tl.load(k + p_w, mask=m_t[:, None], other=0.0).to(tl.float32)
            b_G = tl.load(G + p_w, mask=m_t[:, None], other=0.0)
            gC = tl.load(G + gC_row + o_w)
            tl.store(Kd + p_w, (b_k * tl.exp(gC[None, :] - b_G)).to(Kd.dtype.element_ty), mask=m_t[:, None])
            b_w = tl.dot(b_T, (b_k * tl.exp(b_G) * b_b[:, None]).to(DW), input_precision=PREC)
            tl.store(W + p_w, b_w.to(W.dtype.element_ty), mask=m_t[:, None])
    if DO_V:
        for vb in range(0, V, BV):
            o_v = vb + tl.arange(0, BV)
            p_v = o_c[:, None] * SV + o_v[None, :]
            b_v = tl.load(v + p_v, mask=m_t[:, None], other=0.0).to(tl.float32)
            b_u = tl.dot(b_T, (b_v * b_b[:, None]).to(DW), input_precision=PREC)
            tl.store(U + p_v, b_u.to(U.dtype.element_ty), mask=m_t[:, None])


@triton.jit
def _wy_kernel(
    k,
    v,
    G,
    beta,
    Akk,
    W,
    U,
    Kd,
    cu,
    cidx,
    H: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BT: tl.constexpr,
    BV: tl.constexpr,
    PREC: tl.constexpr,
    WY_LOWP: tl.constexpr,
    NP: tl.constexpr,
):
    """Step 3 of ``_intra_kernel`` as its own launch (``KNOBS["intra_split"]``): per (chunk, head,
    part) W, Kd and Ũ from T (fp32, stored in ``Akk`` by the intra kernel). ``NP`` 1: one program
    does all; 2: part 0 does W and Kd, part 1 Ũ."""
    i_c, i_h, i_p = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_n = tl.load(cidx + 2 * i_c).to(tl.int64)
    i_j = tl.load(cidx + 2 * i_c + 1).to(tl.int64)
    bos, eos = tl.load(cu + i_n).to(tl.int64), tl.load(cu + i_n + 1).to(tl.int64)
    t0 = bos + i_j * BT
    L = tl.minimum(eos - t0, BT).to(tl.int32)
    hk = (t0 * H + i_h) * K
    k, G, Kd, W = k + hk, G + hk, Kd + hk, W + hk
    v, U = v + (t0 * H + i_h) * V, U + (t0 * H + i_h) * V
    Akk = Akk + (t0 * H + i_h) * BT
    beta = beta + t0 * H + i_h
    SA: tl.constexpr = H * BT
    o_c = tl.arange(0, BT)
    if WY_LOWP:
        DW = W.dtype.element_ty
    else:
        DW = tl.float32
    b_T = tl.load(Akk + o_c[:, None] * SA + o_c[None, :], mask=(o_c < L)[:, None], other=0.0).to(DW)
    if NP == 1:
        _wy_rows(b_T, k, v, G, beta, W, U, Kd, L, H * K, H * V, H, K, V, BT, BV, PREC, DW, True, True)
    elif i_p == 0:
        _wy_rows(b_T, k, v, G, beta, W, U, Kd, L, H * K, H * V, H, K, V, BT, BV, PREC, DW, True, False)
    else:
        _wy_rows(b_T, k, v, G, beta, W, U, Kd, L, H * K, H * V, H, K, V, BT, BV, PREC, DW, False, True)


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
    seg,
    S0,
    AB,
    q,
    Aqk,
    o,
    scale,
    H: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BT: tl.constexpr,
    BV: tl.constexpr,
    HAS_H0: tl.constexpr,
    STORE_HT: tl.constexpr,
    PREC: tl.constexpr,
    MODE: tl.constexpr,
    FUSE_O: tl.constexpr,
):
    """Inter-chunk state pass, sequential over the chunks of one segment (see ``_plan``).

    MODE 0: a program per (sequence, head, V-block), the whole sequence, state from ``h0``;
    MODE 1: a program per (segment, head, V-block), start state ``S0[segment]`` (``_seg_scan``);
    MODE 2: the segment's affine map ``S_end = M S_start + B`` into ``AB[segment] = [M | B]``
    (``[K, K + V]`` fp32): V-blocks ``< K / BV`` run the recurrence from identity columns without
    the Ũ term (columns of M), the rest from zero with it (columns of B); not for a sequence's
    last segment. MODE 3 (pipelined pieces, ``_Plan.pieces``): a program per (row, head,
    V-block) of ``seg`` rows ``(sequence, first chunk, chunks, flags, own row, next row)``: start
    from ``h0`` (flag 2, a sequence's first row) or ``S0[own row]``, end in ``ht`` (flag 1, its
    last) or ``S0[next row]``. MODE 0/1/3 store h_c and v_new, or with FUSE_O the output
    ``O = (exp(G)⊙Q·scale) h_c + Aqk v_new`` directly (no h / v_new round trip).
    """
    i_s, i_h, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if MODE == 0:
        i_n = i_s.to(tl.int64)
        j0 = i_n * 0
        bos, eos = tl.load(cu + i_n).to(tl.int64), tl.load(cu + i_n + 1).to(tl.int64)
        nc = tl.cdiv(eos - bos, BT)
        last = 1
    elif MODE == 3:
        rw = seg + 6 * i_s  # (sequence, first chunk, chunks, flags, own row, next row)
        i_n = tl.load(rw).to(tl.int64)
        j0 = tl.load(rw + 1).to(tl.int64)
        bos, eos = tl.load(cu + i_n).to(tl.int64), tl.load(cu + i_n + 1).to(tl.int64)
        nc = tl.load(rw + 2)
        fl = tl.load(rw + 3)
        last = fl & 1
        first = (fl & 2) != 0
        own = tl.load(rw + 4).to(tl.int64)
        nxt = tl.load(rw + 5).to(tl.int64)
    else:
        i_n = tl.load(seg + 4 * i_s).to(tl.int64)
        j0 = tl.load(seg + 4 * i_s + 1).to(tl.int64)
        bos, eos = tl.load(cu + i_n).to(tl.int64), tl.load(cu + i_n + 1).to(tl.int64)
        nc = tl.load(seg + 4 * i_s + 2)
        last = tl.load(seg + 4 * i_s + 3)
        if MODE == 2:
            nc = tl.where(last != 0, 0, nc)
    c0 = tl.load(coff + i_n).to(tl.int64) + j0
    o_k = tl.arange(0, K)
    o_t = tl.arange(0, BT)
    o_b = tl.arange(0, BV)
    NVK: tl.constexpr = K // BV
    if MODE == 2:
        is_tr = i_v < NVK
        c = tl.where(is_tr, i_v, i_v - NVK) * BV + o_b
        S = tl.where(is_tr, (o_k[:, None] == c[None, :]).to(tl.float32), 0.0)
        m_u = (i_v * BV + o_b) >= K  # columns of B take the Ũ term
    else:
        c = i_v * BV + o_b
        p_s = o_k[:, None] * V + c[None, :]
        if MODE == 1:
            S = tl.load(S0 + (i_s.to(tl.int64) * H + i_h) * K * V + p_s)
        elif MODE == 3:
            if first:
                if HAS_H0:
                    S = tl.load(h0 + (i_n * H + i_h) * K * V + p_s).to(tl.float32)
                else:
                    S = tl.zeros([K, BV], dtype=tl.float32)
            else:
                S = tl.load(S0 + (own * H + i_h) * K * V + p_s)
        elif HAS_H0:
            S = tl.load(h0 + (i_n * H + i_h) * K * V + p_s).to(tl.float32)
        else:
            S = tl.zeros([K, BV], dtype=tl.float32)
    DT = W.dtype.element_ty
    SK: tl.constexpr = H * K
    SV: tl.constexpr = H * V
    # 64-bit scalar bases (a chunk's first row), 32-bit tile offsets
    p_k = o_t[:, None] * SK + o_k[None, :]
    p_v = o_t[:, None] * SV + c[None, :]
    for j in range(nc):
        t0 = bos + (j0 + j) * BT
        L = tl.minimum(eos - t0, BT)
        m_t = o_t < L
        bk = (t0 * H + i_h) * K
        bv = (t0 * H + i_h) * V
        S_lo = S.to(DT)
        if MODE != 2 and not FUSE_O:
            tl.store(h + ((c0 + j) * H + i_h) * K * V + o_k[:, None] * V + c[None, :], S_lo)
        b_w = tl.load(W + bk + p_k, mask=m_t[:, None], other=0.0)
        if MODE == 2:
            b_u = tl.load(U + bv + p_v, mask=m_t[:, None] & m_u[None, :], other=0.0).to(tl.float32)
        else:
            b_u = tl.load(U + bv + p_v, mask=m_t[:, None], other=0.0).to(tl.float32)
        b_vn = b_u - tl.dot(b_w, S_lo, input_precision=PREC)
        vn_lo = b_vn.to(DT)
        if MODE != 2:
            if FUSE_O:
                b_q = tl.load(q + bk + p_k, mask=m_t[:, None], other=0.0).to(tl.float32)
                b_G = tl.load(G + bk + p_k, mask=m_t[:, None], other=0.0)
                b_qg = (b_q * tl.exp(b_G) * scale).to(DT)
                b_A = tl.load(
                    Aqk + (t0 * H + i_h) * BT + o_t[:, None] * (H * BT) + o_t[None, :],
                    mask=m_t[:, None] & m_t[None, :],
                    other=0.0,
                ).to(DT)
                b_o = tl.dot(b_qg, S_lo, input_precision=PREC)
                b_o += tl.dot(b_A, vn_lo, input_precision=PREC)
                tl.store(o + bv + p_v, b_o.to(o.dtype.element_ty), mask=m_t[:, None])
            else:
                tl.store(vnew + bv + p_v, vn_lo, mask=m_t[:, None])
        b_kd = tl.load(Kd + bk + p_k, mask=m_t[:, None], other=0.0)
        gC = tl.load(G + bk + (L - 1) * SK + o_k)
        S = S * tl.exp(gC)[:, None] + tl.dot(tl.trans(b_kd), vn_lo, input_precision=PREC)
    if MODE == 2:
        KV2: tl.constexpr = K + V
        p_ab = (i_s.to(tl.int64) * H + i_h) * K * KV2 + o_k[:, None] * KV2 + (i_v * BV + o_b)[None, :]
        tl.store(AB + p_ab, S, mask=(o_k[:, None] * 0 + last) == 0)
    else:
        if STORE_HT:
            if MODE == 0:
                tl.store(ht + (i_n * H + i_h) * K * V + p_s, S)
            else:
                tl.store(ht + (i_n * H + i_h) * K * V + p_s, S, mask=(o_k[:, None] * 0 + last) != 0)
        if MODE == 3:  # the next piece's segment of this sequence starts from here
            tl.store(S0 + (nxt * H + i_h) * K * V + p_s, S, mask=(o_k[:, None] * 0 + last) == 0)


@triton.jit
def _seg_scan_kernel(
    AB,
    h0,
    S0,
    soff,
    H: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BV: tl.constexpr,
    HAS_H0: tl.constexpr,
    PREC: tl.constexpr,
):
    """Start states of a sequence's segments, per (sequence, head, V-block):
    ``S0[s₀] = h0``, ``S0[s+1] = M_s S0[s] + B_s`` with ``AB[s] = [M_s | B_s]`` (fp32)."""
    i_n, i_h, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_n = i_n.to(tl.int64)
    s0, s1 = tl.load(soff + i_n).to(tl.int64), tl.load(soff + i_n + 1).to(tl.int64)
    o_k = tl.arange(0, K)
    c = i_v * BV + tl.arange(0, BV)
    p_s = o_k[:, None] * V + c[None, :]
    if HAS_H0:
        S = tl.load(h0 + (i_n * H + i_h) * K * V + p_s).to(tl.float32)
    else:
        S = tl.zeros([K, BV], dtype=tl.float32)
    KV2: tl.constexpr = K + V
    for s in range(s0, s1):
        tl.store(S0 + (s * H + i_h) * K * V + p_s, S)
        if s < s1 - 1:
            base = (s * H + i_h) * K * KV2
            b_m = tl.load(AB + base + o_k[:, None] * KV2 + o_k[None, :])
            b_b = tl.load(AB + base + o_k[:, None] * KV2 + K + c[None, :])
            S = tl.dot(b_m, S, input_precision=PREC) + b_b


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
    c_base,
    H: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BT: tl.constexpr,
    BV: tl.constexpr,
    PREC: tl.constexpr,
):
    """O = (exp(G)⊙Q·scale) h_c + Aqk v_new per (chunk, head, V-block); ``cidx`` may start at
    chunk ``c_base`` of the layout (a pipelined piece), ``h`` is indexed by the layout's chunk."""
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
    b_h = tl.load(h + ((i_c + c_base).to(tl.int64) * H + i_h) * K * V + o_k[:, None] * V + o_v[None, :])
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


def _to_device(t: torch.Tensor, device) -> torch.Tensor:
    """Host table → device; on CUDA from pinned memory, ``non_blocking`` (a pageable copy
    synchronises the stream, which drains the launch queue mid-forward)."""
    if torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


class _Plan:
    """Chunk and segment tables of one ``(cu_seqlens | B × T)`` layout, built once and cached.

    ``cu [N+1]`` int64 (None when ``cu_seqlens`` is already int64 on the device: the launch
    reads it), ``cidx [NCH, 2]`` int32 (sequence, chunk in sequence), ``coff [N+1]``
    int64 (first chunk of each sequence), ``nch``; ``nts`` (chunks per sequence, host ints);
    ``segs(SEG)`` → ``(seg [NS, 4]`` int32 (sequence, first chunk, chunks, is-last),
    ``soff [N+1]`` int64, ``NS)`` or ``None`` when every sequence is one segment.
    """

    def __init__(self, cu_seqlens: torch.Tensor | None, B: int, T: int, device, host=None):
        if cu_seqlens is None:
            NT = triton.cdiv(T, BT)
            self.nts = [NT] * B
            self.cu = torch.arange(0, B + 1, device=device, dtype=torch.int64) * T
        else:
            cu = cu_seqlens.to(device=device, dtype=torch.int64)
            # a converted copy is kept; the caller's own tensor is not (a cached plan must not
            # keep its key alive): the launch then reads ``cu_seqlens`` itself
            self.cu = None if cu is cu_seqlens else cu
            if host is not None:  # the caller's host copy: no device read
                ends = [int(x) for x in host]
            else:
                ends = cu_seqlens.detach().to("cpu", torch.int64).tolist()  # one host sync
            self.nts = [(b - a + BT - 1) // BT for a, b in itertools.pairwise(ends)]
        offs = [0]
        for n in self.nts:
            offs.append(offs[-1] + n)
        self.nch = offs[-1]
        self.offs = offs
        seq = [i for i, n in enumerate(self.nts) for _ in range(n)]
        j = [c for n in self.nts for c in range(n)]
        self.cidx = _to_device(torch.tensor([seq, j], dtype=torch.int32).t().contiguous(), device)
        self.coff = _to_device(torch.tensor(offs, dtype=torch.int64), device)
        self.device = device
        self._segs: dict = {}
        self._pieces: dict = {}

    def pieces(self, P: int):
        """The chunk list cut into ``P`` near-equal pieces of chunks (pipelined state pass).

        Returns ``(rows [R, 6]`` int32 ``(sequence, first chunk, chunks, flags, own row, next
        row)`` with flags 1 = the sequence's last row, 2 = its first; rows of piece p are
        ``prow[p] … prow[p+1] − 1``, ``prow``, ``crange`` = [(first chunk, end chunk)] per piece,
        ``empty`` = sequences without chunks (host lists)``)``."""
        if P not in self._pieces:
            bounds = [round(i * self.nch / P) for i in range(P + 1)]
            rows: list = []
            prow, crange, row_of = [0], [], {}
            for lo, hi in itertools.pairwise(bounds):
                if hi <= lo:
                    continue
                for i, n in enumerate(self.nts):
                    a, b = self.offs[i], self.offs[i] + n
                    s0, s1 = max(lo, a), min(hi, b)
                    if s1 <= s0:
                        continue
                    r = len(rows)
                    rows.append([i, s0 - a, s1 - s0, int(s1 == b) | (2 * int(s0 == a)), r, r])
                    if s0 != a:
                        rows[row_of[i]][5] = r
                    row_of[i] = r
                prow.append(len(rows))
                crange.append((lo, hi))
            empty = [i for i, n in enumerate(self.nts) if n == 0]
            t = torch.tensor(rows, dtype=torch.int32).to(self.device)
            self._pieces[P] = (t, prow, crange, empty)
        return self._pieces[P]

    def segs(self, SEG: int):
        if SEG not in self._segs:
            rows, soff = [], [0]
            for i, n in enumerate(self.nts):
                ns = max(1, triton.cdiv(n, SEG))
                for s in range(ns):
                    j0 = s * SEG
                    rows.append([i, j0, min(SEG, n - j0) if n else 0, int(s == ns - 1)])
                soff.append(soff[-1] + ns)
            if len(rows) == len(self.nts):
                self._segs[SEG] = None
            else:
                self._segs[SEG] = (
                    _to_device(torch.tensor(rows, dtype=torch.int32), self.device),
                    _to_device(torch.tensor(soff, dtype=torch.int64), self.device),
                    len(rows),
                )
        return self._segs[SEG]


_FIXED: dict = {}  # (B, T, device) → _Plan of a fixed-length layout; at most _FIXED_MAX entries
_FIXED_MAX = 16
_VARLEN: dict = {}  # (id(cu_seqlens), device) → (weakref to cu_seqlens, version, _Plan)


def _tensor_version(t: torch.Tensor) -> int:
    try:
        return t._version
    except RuntimeError:  # inference tensors keep no version counter: identity only (as fla)
        return -1


def _plan(cu_seqlens: torch.Tensor | None, B: int, T: int, device, host=None) -> _Plan:
    """The cached :class:`_Plan` of this layout: fixed-length by ``(B, T, device)`` (the
    ``_FIXED_MAX`` latest), varlen by the ``cu_seqlens`` tensor itself (identity, and its
    version counter where it has one: an in-place change rebuilds), as fla-core's
    ``tensor_cache`` does for its chunk indices — the host sync then happens once per layout
    (e.g. once per forward for all KDA layers), not per call, and not at all when ``host``
    (``cu_seqlens`` as host ints) is given.

    A varlen plan lives exactly as long as its ``cu_seqlens`` tensor (dropped by a finalizer
    when the tensor is freed; never evicted before): a CUDA graph captured over a static
    ``cu_seqlens`` replays launches that read this plan's ``cidx`` / ``coff`` at their
    capture-time addresses, so those tables must stay allocated while the graph's batch holds
    the tensor, however many other layouts run in between. A per-forward ``cu_seqlens``
    (eager batches) frees its tables with it."""
    if cu_seqlens is None:
        key = (B, T, str(device))
        plan = _FIXED.get(key)
        if plan is None:
            plan = _Plan(None, B, T, device)
            if len(_FIXED) >= _FIXED_MAX:
                _FIXED.pop(next(iter(_FIXED)))
            _FIXED[key] = plan
        return plan
    key = (id(cu_seqlens), str(device))
    hit = _VARLEN.get(key)
    ver = _tensor_version(cu_seqlens)
    if hit is not None and hit[0]() is cu_seqlens and hit[1] == ver:
        return hit[2]
    plan = _Plan(cu_seqlens, B, T, device, host)
    if hit is not None and hit[0]() is cu_seqlens:  # rebuilt after an in-place change
        ref = hit[0]
    else:  # this tensor's first plan: dropped when the tensor is freed
        ref = weakref.ref(cu_seqlens)
        weakref.finalize(cu_seqlens, _drop_plan, key, ref).atexit = False
    _VARLEN[key] = (ref, ver, plan)
    return plan


def _drop_plan(key: tuple, ref: weakref.ref) -> None:
    """Finalizer of a varlen layout's ``cu_seqlens``: forget its plan (the entry of that very
    tensor only, in case its id was taken again before the finalizer ran)."""
    hit = _VARLEN.get(key)
    if hit is not None and hit[0] is ref:
        del _VARLEN[key]


def _state_segments(plan: _Plan, H: int, NV: int) -> int:
    """Chunks per segment of the state pass (0: one segment per sequence).

    ``KNOBS["state_seg"]`` > 0 forces that length; < 0 turns segments off; 0 (auto) splits only
    when ``N · H · NV`` programs are fewer than ``KNOBS["state_split_below"]``, into about
    ``KNOBS["state_progs"]`` programs, with segments of at least ``KNOBS["seg_min"]`` chunks and
    at least ``KNOBS["seg_count_min"]`` of them (H200: 8 segments of 64 chunks paid 4 %
    at T 32k H 12; shorter segments or more programs lost, the extra M-columns cost more than
    the parallelism gives)."""
    want = KNOBS["state_seg"]
    if want is not None and want < 0:
        return 0
    if want:
        return int(want)
    if len(plan.nts) * H * NV >= KNOBS["state_split_below"] or plan.nch == 0:
        return 0
    nseg = triton.cdiv(KNOBS["state_progs"], H * NV)
    seg = max(KNOBS["seg_min"], triton.cdiv(plan.nch, nseg))
    return seg if triton.cdiv(max(plan.nts), seg) >= KNOBS["seg_count_min"] else 0


def _pipe_pieces(plan: _Plan, H: int, NV: int) -> int:
    """Pieces of the pipelined state pass (0: not pipelined), from ``KNOBS["pipe*"]``: the intra
    kernel of piece p + 1 runs beside the state pass (few programs: one per sequence, head and
    V-block) and output of piece p."""
    mode = KNOBS["pipe"]
    if not mode or plan.nch == 0:
        return 0
    if mode == 1 and (len(plan.nts) * H * NV >= KNOBS["pipe_below"] or plan.nch < KNOBS["pipe_min_nch"]):
        return 0
    P = min(KNOBS["pipe_pieces"], plan.nch // KNOBS["pipe_min_chunks"])
    return P if P >= 2 else 0


_SIDE: dict = {}


def _side_stream(dev) -> torch.cuda.Stream:
    """One side stream per device for the pipelined state pass (created once)."""
    key = torch.device(dev).index if torch.device(dev).index is not None else torch.cuda.current_device()
    if key not in _SIDE:
        _SIDE[key] = torch.cuda.Stream(device=key)
    return _SIDE[key]


def _nullctx():
    return contextlib.nullcontext()


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
    cu_seqlens_host: Sequence[int] | None = None,
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
        cu_seqlens (torch.Tensor, optional): ``[N+1]`` (``B == 1``); costs one host sync per
            layout (cached by tensor identity) unless ``cu_seqlens_host`` is given.
        chunk_size (int): must be 64.
        A_log (torch.Tensor, optional): ``[H]``; fuses ``kda_gate(g, A_log, dt_bias, lower_bound)``.
        dt_bias (torch.Tensor, optional): ``[H * K]``.
        lower_bound (float, optional): K3's bound (e.g. −5); None → Kimi Linear softplus gate.
        cu_seqlens_host (Sequence[int], optional): ``cu_seqlens`` as host ints (the caller's
            scheduler knows them): the chunk tables are built from these, no device read.

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
    plan = _plan(cu_seqlens, B, T, dev, cu_seqlens_host)
    cu = plan.cu if plan.cu is not None else cu_seqlens
    cidx, coff, nch = plan.cidx, plan.coff, plan.nch
    o = torch.empty(B, T, H, V, dtype=io, device=dev)
    ht = torch.empty(N, H, K, V, dtype=torch.float32, device=dev) if output_final_state else None
    if nch == 0:
        if ht is not None:
            ht.copy_(initial_state if initial_state is not None else torch.zeros_like(ht))
        return o, ht
    gate = 0 if A_log is None else (1 if lower_bound is not None else 2)
    k3 = gate == 1  # K3's bounded gate: the k3_* knobs apply

    def knob(name: str):
        if k3 and KNOBS.get("k3_" + name) is not None:
            return KNOBS["k3_" + name]
        return KNOBS[{"bk": "intra_bk", "maxnreg": "intra_maxnreg"}.get(name, name)]

    BK = min(knob("bk"), K)
    Gc = torch.empty(B, T, H, K, dtype=torch.float32, device=dev)
    gargs = (g, A_log if A_log is not None else g, dt_bias if dt_bias is not None else g, float(lower_bound or 0.0))
    gkw = {"GATE": gate, "HAS_BIAS": dt_bias is not None, "G_MIN": G_MIN}
    fuse = bool(knob("fuse_gate"))
    if not fuse:
        _gate_cumsum_kernel[(nch, H)](g, Gc, *gargs[1:], cu, cidx, H=H, K=K, BT=BT, BK=BK, **gkw)
    Aqk = torch.empty(B, T, H, BT, dtype=io, device=dev)
    Akk = torch.empty(B, T, H, BT, dtype=torch.float32, device=dev)  # β·Akk, then T in place
    W = torch.empty(B, T, H, K, dtype=io, device=dev)
    Kd = torch.empty(B, T, H, K, dtype=io, device=dev)
    U = torch.empty(B, T, H, V, dtype=io, device=dev)
    split = bool(KNOBS["intra_split"])
    lowp = bool(KNOBS["wy_lowp"]) and io != torch.float32
    ikw = dict(
        H=H, K=K, V=V, BT=BT, BC=BC, BK=BK, BV=min(KNOBS["intra_bw"], K, V), PREC=prec, FUSE_GATE=fuse,
        WY_LOWP=lowp, A_COLS=bool(KNOBS["a_cols"]), **gkw, INV_X4=bool(KNOBS["inv_x4"]),
        A_TRI=bool(KNOBS["a_tri"]) and BT == 4 * BC, T_REGS=bool(KNOBS["t_regs"]), WY=not split,
        A_D32=int(KNOBS["k3_diag32"] or 0) if k3 and -5.0 <= float(lower_bound) < 0.0 and BT == 64 else 0,
        **_launch(KNOBS["intra_warps"], KNOBS["intra_stages"], knob("maxnreg")),
    )  # fmt: skip
    NP = 2 if KNOBS["wy_split"] == 2 else 1
    wkw = dict(
        H=H, K=K, V=V, BT=BT, BV=min(KNOBS["wy_bw"], K, V), PREC=prec, WY_LOWP=lowp, NP=NP,
        **_launch(KNOBS["wy_warps"], KNOBS["wy_stages"], KNOBS["wy_maxnreg"]),
    )  # fmt: skip

    def intra(c_lo: int, c_hi: int) -> None:  # steps 1 (and 3) for chunks c_lo … c_hi − 1
        ci = cidx[c_lo:]
        _intra_kernel[(c_hi - c_lo, H)](
            q, k, v, gargs[0], beta, Gc, *gargs[1:], Aqk, Akk, W, U, Kd, cu, ci, scale, **ikw
        )
        if split:
            _wy_kernel[(c_hi - c_lo, H, NP)](k, v, Gc, beta, Akk, W, U, Kd, cu, ci, **wkw)

    BVs = min(KNOBS["state_bv"] if K > 64 else 64, V)
    h0 = initial_state.contiguous() if initial_state is not None else None
    fuse_o = bool(KNOBS["fuse_out"])
    pieces = _pipe_pieces(plan, H, triton.cdiv(V, BVs))
    SEG = 0 if pieces else _state_segments(plan, H, triton.cdiv(V, min(BVs, K)))
    sg = plan.segs(SEG) if SEG else None
    wide = KNOBS["state_bv_wide"]
    if sg is not None:
        BVs = min(BVs, K)
    elif K > 64 and wide and N * H * triton.cdiv(V, wide) >= KNOBS["state_bv_wide_progs"]:
        BVs = min(wide, V)  # many programs anyway: fewer re-reads of W / Kd per V column
    if fuse_o:
        h = vnew = o  # unused (not stored)
    else:
        h = torch.empty(nch, H, K, V, dtype=io, device=dev)
        vnew = torch.empty(B, T, H, V, dtype=io, device=dev)
    skw = {"H": H, "K": K, "V": V, "BT": BT, "BV": BVs, "HAS_H0": h0 is not None,
           "STORE_HT": ht is not None, "PREC": prec, "FUSE_O": fuse_o}  # fmt: skip
    lkw = _launch(KNOBS["state_warps"], KNOBS["state_stages"], KNOBS["state_maxnreg"])
    h0_ = h0 if h0 is not None else Gc
    ht_ = ht if ht is not None else Gc
    BVo = min(KNOBS["out_bv"], V)
    okw = dict(H=H, K=K, V=V, BT=BT, BV=BVo, PREC=prec,
               **_launch(KNOBS["out_warps"], KNOBS["out_stages"], KNOBS["out_maxnreg"]))  # fmt: skip

    def output(c_lo: int, c_hi: int) -> None:  # step 3 for chunks c_lo … c_hi − 1
        if not fuse_o:
            _output_kernel[(c_hi - c_lo, H, triton.cdiv(V, BVo))](
                q, Gc, Aqk, h, vnew, o, cu, cidx[c_lo:], scale, c_lo, **okw
            )

    if pieces:
        # pipelined: piece p's state pass and output (side stream) run while the intra kernel
        # does piece p + 1 (main stream); the state crosses pieces through S0 rows (MODE 3)
        rows, prow, crange, empty = plan.pieces(pieces)
        S0 = torch.empty(prow[-1], H, K, V, dtype=torch.float32, device=dev)
        if ht is not None and empty:
            idx = torch.tensor(empty, device=dev)
            ht[idx] = h0[idx] if h0 is not None else 0.0
        main = side = None
        if dev.type == "cuda":
            main = torch.cuda.current_stream(dev)
            side = _side_stream(dev)
            side.wait_stream(main)
        for p, (c_lo, c_hi) in enumerate(crange):
            intra(c_lo, c_hi)
            if side is not None:
                side.wait_stream(main)
            with torch.cuda.stream(side) if side is not None else _nullctx():
                _state_kernel[(prow[p + 1] - prow[p], H, triton.cdiv(V, BVs))](
                    W, U, Kd, Gc, h, vnew, h0_, ht_, cu, coff, rows[prow[p]:], S0, Gc, q, Aqk, o, scale,
                    MODE=3, **skw, **lkw,
                )  # fmt: skip
                output(c_lo, c_hi)
        if side is not None:
            main.wait_stream(side)
        return o, ht

    intra(0, nch)
    if sg is None:
        _state_kernel[(N, H, triton.cdiv(V, BVs))](
            W, U, Kd, Gc, h, vnew, h0_, ht_, cu, coff, coff, Gc, Gc, q, Aqk, o, scale, MODE=0, **skw, **lkw,
        )  # fmt: skip
    else:
        # the state pass in segments (few programs per sequence otherwise): each segment's affine
        # map [M | B] in parallel, a short scan over segments, then every segment from its start
        seg, soff, NS = sg
        AB = torch.empty(NS, H, K, K + V, dtype=torch.float32, device=dev)
        S0 = torch.empty(NS, H, K, V, dtype=torch.float32, device=dev)
        _state_kernel[(NS, H, (K + V) // BVs)](
            W, U, Kd, Gc, h, vnew, h0_, ht_, cu, coff, seg, S0, AB, q, Aqk, o, scale, MODE=2, **skw, **lkw,
        )  # fmt: skip
        BVq = min(KNOBS["scan_bv"], V)
        _seg_scan_kernel[(N, H, V // BVq)](
            AB, h0_, S0, soff, H=H, K=K, V=V, BV=BVq, HAS_H0=h0 is not None,
            PREC="ieee" if prec == "ieee" else "tf32x3", num_warps=KNOBS["scan_warps"],
        )  # fmt: skip
        _state_kernel[(NS, H, triton.cdiv(V, BVs))](
            W, U, Kd, Gc, h, vnew, h0_, ht_, cu, coff, seg, S0, AB, q, Aqk, o, scale, MODE=1, **skw, **lkw,
        )  # fmt: skip
    output(0, nch)
    return o, ht


__all__ = ["G_MIN", "KNOBS", "chunk_kda_triton"]
