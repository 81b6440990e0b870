"""Chunkwise KDA in plain torch: the prefill / training path (differentiable by autograd).

Kimi Linear (arXiv 2510.26692) §4, the chunkwise form of the KDA recurrence in
``naive.py``. Inside a chunk of ``C`` tokens (positions ``1..C``, state ``S₀`` at its start)
let ``G_t = Σ_{s≤t} g_s`` be the in-chunk cumulative log-decay (``G`` only falls). With
``Ŝ_t = diag(exp(−G_t)) S_t`` the recurrence becomes additive,
``Ŝ_t = S₀ + Σ_{i≤t} (k_i ⊙ exp(−G_i)) u_iᵀ``, where the *pseudo-values*

    u_t = β_t (v_t − (exp(G_t) ⊙ k_t)ᵀ S₀ − Σ_{i<t} A_ti u_i),
    A_ti = Σ_d k_t[d] k_i[d] exp(G_t[d] − G_i[d])                 (i < t)

solve one unit-lower-triangular system per chunk (the UT / WY transform):
``U = Ũ − W S₀`` with ``[Ũ | W] = (I + diag(β) A)⁻¹ [diag(β) V | diag(β)(exp(G) ⊙ K)]``.
Then, with ``Aq_ti = Σ_d q_t[d] k_i[d] exp(G_t[d] − G_i[d])`` (i ≤ t, q pre-scaled)::

    O        = Aq Ũ + (exp(G) ⊙ Q − Aq W) S₀                       (intra + inter)
    S_next   = diag(exp(G_C)) S₀ + (K ⊙ exp(G_C − G))ᵀ (Ũ − W S₀)

Every exponent above is a *difference* ``G_t − G_i`` with ``i ≤ t`` (so ``≤ 0``): nothing
is ever divided by a decayed quantity, so no step can overflow, whatever the gate. The
pairwise ``[C, C, K]`` decays are only formed inside 16-token sub-chunks; between sub-chunks
the decay is split at the sub-chunk boundary ``r`` (``G_t − G_i = (G_t − G_r) + (G_r − G_i)``,
both ``≤ 0``) so the sub-chunk products are plain matmuls (the same split fla's kernels use).

Everything except the chunk-to-chunk state carry is batched over all chunks of all
sequences; the carry loops over chunk *index within a sequence* and is batched over
sequences, so a varlen batch costs ``max_n ceil(T_n / C)`` small steps.
"""

from __future__ import annotations

import torch

from k3serve.kernels.kda.naive import check_kda_inputs, compute_dtype, seq_bounds

_SUB = 16  # sub-chunk inside which pairwise decays are formed elementwise


