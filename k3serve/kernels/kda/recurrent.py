"""KDA decode in plain torch: one recurrent step over a state pool, and a batched multi-step form.

The step is the KDA recurrence of ``naive.py`` (Kimi Linear arXiv 2510.26692 §3) applied
to ``N`` running sequences at once, their states living in rows of a persistent pool
``[S, H, K, V]`` float32 (one KDA layer's slice of ``kda_state``, INTERFACES.md §1).
The torch path gathers the rows, updates them and scatters them back; the Triton path
(``recurrent_triton.py``) updates the pool rows in place without copies.
"""

from __future__ import annotations

import torch

from k3serve.kernels.kda.naive import check_kda_inputs, compute_dtype, seq_bounds


def kda_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    S: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One KDA step for a batch: ``q, k, g [N, H, K]`` (q pre-scaled), ``v [N, H, V]``,
    ``beta [N, H]``, ``S [N, H, K, V]`` (all one dtype). Returns ``(o [N, H, V], S_new)``."""
    S = S * g.exp().unsqueeze(-1)
    u = beta.unsqueeze(-1) * (v - torch.einsum("nhk,nhkv->nhv", k, S))
    S = S + k.unsqueeze(-1) * u.unsqueeze(-2)
    return torch.einsum("nhk,nhkv->nhv", q, S), S


def fused_recurrent_kda_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state_pool: torch.Tensor,
    slots: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    r"""One KDA decode step for ``N`` sequences whose states live in ``state_pool`` rows ``slots``.

    Mutates ``state_pool[slots]`` in place (the new states); other rows are untouched.

    Args:
        q (torch.Tensor): ``[N, H, K]`` (L2-normalised by the caller).
        k (torch.Tensor): ``[N, H, K]`` (L2-normalised by the caller).
        v (torch.Tensor): ``[N, H, V]``.
        g (torch.Tensor): log-decay ``[N, H, K]``, ``≤ 0``.
        beta (torch.Tensor): ``[N, H]``.
        state_pool (torch.Tensor): ``[S, H, K, V]`` float32 (may be a strided view, e.g.
            ``kda_state[j]``). float64 pools are accepted (tests).
        slots (torch.Tensor): ``[N]`` int, distinct row indices into ``state_pool``.
        scale (float, optional): multiplies ``q``. Default ``K ** -0.5``.

    Returns:
        ``o [N, H, V]`` in ``v.dtype``.

    Raises:
        ValueError: on inconsistent shapes.
    """
    N, H, K = q.shape
    V = v.shape[-1]
    if k.shape != q.shape or g.shape != q.shape or v.shape != (N, H, V) or beta.shape != (N, H):
        raise ValueError(
            "decode step wants q, k, g [N, H, K], v [N, H, V], beta [N, H]; got "
            f"q {tuple(q.shape)} k {tuple(k.shape)} g {tuple(g.shape)} v {tuple(v.shape)} "
            f"beta {tuple(beta.shape)}"
        )
    if state_pool.dim() != 4 or state_pool.shape[1:] != (H, K, V):
        raise ValueError(f"state_pool must be [S, {H}, {K}, {V}], got {tuple(state_pool.shape)}")
    if slots.shape != (N,):
        raise ValueError(f"slots must be [N={N}], got {tuple(slots.shape)}")
    if scale is None:
        scale = K**-0.5
    dt = compute_dtype(state_pool.dtype)
    slots = slots.to(device=state_pool.device, dtype=torch.long)
    S = state_pool.index_select(0, slots).to(dt)
    o, S = kda_step(
        q.to(dt) * scale, k.to(dt), v.to(dt), g.to(dt), beta.to(dt), S
    )
    state_pool.index_copy_(0, slots, S.to(state_pool.dtype))
    return o.to(v.dtype)


def causal_conv_step(
    x: torch.Tensor,
    conv_pool: torch.Tensor,
    weight: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    r"""Depthwise causal conv + SiLU for one new token per sequence, updating the conv state.

    The plain-torch reference of
    :func:`k3serve.kernels.kda.recurrent_triton.causal_conv_step_triton` (the decode case of
    the short convolution before KDA; Kimi Linear arXiv 2510.26692 §3):
    ``y = silu(Σ_{j<W-1} state[j] · w[:, j] + x · w[:, W-1])`` in float32 (as the prefill conv
    ``k3serve.kernels.kda.naive.causal_conv_varlen``), then the state becomes ``[state[1:], x]`` (oldest
    first, values copied exactly). Mutates ``conv_pool[slots]``.

    Args:
        x (torch.Tensor): ``[N, C]`` pre-conv inputs (channels ``q | k | v``), model dtype.
        conv_pool (torch.Tensor): ``[S, W-1, C]`` (may be a strided view, e.g.
            ``conv_state[j]``); rows ``slots`` are mutated.
        weight (torch.Tensor): ``[C, W]`` taps (``weight[:, W-1]`` hits the current token).
        slots (torch.Tensor): ``[N]`` int, distinct rows of ``conv_pool``.

    Returns:
        ``y [N, C]`` in ``x.dtype``.

    Raises:
        ValueError: inconsistent shapes, or ``W < 2``.
    """
    N, C = x.shape
    W = weight.shape[-1]
    bad_pool = conv_pool.dim() != 3 or tuple(conv_pool.shape[1:]) != (W - 1, C)
    if W < 2 or weight.shape != (C, W) or bad_pool:
        raise ValueError(
            f"conv step wants x [N, C], weight [C, W>=2], conv_pool [S, W-1, C]; got x "
            f"{tuple(x.shape)}, weight {tuple(weight.shape)}, conv_pool {tuple(conv_pool.shape)}"
        )
    if slots.shape != (N,):
        raise ValueError(f"slots must be [N={N}], got {tuple(slots.shape)}")
    hist = conv_pool[slots]  # [N, W-1, C]
    ext = torch.cat([hist.to(x.dtype), x[:, None]], 1).float()  # [N, W, C]
    y = (ext * weight.float().t()[None]).sum(1)
    conv_pool[slots] = torch.cat([hist[:, 1:], x[:, None].to(conv_pool.dtype)], 1)  # exact shift
    return torch.nn.functional.silu(y).to(x.dtype)


def fused_recurrent_kda(
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
    r"""KDA by the recurrence, batched over sequences (fla's ``fused_recurrent_kda`` signature).

    Same contract and result as :func:`naive_recurrent_kda`, but one loop over time for all
    sequences at once (varlen sequences are right-padded with ``k = v = g = β = 0`` steps,
    which leave a state unchanged). Suited to short spans (speculative/multi-token decode).

    Args:
        q, k (torch.Tensor): ``[B, T, H, K]``. v: ``[B, T, H, V]``. g: ``[B, T, H, K]``.
        beta (torch.Tensor): ``[B, T, H]``.
        scale (float, optional): default ``K ** -0.5``.
        initial_state (torch.Tensor, optional): ``[N, H, K, V]``.
        output_final_state (bool): also return ``[N, H, K, V]``.
        cu_seqlens (torch.Tensor, optional): ``[N+1]``, with ``B == 1``.

    Returns:
        ``(o [B, T, H, V]`` in ``v.dtype``, final state in the compute dtype or ``None)``.
    """
    N = check_kda_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    B, T, H, K = q.shape
    V = v.shape[-1]
    dt = compute_dtype(q.dtype)
    if scale is None:
        scale = K**-0.5
    bounds = seq_bounds(cu_seqlens, B, T)
    Lmax = max((e - s for _, s, e in bounds), default=0)
    # [N, Lmax] gather of flat token rows; pad -> dummy zero row B*T
    pos = torch.arange(Lmax)
    idx = torch.stack(
        [torch.where(s + pos < e, b * T + s + pos, B * T) for b, s, e in bounds]
    ).to(q.device) if bounds else torch.empty(0, Lmax, dtype=torch.long, device=q.device)

    def pad(x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(B * T, *x.shape[2:]).to(dt)
        return torch.cat([flat, flat.new_zeros(1, *flat.shape[1:])])[idx]

    qp, kp, vp, gp, bp = pad(q) * scale, pad(k), pad(v), pad(g), pad(beta)
    S = q.new_zeros(N, H, K, V, dtype=dt) if initial_state is None else initial_state.to(dt)
    outs = []
    for t in range(Lmax):
        o_t, S = kda_step(qp[:, t], kp[:, t], vp[:, t], gp[:, t], bp[:, t], S)
        outs.append(o_t)
    o = q.new_zeros(B * T + 1, H, V, dtype=dt)
    if outs:
        o = o.index_copy(0, idx.reshape(-1), torch.stack(outs, 1).reshape(-1, H, V))
    o = o[: B * T].reshape(B, T, H, V).to(v.dtype)
    return o, (S if output_final_state else None)


def kda_decode_fused(
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
) -> torch.Tensor:
    r"""Plain-torch reference of
    :func:`k3serve.kernels.kda.recurrent_triton.kda_decode_fused_triton` (same contract): the
    decode ops of ``k3serve.model.kda.KDAMixer.forward`` after its input projections — short
    conv step, l2norm of q and k (rounded to the model dtype), :func:`kda_gate`, ``β = σ(b)``,
    :func:`fused_recurrent_kda_step`, gated output RMSNorm (float32, rounded once).
    Mutates ``conv_pool[slots]`` and ``state_pool[slots]``.
    """
    from k3serve.kernels.kda.naive import kda_gate

    n, h = proj.shape[0], num_heads
    hk = fb.shape[-1]
    k = hk // h
    dt = proj.dtype
    y = causal_conv_step(proj[:, : 3 * hk].contiguous(), conv_pool, conv_weight, slots)
    q, kk, v = y.view(n, 3, h, k).unbind(1)

    def l2(x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) + 1e-6)).to(dt)

    g = kda_gate(fb.view(n, h, k), A_log, dt_bias, lower_bound)
    beta = torch.sigmoid(proj[:, b_off : b_off + h].float())
    o = fused_recurrent_kda_step(l2(q), l2(kk), v, g, beta, state_pool, slots, scale).float()
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + eps) * norm_weight.float()
    gate = proj[:, g_off : g_off + hk].float().view(n, h, k)
    return (o * torch.sigmoid(gate)).to(dt).reshape(n, hk)


__all__ = [
    "causal_conv_step",
    "fused_recurrent_kda",
    "fused_recurrent_kda_step",
    "kda_decode_fused",
    "kda_step",
]
