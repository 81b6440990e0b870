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
With ``block_layers == 0`` the stream is a plain residual: ``h = P``. ``Mix`` itself is
:func:`k3serve.kernels.naive.attn_res_mix` (Triton for prefill through
:func:`k3serve.kernels.dispatch.attn_res_mix_prefill`).
"""

from __future__ import annotations

import torch
from torch import nn

from k3serve.model.layers import RMSNorm


def make_res_params(d: int, eps: float, dtype: torch.dtype | None) -> tuple[RMSNorm, nn.Linear]:
    """A ``(norm, proj)`` pair for one AttnRes use: ``norm.weight [d]`` ones, ``proj.weight
    [1, d]`` zeros (zero pseudo-query = uniform mix at init, the paper's init)."""
    norm = RMSNorm(d, eps, dtype=dtype)
    proj = nn.Linear(d, 1, bias=False, dtype=dtype)
    nn.init.zeros_(proj.weight)
    return norm, proj


__all__ = ["make_res_params"]