def _exp_masked(diff: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``exp(diff)`` where ``mask``, else 0 — without ever exponentiating a masked-out entry."""
    return torch.where(mask, torch.where(mask, diff, torch.zeros_like(diff)).exp(), 0.0)


def chunk_decay_scores(
    a: torch.Tensor, b: torch.Tensor, G: torch.Tensor, strict: bool, sub: int = _SUB
) -> torch.Tensor:
    r"""Lower-triangular decayed scores ``M_ti = Σ_d a_t[d] b_i[d] exp(G_t[d] − G_i[d])``.

    Args:
        a, b (torch.Tensor): ``[..., C, K]`` (rows ``t`` and columns ``i``).
        G (torch.Tensor): ``[..., C, K]`` in-chunk cumulative log-decay (non-increasing in ``t``).
        strict (bool): keep ``i < t`` (else ``i ≤ t``); other entries are 0.
        sub (int): sub-chunk size; ``C % sub != 0`` falls back to one sub-chunk.

    Returns:
        ``[..., C, C]``.
    """
    C, K = a.shape[-2:]
    if C % sub:
        sub = C
    NS = C // sub
    lead = a.shape[:-2]
    a_s, b_s, G_s = (x.reshape(*lead, NS, sub, K) for x in (a, b, G))
    dev = a.device
    ar = torch.arange(sub, device=dev)
    tri = (ar[None, :] < ar[:, None]) if strict else (ar[None, :] <= ar[:, None])  # [t, i]
    # diagonal sub-blocks: elementwise pairwise decays [.., NS, t, i, K]
    P = _exp_masked(G_s.unsqueeze(-2) - G_s.unsqueeze(-3), tri[:, :, None])
    diag = ((P * b_s.unsqueeze(-3)) @ a_s.unsqueeze(-1)).squeeze(-1)  # [.., NS, t, i]
    if NS == 1:
        return diag.reshape(*lead, C, C)
    # off-diagonal sub-blocks (j < s): split the decay at r_s = last position before sub-chunk s
    Gr = torch.cat([G_s[..., :1, 0, :], G_s[..., :-1, -1, :]], dim=-2)  # [.., NS, K]
    a_hat = a_s * (G_s - Gr.unsqueeze(-2)).exp()  # exponents ≤ 0
    sj = torch.arange(NS, device=dev)
    below = (sj[None, :] < sj[:, None])[:, :, None, None]  # [s, j, 1, 1]
    dk = Gr[..., :, None, None, :] - G_s[..., None, :, :, :]  # [.., s, j, c, K]
    b_hat = b_s.unsqueeze(-4) * _exp_masked(dk, below)
    off = a_hat.unsqueeze(-3) @ b_hat.transpose(-1, -2)  # [.., s, j, t, i]
    eye = torch.eye(NS, dtype=torch.bool, device=dev)[:, :, None, None]
    blocks = torch.where(eye, diag.unsqueeze(-3), off)
    return blocks.transpose(-3, -2).reshape(*lead, C, C)


class _ChunkLayout:
    """Where each sequence's tokens sit in a ``[NCH, C]`` grid of chunks (seq-major).

    ``idx [NCH, C]`` holds flat token rows (``b * T + t``), padded with the dummy row
    ``B * T``; ``valid [NCH, C]``; per sequence ``first`` chunk and chunk count ``nc``.
    """

    def __init__(self, cu_seqlens: torch.Tensor | None, B: int, T: int, C: int, device):
        idx, first, nc = [], [], []
        ar = torch.arange(C)
        n_chunks = 0
        for b, bos, eos in seq_bounds(cu_seqlens, B, T):
            L = eos - bos
            m = -(-L // C)
            first.append(n_chunks)
            nc.append(m)
            n_chunks += m
            if m:
                pos = bos + torch.arange(m)[:, None] * C + ar[None, :]
                idx.append(torch.where(pos < eos, b * T + pos, B * T))
        self.num_chunks = n_chunks
        self.idx = (torch.cat(idx) if idx else torch.empty(0, C, dtype=torch.long)).to(device)
        self.valid = self.idx < B * T
        self.first = first
        self.nc = nc

    def gather(self, x: torch.Tensor, dt: torch.dtype) -> torch.Tensor:
        """``[B, T, H, ...]`` → ``[NCH, H, C, ...]`` in ``dt``; pad rows are 0."""
        flat = x.reshape(-1, *x.shape[2:]).to(dt)
        flat = torch.cat([flat, flat.new_zeros(1, *flat.shape[1:])])
        return flat[self.idx].transpose(1, 2)


def chunk_kda(
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
) -> tuple[torch.Tensor, torch.Tensor | None]:
    r"""KDA over whole sequences by the chunkwise (UT/WY) form; equals :func:`naive_recurrent_kda`.

    Kimi Linear arXiv 2510.26692 §4 (see the module docstring for the algebra). Plain torch,
    differentiable by autograd (``q, k, v, g, beta, initial_state``).

    Args:
        q (torch.Tensor): queries ``[B, T, H, K]`` (L2-normalised by the caller).
        k (torch.Tensor): keys ``[B, T, H, K]`` (L2-normalised by the caller).
        v (torch.Tensor): values ``[B, T, H, V]``.
        g (torch.Tensor): log-decay ``[B, T, H, K]``, ``≤ 0``.
        beta (torch.Tensor): ``[B, T, H]`` in ``[0, 1]``.
        scale (float, optional): multiplies ``q``. Default ``K ** -0.5``.
        initial_state (torch.Tensor, optional): ``[N, H, K, V]``; default zeros.
        output_final_state (bool): also return ``[N, H, K, V]`` final states.
        cu_seqlens (torch.Tensor, optional): ``[N+1]`` boundaries of packed sequences
            (``B == 1``); each sequence starts from its own ``initial_state`` row.
        chunk_size (int): tokens per chunk ``C`` (64; multiples of 16 use the sub-chunk path).

    Returns:
        ``(o [B, T, H, V]`` in ``v.dtype``, ``final_state [N, H, K, V]`` in the compute dtype
        (float64 for float64 inputs, else float32) or ``None)``.

    Raises:
        ValueError: on inconsistent shapes or a bad ``cu_seqlens``.
    """
    N = check_kda_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    B, T, H, K = q.shape
    V = v.shape[-1]
    C = int(chunk_size)
    if C < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    dt = compute_dtype(q.dtype)
    if scale is None:
        scale = K**-0.5
    lay = _ChunkLayout(cu_seqlens, B, T, C, q.device)
    if initial_state is None:
        S = q.new_zeros(N, H, K, V, dtype=dt)
    else:
        S = initial_state.to(dt)
    if lay.num_chunks == 0:
        return v.new_zeros(B, T, H, V), (S if output_final_state else None)

    qc, kc, gc = lay.gather(q, dt) * scale, lay.gather(k, dt), lay.gather(g, dt)
    vc, bc = lay.gather(v, dt), lay.gather(beta, dt)  # [NCH, H, C, V], [NCH, H, C]
    G = gc.cumsum(-2)  # in-chunk cumulative decay, ≤ 0, non-increasing
    Akk = chunk_decay_scores(kc, kc, G, strict=True)
    Aqk = chunk_decay_scores(qc, kc, G, strict=False)
    eye = torch.eye(C, dtype=dt, device=q.device)
    L = eye + bc.unsqueeze(-1) * Akk  # unit lower triangular
    rhs = bc.unsqueeze(-1) * torch.cat([vc, G.exp() * kc], dim=-1)
    UW = torch.linalg.solve_triangular(L, rhs, upper=False, unitriangular=True)
    Ut, W = UW[..., :V], UW[..., V:]  # pseudo-values Ũ [.., C, V], W [.., C, K]
    Q_inter = G.exp() * qc - Aqk @ W  # [.., C, K]: o gets Q_inter @ S₀
    O = Aqk @ Ut
    GC = G[..., -1, :]  # [NCH, H, K] (pad tokens have g = 0, so this is the last real one)
    Kd = kc * (GC.unsqueeze(-2) - G).exp()  # exponents ≤ 0
    M = Kd.transpose(-1, -2) @ W  # [NCH, H, K, K]
    KU = Kd.transpose(-1, -2) @ Ut  # [NCH, H, K, V]
    decay = GC.exp().unsqueeze(-1)  # [NCH, H, K, 1]

    # chunk-to-chunk carry: step j advances every sequence that has a j-th chunk
    max_nc = max(lay.nc)
    first = torch.tensor(lay.first, device=q.device)
    ncs = torch.tensor(lay.nc, device=q.device)
    starts, order = [], []
    for j in range(max_nc):
        if j < min(lay.nc):
            act, S_a = None, S
            cidx = first + j
        else:
            act = torch.nonzero(ncs > j).squeeze(-1)
            S_a = S[act]
            cidx = first[act] + j
        starts.append(S_a)
        order.append(cidx)
        S_new = decay[cidx] * S_a - M[cidx] @ S_a + KU[cidx]
        S = S_new if act is None else S.index_copy(0, act, S_new)
    S0 = torch.cat(starts)[torch.argsort(torch.cat(order))]  # state at each chunk's start
    O = O + Q_inter @ S0  # [NCH, H, C, V]
    o = O.transpose(1, 2).reshape(-1, H, V)[lay.valid.reshape(-1)]
    o = o.reshape(B, T, H, V).to(v.dtype)
    return o, (S if output_final_state else None)


__all__ = ["chunk_decay_scores", "chunk_kda"]
