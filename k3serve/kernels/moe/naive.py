"""Plain-torch reference of the routed-expert sum: one Python iteration per active expert.

For tokens ``z [T, W]``, top-k expert ids ``ids [T, k]`` and weights ``w [T, k]``::

    y[t] = Σ_j w[t, j] · E_{ids[t, j]}(z[t]),   E_e(z) = W2_e · act(W1_e z, W3_e z)

(DeepSeek-V3 §2.1.2; DESIGN.md §2). Gate and up weights are stacked ``w13 [E, 2I, W]``
(gate rows first), the down weight is ``w2 [E, W, I]``. This is the spec the grouped paths
(``grouped.py``, ``grouped_triton.py``) are tested against; it reads the per-expert counts
back to the host (``.tolist()``), which is exactly what the fast paths must not do.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

Act = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""A GLU ``act(gate [n, I], up [n, I]) -> [n, I]``."""


def routed_experts_loop(
    z: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    act: Act,
) -> torch.Tensor:
    """Weighted expert sum, one matmul group per active expert (reference).

    Args:
        z: ``[T, W]`` expert inputs (any float dtype; the matmuls run in it).
        w13: ``[E, 2I, W]`` gate (rows ``[0, I)``) and up (rows ``[I, 2I)``) weights.
        w2: ``[E, W, I]`` down weights.
        topk_ids: ``[T, k]`` int64 expert ids in ``[0, E)``.
        topk_weights: ``[T, k]`` float32 routing weights.
        act: the GLU.

    Returns:
        ``[T, W]`` float32.
    """
    t, k = topk_ids.shape
    inter = w2.shape[-1]
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    tok = order // k
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
    w_sorted = topk_weights.reshape(-1)[order].float()
    out = torch.zeros(t, z.shape[1], dtype=torch.float32, device=z.device)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        rows = tok[start : start + n]
        gu = F.linear(z[rows], w13[e])
        y = F.linear(act(gu[:, :inter], gu[:, inter:]), w2[e]).float()
        out.index_add_(0, rows, y * w_sorted[start : start + n, None])
        start += n
    return out


__all__ = ["Act", "routed_experts_loop"]
