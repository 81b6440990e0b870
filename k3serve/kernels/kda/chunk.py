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
sequences that share a width (a sequence's last chunk is computed over the fewest columns
that hold its tokens: 8, 16, 32, 48 or ``C``); the carry loops over chunk *index within a
sequence* and is batched over sequences, so a varlen batch costs ``max_n ceil(T_n / C)``
small steps.
"""

from __future__ import annotations

import torch

from k3serve.kernels.kda.naive import check_kda_inputs, compute_dtype, seq_bounds

_SUB = 16  # sub-chunk inside which pairwise decays are formed elementwise


def _exp_masked(diff: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``exp(diff)`` where ``mask``, else 0: masked-out entries become ``−inf`` before the
    exponential, so they are never exponentiated and their gradient is exactly 0 (no
    ``0 · inf`` from an overflowed entry)."""
    return diff.masked_fill(~mask, float("-inf")).exp()


def _width(n: int, C: int) -> int:
    """Columns a chunk holding ``n`` real tokens is computed over: the smallest of 8, 16, 32,
    48, … ``C`` that holds them, or ``C`` itself when ``C`` is not a multiple of 16. Pad
    columns only add exact zeros; the width depends on the chunk alone, so a chunk's terms do
    not depend on the chunks it is batched with."""
    if C % _SUB:
        return C
    if n <= _SUB // 2:
        return _SUB // 2
    return min(C, -(-n // _SUB) * _SUB)


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
    (m,) = decay_scores((a,), b, G, sub)
    if strict:
        C = m.shape[-1]
        m = m.masked_fill(torch.eye(C, dtype=torch.bool, device=m.device), 0.0)
    return m


def decay_scores(
    rows: tuple[torch.Tensor, ...], b: torch.Tensor, G: torch.Tensor, sub: int = _SUB
) -> tuple[torch.Tensor, ...]:
    r""":func:`chunk_decay_scores` (``i ≤ t``) for each ``a`` of ``rows`` against one ``b``: the
    pairwise decays and their products with ``b`` are formed once for all of them (the chunk
    form needs ``K·Kᵀ`` and ``Q·Kᵀ`` over the same decays). The strict scores are these with
    the diagonal set to 0 (each entry is its own sum over ``d``, so the others are unchanged).

    Returns:
        One ``[..., C, C]`` per entry of ``rows``.
    """
    C, K = b.shape[-2:]
    if C % sub:
        sub = C
    NS = C // sub
    lead = b.shape[:-2]
    b_s, G_s = (x.reshape(*lead, NS, sub, K) for x in (b, G))
    a_s = [a.reshape(*lead, NS, sub, K) for a in rows]
    dev = b.device
    ar = torch.arange(sub, device=dev)
    tri = ar[None, :] <= ar[:, None]  # [t, i]
    # diagonal sub-blocks: elementwise pairwise decays [.., NS, t, i, K], times b_i
    Pb = _exp_masked(G_s.unsqueeze(-2) - G_s.unsqueeze(-3), tri[:, :, None]) * b_s.unsqueeze(-3)
    diag = [(Pb @ x.unsqueeze(-1)).squeeze(-1) for x in a_s]  # [.., NS, t, i]
    if NS == 1:
        return tuple(d.reshape(*lead, C, C) for d in diag)
    # off-diagonal sub-blocks (j < s): split the decay at r_s = last position before sub-chunk s
    Gr = torch.cat([G_s[..., :1, 0, :], G_s[..., :-1, -1, :]], dim=-2)  # [.., NS, K]
    up = (G_s - Gr.unsqueeze(-2)).exp()  # exponents ≤ 0
    sj = torch.arange(NS, device=dev)
    below = (sj[None, :] < sj[:, None])[:, :, None, None]  # [s, j, 1, 1]
    dk = Gr[..., :, None, None, :] - G_s[..., None, :, :, :]  # [.., s, j, c, K]
    b_hat_t = (b_s.unsqueeze(-4) * _exp_masked(dk, below)).transpose(-1, -2)
    eye = torch.eye(NS, dtype=torch.bool, device=dev)[:, :, None, None]
    out = []
    for x, d in zip(a_s, diag, strict=True):
        off = (x * up).unsqueeze(-3) @ b_hat_t  # [.., s, j, t, i]
        blocks = torch.where(eye, d.unsqueeze(-3), off)
        out.append(blocks.transpose(-3, -2).reshape(*lead, C, C))
    return tuple(out)


class _ChunkLayout:
    """Where each sequence's tokens sit in a ``[NCH, C]`` grid of chunks (seq-major).

    ``idx [NCH, C]`` holds flat token rows (``b * T + t``), padded with the dummy row
    ``B * T``; per sequence ``first`` chunk and chunk count ``nc``; per
    chunk ``count``, its number of real tokens (host ints).
    """

    def __init__(self, cu_seqlens: torch.Tensor | None, B: int, T: int, C: int, device):
        idx, first, nc, count = [], [], [], []
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
                count += [C] * (m - 1) + [L - (m - 1) * C]
        self.num_chunks = n_chunks
        self.idx = (torch.cat(idx) if idx else torch.empty(0, C, dtype=torch.long)).to(device)
        self.first = first
        self.nc = nc
        self.count = count

    def groups(self, C: int) -> list[tuple[int, list[int] | None]]:
        """``(width, chunks)`` per width of :func:`_width` present, widest first; ``chunks``
        is None when every chunk has that width."""
        by: dict[int, list[int]] = {}
        for c, n in enumerate(self.count):
            by.setdefault(_width(n, C), []).append(c)
        if len(by) == 1:
            return [(next(iter(by)), None)]
        return sorted(by.items(), reverse=True)


def _rows(x: torch.Tensor, dt: torch.dtype) -> torch.Tensor:
    """``[B, T, H, ...]`` → ``[B * T + 1, H, ...]`` in ``dt``: the token rows, then the dummy
    row ``B * T`` (0) that pads the chunks; chunk rows ``idx [n, w]`` are then
    ``rows[idx].transpose(1, 2)`` (``[n, H, w, ...]``)."""
    flat = x.reshape(-1, *x.shape[2:]).to(dt)
    return torch.cat([flat, flat.new_zeros(1, *flat.shape[1:])])


def _chunk_terms(q, k, v, g, beta):
    """The intra-chunk terms of chunks ``q, k [n, H, w, K]``, ``v [n, H, w, V]``, ``g`` (raw
    log-decay, like ``k``), ``beta [n, H, w]`` (pads all 0), by the module docstring's algebra.

    Returns:
        ``(O [n, H, w, V], Q_inter [n, H, w, K], M [n, H, K, K], KU [n, H, K, V],
        decay [n, H, K, 1])``: the chunk's output is ``O + Q_inter @ S₀`` and its end state
        ``decay · S₀ − M @ S₀ + KU``.
    """
    w, V = q.shape[-2], v.shape[-1]
    G = g.cumsum(-2)  # in-chunk cumulative decay, ≤ 0, non-increasing
    Akk, Aqk = decay_scores((k, q), k, G)
    Akk = Akk.masked_fill(torch.eye(w, dtype=torch.bool, device=q.device), 0.0)  # i < t
    L = torch.eye(w, dtype=q.dtype, device=q.device) + beta.unsqueeze(-1) * Akk  # unit lower
    rhs = beta.unsqueeze(-1) * torch.cat([v, G.exp() * k], dim=-1)
    UW = torch.linalg.solve_triangular(L, rhs, upper=False, unitriangular=True)
    Ut, W = UW[..., :V], UW[..., V:]  # pseudo-values Ũ [.., w, V], W [.., w, K]
    Q_inter = G.exp() * q - Aqk @ W  # [.., w, K]: o gets Q_inter @ S₀
    O = Aqk @ Ut
    GC = G[..., -1, :]  # [n, H, K] (pad tokens have g = 0, so this is the last real one)
    Kd = k * (GC.unsqueeze(-2) - G).exp()  # exponents ≤ 0
    M = Kd.transpose(-1, -2) @ W  # [n, H, K, K]
    KU = Kd.transpose(-1, -2) @ Ut  # [n, H, K, V]
    return O, Q_inter, M, KU, GC.exp().unsqueeze(-1)


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
    differentiable by autograd (``q, k, v, g, beta, initial_state``). A chunk with fewer real
    tokens than ``chunk_size`` (a sequence's last) is computed over :func:`_width` columns
    only, chunks of one width batched together.

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

    rows_in = [_rows(x, dt) for x in (q, k, v, g, beta)]  # padded once, gathered per width
    groups = []  # (chunk ids or None for all, token rows [n, w], O, Q_inter)
    carry = []  # (M, KU, decay) per group
    for w, chunks in lay.groups(C):
        sel = None if chunks is None else torch.tensor(chunks, device=q.device)
        idx = lay.idx[:, :w] if sel is None else lay.idx[sel, :w]
        qc, kc, vc, gc, bc = (x[idx].transpose(1, 2) for x in rows_in)
        O, Q_inter, M, KU, decay = _chunk_terms(qc * scale, kc, vc, gc, bc)
        groups.append((sel, idx, O, Q_inter))
        carry.append((M, KU, decay))
    if len(carry) == 1:
        M, KU, decay = carry[0]
    else:  # back to chunk order
        back = torch.argsort(torch.cat([sel for sel, *_ in groups]))
        M, KU, decay = (torch.cat(parts)[back] for parts in zip(*carry))

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

    rows, ids = [], []  # every real token's output row, and its flat token row
    for sel, idx, O, Q_inter in groups:
        out = O + Q_inter @ (S0 if sel is None else S0[sel])  # [n, H, w, V]
        real = idx < B * T
        rows.append(out.transpose(1, 2)[real])
        ids.append(idx[real])
    o = rows[0] if len(rows) == 1 else torch.cat(rows)[torch.argsort(torch.cat(ids))]
    o = o.reshape(B, T, H, V).to(v.dtype)
    return o, (S if output_final_state else None)


__all__ = ["chunk_decay_scores", "chunk_kda", "decay_scores"]
