"""Block Attention Residuals (arXiv 2603.15031; DESIGN.md §2).

``Mix(S) = Σ_{v∈S} softmax_v(w · (γ ⊙ RMSNorm(v))) · v`` over a set S of per-token vectors, in
float32, with a pseudo-query ``w`` (stored as a ``[1, d]`` weight ``*_res_proj.weight``) and a
norm weight ``γ`` (``*_res_norm.weight``) per use. The decoder keeps a list ``blocks`` and a
partial sum ``P`` (``P`` = embedding before layer 0); for layer l::

    h = Mix(blocks ∪ {P})                  attention-side weights (h = P while blocks is empty)
    if l % block_layers == 0: blocks.append(P); P = 0
    P += Mixer(input_norm(h))
    h = Mix(blocks ∪ {P})                  MLP-side weights
    P += FFN(post_norm(h))

and after the last layer ``Mix(blocks ∪ {P})`` with the output weights → final norm → LM head.
With ``block_layers == 0`` the stream is a plain residual: ``h = P``.
"""

from __future__ import annotations

import torch
from torch import nn

from k3serve.model.layers import RMSNorm, rms_norm


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


def make_res_params(d: int, eps: float, dtype: torch.dtype | None) -> tuple[RMSNorm, nn.Linear]:
    """A ``(norm, proj)`` pair for one AttnRes use: ``norm.weight [d]`` ones, ``proj.weight
    [1, d]`` zeros (zero pseudo-query = uniform mix at init, the paper's init)."""
    norm = RMSNorm(d, eps, dtype=dtype)
    proj = nn.Linear(d, 1, bias=False, dtype=dtype)
    nn.init.zeros_(proj.weight)
    return norm, proj


__all__ = ["attn_res_mix", "make_res_params"]
