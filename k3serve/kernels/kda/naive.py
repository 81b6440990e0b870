"""Plain-torch reference for Kimi Delta Attention (KDA): the token-by-token recurrence and the gate.

This file is the spec every fast KDA path is tested against (DESIGN.md §2; Kimi Linear,
arXiv 2510.26692 §3). Per head the state is ``S ∈ R^{K×V}``; at step ``t``::

    S' = diag(exp(g_t)) S                      # channel-wise decay, g_t ≤ 0
    S  = S' + β_t k_t (v_t − S'ᵀ k_t)ᵀ          # delta-rule write
    o_t = Sᵀ (scale · q_t)                     # read after the update

Conventions follow fla-core (``fla.ops.kda.naive_recurrent_kda``): tensors ``[B, T, H, K]``,
states ``[N, H, K, V]``, ``scale`` defaults to ``K ** -0.5`` and is applied to ``q`` inside the
op; q and k are *not* L2-normalised here (the model does it before the op). Unlike fla's
reference, this one computes in float64 when given float64 (and in float32 for lower
precisions), and it accepts ``cu_seqlens``.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype KDA math runs in: the input dtype if at least float32, else float32."""
    return torch.promote_types(dtype, torch.float32)


def check_kda_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None,
) -> int:
    """Validate shapes for the ``[B, T, H, K]`` KDA ops; return the number of sequences ``N``.

    Raises:
        ValueError: a shape mismatch, ``B != 1`` with ``cu_seqlens``, or an ``initial_state``
            whose first dimension is not ``N``.
    """
    if q.dim() != 4:
        raise ValueError(f"q must be [B, T, H, K], got {tuple(q.shape)}")
    B, T, H, K = q.shape
    V = v.shape[-1]
    if k.shape != q.shape:
        raise ValueError(f"k must have q's shape {tuple(q.shape)}, got {tuple(k.shape)}")
    if g.shape != q.shape:
        raise ValueError(f"g must have q's shape {tuple(q.shape)}, got {tuple(g.shape)}")
    if v.shape != (B, T, H, V):
        raise ValueError(f"v must be [B, T, H, V] = {(B, T, H, V)}, got {tuple(v.shape)}")
    if beta.shape != (B, T, H):
        raise ValueError(f"beta must be [B, T, H] = {(B, T, H)}, got {tuple(beta.shape)}")
    if cu_seqlens is not None:
        if B != 1:
            raise ValueError(f"with cu_seqlens the batch size must be 1 (flattened), got B={B}")
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
            raise ValueError("cu_seqlens must be a 1-D tensor [N+1]")
        N = cu_seqlens.numel() - 1
    else:
        N = B
    if initial_state is not None and initial_state.shape != (N, H, K, V):
        raise ValueError(
            f"initial_state must be [N, H, K, V] = {(N, H, K, V)}, got {tuple(initial_state.shape)}"
        )
    return N


def seq_bounds(cu_seqlens: torch.Tensor | None, B: int, T: int) -> list[tuple[int, int, int]]:
    """``(batch_row, bos, eos)`` per sequence: one row per batch entry, or per ``cu_seqlens`` span."""
    if cu_seqlens is None:
        return [(b, 0, T) for b in range(B)]
    cu = cu_seqlens.tolist()
    if cu[0] != 0 or cu[-1] != T or any(a > b for a, b in itertools.pairwise(cu)):
        raise ValueError(f"cu_seqlens must rise from 0 to T={T}, got {cu}")
    return [(0, cu[i], cu[i + 1]) for i in range(len(cu) - 1)]


def naive_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    r"""KDA by the token-by-token recurrence (the spec; Kimi Linear arXiv 2510.26692 §3, eq. 1).

    Args:
        q (torch.Tensor): queries ``[B, T, H, K]`` (already L2-normalised by the caller).
        k (torch.Tensor): keys ``[B, T, H, K]`` (already L2-normalised by the caller).
        v (torch.Tensor): values ``[B, T, H, V]``.
        g (torch.Tensor): log-decay ``[B, T, H, K]``, ``≤ 0`` (see :func:`kda_gate`).
        beta (torch.Tensor): write strengths ``[B, T, H]`` in ``[0, 1]`` (post-sigmoid).
        scale (float, optional): multiplies ``q``. Default ``K ** -0.5``.
        initial_state (torch.Tensor, optional): ``[N, H, K, V]``, one row per sequence
            (``N = B``, or ``len(cu_seqlens) - 1``). Default zeros.
        output_final_state (bool): return the final states ``[N, H, K, V]``.
        cu_seqlens (torch.Tensor, optional): ``[N+1]`` int boundaries of ``N`` packed
            sequences; requires ``B == 1``. Sequences never see each other's state.

    Returns:
        ``(o, final_state)``: ``o [B, T, H, V]`` in ``v.dtype``; ``final_state [N, H, K, V]``
        in the compute dtype (float64 for float64 inputs, else float32), or ``None``.

    Raises:
        ValueError: on inconsistent shapes (see :func:`check_kda_inputs`).
    """
    check_kda_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    B, T, H, K = q.shape
    V = v.shape[-1]
    dt = compute_dtype(q.dtype)
    if scale is None:
        scale = K**-0.5
    q, k, v, g, beta = (x.to(dt) for x in (q, k, v, g, beta))
    q = q * scale
    o = q.new_zeros(B, T, H, V)
    finals = []
    for n, (b, bos, eos) in enumerate(seq_bounds(cu_seqlens, B, T)):
        S = q.new_zeros(H, K, V) if initial_state is None else initial_state[n].to(dt)
        for t in range(bos, eos):
            S = S * g[b, t].exp()[..., None]  # S' = diag(exp(g_t)) S
            kv = torch.einsum("hk,hkv->hv", k[b, t], S)  # S'ᵀ k_t
            u = beta[b, t, :, None] * (v[b, t] - kv)
            S = S + k[b, t, :, :, None] * u[:, None, :]
            o[b, t] = torch.einsum("hk,hkv->hv", q[b, t], S)
        finals.append(S)
    final = torch.stack(finals) if output_final_state else None
    return o.to(v.dtype), final


