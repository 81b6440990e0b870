"""Plain-torch references for the elementwise and residual-stream kernels: the spec every fused
path (:mod:`k3serve.kernels.fused_triton`, :mod:`k3serve.kernels.prefill_triton`) is tested
against, and what :mod:`k3serve.kernels.dispatch` runs where Triton does not.

* :func:`rms_norm` — ``x · rsqrt(mean(x²) + ε) · w`` in float32, cast back (Zhang & Sennrich
  2019).
* :func:`situ_glu` — K3's bounded SwiGLU ``[β·tanh(g/β)·σ(g)] · [β_l·tanh(u/β_l)]``;
  :func:`swiglu` — ``silu(g)·u`` (Shazeer 2020).
* :func:`l2norm` — fla's L2 norm over the last dim, in float32.
* :func:`attn_res_mix` — Block Attention Residuals' softmax mix (arXiv 2603.15031).
* :func:`res_mix_norm_ref` — one sublayer boundary of the residual stream (add, mix, norm).

The KDA and MLA references live beside their kernels (``kda/naive.py``, ``mla/naive.py``,
``moe/naive.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension, computed in float32.

    Args:
        x: ``[..., D]`` any float dtype.
        weight: ``[D]`` scale, or None for no scale.
        eps: added to the mean square before the reciprocal square root.

    Returns:
        ``[..., D]`` in ``x.dtype``: ``x / sqrt(mean(x²) + eps) * weight``.
    """
    dt = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        xf = xf * weight.float()
    return xf.to(dt)


def situ_glu(
    gate: torch.Tensor, up: torch.Tensor, beta: float = 4.0, beta_l: float = 25.0
) -> torch.Tensor:
    """SiTU-GLU, K3's bounded SwiGLU.

    ``[β·tanh(g/β)·σ(g)] · [β_l·tanh(u/β_l)]``; for small inputs it equals ``silu(g)·u``.

    Args:
        gate: ``[..., I]`` gate pre-activation g.
        up: ``[..., I]`` up pre-activation u.
        beta: gate bound β (4 in K3).
        beta_l: linear-branch bound β_l (25 in K3).

    Returns:
        ``[..., I]`` same dtype as ``gate``.
    """
    return (beta * torch.tanh(gate / beta) * torch.sigmoid(gate)) * (
        beta_l * torch.tanh(up / beta_l)
    )


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU: ``silu(g) · u`` (Shazeer 2020). Shapes ``[..., I]``."""
    return F.silu(gate) * up


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """fla's L2 norm over the last dim: ``x / sqrt(Σx² + eps)``, computed in float32."""
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) + eps)


def attn_res_mix(
    sources: list[torch.Tensor], norm_weight: torch.Tensor, query: torch.Tensor, eps: float
) -> torch.Tensor:
    """Softmax-weighted mix of per-token source vectors (arXiv 2603.15031, Block AttnRes).

    Args:
        sources: S tensors ``[T, d]`` (the stored block vectors, then the partial sum P).
        norm_weight: ``[d]`` γ of the RMSNorm applied to each source before scoring.
        query: ``[1, d]`` or ``[d]`` pseudo-query w.
        eps: RMSNorm epsilon.

    Returns:
        ``[T, d]`` in the dtype of ``sources[0]``; scores, softmax and sum in float32.

    Raises:
        ValueError: ``sources`` is empty.
    """
    if not sources:
        raise ValueError("sources: need at least one vector to mix")
    if len(sources) == 1:
        return sources[0]
    v = torch.stack([s.float() for s in sources], 0)  # [S, T, d]
    logits = rms_norm(v, norm_weight.float(), eps) @ query.float().reshape(-1)  # [S, T]
    alpha = torch.softmax(logits, dim=0)
    return (alpha.unsqueeze(-1) * v).sum(0).to(sources[0].dtype)


def res_mix_norm_ref(p, deltas, blocks, res_norm_weight, res_query, res_eps, norm_weight, eps):
    """Reference of :func:`k3serve.kernels.fused_triton.res_mix_norm_triton` (same contract):
    the expressions ``K3ForCausalLM`` runs at a sublayer boundary — ``y = d1 + d2``, ``P + y``,
    :func:`attn_res_mix` over ``blocks ∪ {P}``, then :func:`rms_norm`.

    Returns:
        ``(P' [T, D], out [T, D])`` in ``p.dtype``.
    """
    if deltas:
        y = deltas[0] if len(deltas) == 1 else deltas[0] + deltas[1]
        p = p + y
    if res_query is not None and blocks:
        h = attn_res_mix(list(blocks) + [p], res_norm_weight, res_query, res_eps)
    else:
        h = p
    return p, rms_norm(h, norm_weight, eps)


__all__ = ["attn_res_mix", "l2norm", "res_mix_norm_ref", "rms_norm", "situ_glu", "swiglu"]