def kda_gate(
    f: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor | None = None,
    lower_bound: float | None = -5.0,
) -> torch.Tensor:
    r"""The KDA forget gate in log space, ``g ≤ 0``, from the gate projection output ``f``.

    * K3 (``lower_bound`` set, e.g. ``-5``): ``g = lb · σ(exp(A_log) · (f + dt_bias))``, so
      ``g ∈ (lb, 0)`` — every step keeps at least ``exp(lb)`` of each channel.
    * Kimi Linear (``lower_bound=None``): ``g = −exp(A_log) · softplus(f + dt_bias)``
      (arXiv 2510.26692 §3.1, the Mamba-2-style parameterisation).

    Same as fla-core's ``naive_kda_lowerbound_gate`` / ``naive_kda_gate``.

    Args:
        f (torch.Tensor): gate pre-activation ``[..., H, K]`` (from ``f_b_proj``).
        A_log (torch.Tensor): per-head log rate ``[H]``.
        dt_bias (torch.Tensor, optional): per-channel bias ``[H * K]``.
        lower_bound (float, optional): the bound ``lb < 0``; ``None`` selects the softplus form.

    Returns:
        ``g [..., H, K]`` in float32 (float64 if ``f`` is float64). Differentiable.
    """
    H, K = f.shape[-2:]
    if A_log.numel() != H:
        raise ValueError(f"A_log must have H={H} elements, got {A_log.numel()}")
    dt = compute_dtype(f.dtype)
    x = f.to(dt)
    if dt_bias is not None:
        if dt_bias.numel() != H * K:
            raise ValueError(f"dt_bias must have H*K={H * K} elements, got {dt_bias.numel()}")
        x = x + dt_bias.to(dt).view(H, K)
    a = A_log.to(dt).view(H, 1).exp()
    if lower_bound is None:
        return -a * F.softplus(x)
    return lower_bound * torch.sigmoid(a * x)


def causal_conv_varlen(
    x: torch.Tensor,
    weight: torch.Tensor,
    cu_seqlens: torch.Tensor,
    history: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv (no bias) + SiLU over packed sequences that continue a history.

    The reference of :func:`k3serve.kernels.prefill_triton.conv_varlen_triton`; the model
    calls it through :func:`k3serve.kernels.dispatch.conv_varlen`.

    Args:
        x: ``[T, C]`` pre-conv inputs of the new tokens, sequences packed by ``cu_seqlens``.
        weight: ``[C, W]`` taps; ``weight[:, W-1]`` multiplies the current token (F.conv1d order).
        cu_seqlens: ``[N+1]`` int64 boundaries in ``x``.
        history: ``[N, W-1, C]`` last W−1 pre-conv inputs of each sequence, oldest first, or None
            (zeros: fresh sequences).

    Returns:
        ``(y [T, C] in x.dtype, new_history [N, W-1, C] in x.dtype)``.
    """
    t, c = x.shape
    n = cu_seqlens.shape[0] - 1
    w = weight.shape[-1]
    if history is None:
        history = x.new_zeros(n, w - 1, c)
    dev = x.device
    lens = cu_seqlens[1:] - cu_seqlens[:-1]
    seq_idx = torch.repeat_interleave(torch.arange(n, device=dev), lens)
    # ext = [hist_0 ; x_0 ; hist_1 ; x_1 ; ...]; a new token t sits at t + (seq+1)(W-1)
    tok_pos = torch.arange(t, device=dev) + (seq_idx + 1) * (w - 1)
    hist_pos = (cu_seqlens[:-1] + torch.arange(n, device=dev) * (w - 1)).view(n, 1) + torch.arange(
        w - 1, device=dev
    )
    ext = x.new_empty(t + n * (w - 1), c)
    ext[hist_pos.reshape(-1)] = history.to(x.dtype).reshape(-1, c)
    ext[tok_pos] = x
    wf = weight.float()
    y = torch.zeros(t, c, dtype=torch.float32, device=dev)
    for j in range(w):
        y = y + ext[tok_pos - (w - 1) + j].float() * wf[:, j]
    tail = (cu_seqlens[:-1] + torch.arange(n, device=dev) * (w - 1) + lens).view(
        n, 1
    ) + torch.arange(w - 1, device=dev)
    return F.silu(y).to(x.dtype), ext[tail.reshape(-1)].view(n, w - 1, c)


__all__ = [
    "causal_conv_varlen",
    "check_kda_inputs",
    "compute_dtype",
    "kda_gate",
    "naive_recurrent_kda",
    "seq_bounds",
]
