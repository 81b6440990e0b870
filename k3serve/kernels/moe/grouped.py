"""Routed experts as grouped GEMMs over tokens sorted by expert, with no host sync (torch path).

The sort (shared with the Triton path in ``grouped_triton.py``)::

    flat  = ids.reshape(-1)                    [T·k]   assignment a = t·k + j → expert flat[a]
    order = argsort(flat, stable)              [T·k]   assignments grouped by expert
    ends  = searchsorted(flat[order], 0..E-1, right)   [E] int32, ends[e] = Σ_{e' ≤ e} n_e'

Every shape depends on ``T`` and ``k`` only, never on how the tokens were routed, and nothing is
read back to the host (``torch.bincount`` is avoided: on CUDA it reads the input's max back).
Then per projection one grouped GEMM over the ``E`` row groups::

    h   = act(grouped_mm(z[order // k], W13ᵀ, ends))        [T·k, I]
    y_s = grouped_mm(h, W2ᵀ, ends) · w[order]               [T·k, W]
    y   = unsort(y_s).view(T, k, W).sum(1)                  [T, W]   (deterministic, no atomics)

``grouped_mm`` is ``torch._grouped_mm`` where the installed torch has it for the device and
dtype (CUDA bf16 on sm90+, CPU float32/bfloat16 in torch ≥ 2.9), else a padded ``bmm`` over a
static ``[E, T, ·]`` capacity layout (an expert holds each token at most once), which costs
``E / k`` times the useful FLOPs but keeps the same no-sync, static-shape contract.
The reference is ``naive.routed_experts_loop``.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from k3serve.kernels.moe.naive import Act


class ExpertSort(NamedTuple):
    """Assignments sorted by expert (all on the tokens' device, shapes static in ``T, k``).

    Fields:
        order: ``[T·k]`` int64, sorted position → assignment index ``t·k + j``.
        sorted_ids: ``[T·k]`` int64 expert of each sorted position (non-decreasing).
        ends: ``[E]`` int32 exclusive end of each expert's run of sorted positions.
    """

    order: torch.Tensor
    sorted_ids: torch.Tensor
    ends: torch.Tensor


def sort_by_expert(topk_ids: torch.Tensor, num_experts: int) -> ExpertSort:
    """Group the ``T·k`` (token, slot) assignments by expert without a host sync.

    Args:
        topk_ids: ``[T, k]`` integer expert ids in ``[0, num_experts)``.
        num_experts: ``E``.

    Returns:
        :class:`ExpertSort`.

    Raises:
        ValueError: ``topk_ids`` not 2-D integer, or ``num_experts < 1``.
    """
    if topk_ids.dim() != 2 or topk_ids.is_floating_point():
        raise ValueError(
            f"topk_ids: expected an integer [T, k], got {topk_ids.dtype} {tuple(topk_ids.shape)}"
        )
    if num_experts < 1:
        raise ValueError(f"num_experts: must be >= 1, got {num_experts}")
    flat = topk_ids.reshape(-1)
    sorted_ids, order = torch.sort(flat, stable=True)
    experts = torch.arange(num_experts, device=flat.device, dtype=sorted_ids.dtype)
    ends = torch.searchsorted(sorted_ids, experts, right=True, out_int32=True)
    return ExpertSort(order, sorted_ids, ends)


@functools.cache
def has_grouped_mm(device_type: str, dtype: torch.dtype) -> bool:
    """Whether ``torch._grouped_mm`` runs for 2-D × 3-D operands of ``dtype`` on the device."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        a = torch.zeros(16, 16, dtype=dtype, device=device_type)
        b = torch.zeros(2, 16, 16, dtype=dtype, device=device_type).transpose(1, 2)
        offs = torch.tensor([8, 16], dtype=torch.int32, device=device_type)
        torch._grouped_mm(a, b, offs=offs)
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    return True


def grouped_mm(
    a: torch.Tensor,
    w: torch.Tensor,
    ends: torch.Tensor,
    capacity: int | None = None,
    sorted_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Row-grouped ``a Wᵀ``: rows ``[ends[e-1], ends[e])`` of ``a`` times ``w[e]ᵀ``.

    Args:
        a: ``[M, K]`` rows sorted by group.
        w: ``[E, N, K]`` one weight per group (``out, in`` like ``nn.Linear``).
        ends: ``[E]`` int32 exclusive group ends (non-decreasing, ``ends[-1] == M``).
        capacity: rows per group in the padded fallback (≥ the largest group; ``M`` if None).
        sorted_ids: ``[M]`` group of each row, needed by the padded fallback.

    Returns:
        ``[M, N]`` in ``a.dtype``.
    """
    if has_grouped_mm(a.device.type, a.dtype) and a.dtype == w.dtype:
        return torch._grouped_mm(a, w.transpose(1, 2), offs=ends)
    if sorted_ids is None:
        raise ValueError("sorted_ids: the padded grouped_mm fallback needs each row's group")
    return _padded_grouped_mm(a, w, ends, sorted_ids, capacity or a.shape[0])


def _padded_grouped_mm(
    a: torch.Tensor, w: torch.Tensor, ends: torch.Tensor, sorted_ids: torch.Tensor, cap: int
) -> torch.Tensor:
    """Scatter rows into ``[E, cap, K]``, one ``bmm``, gather back (static shapes, no sync)."""
    e, n, _ = w.shape
    m = a.shape[0]
    starts = torch.cat((ends.new_zeros(1), ends[:-1])).long()
    slot = torch.arange(m, device=a.device) - starts[sorted_ids]
    flat_pos = sorted_ids * cap + slot
    buf = a.new_zeros(e * cap, a.shape[1]).index_copy_(0, flat_pos, a)
    out = torch.bmm(buf.view(e, cap, -1), w.transpose(1, 2).to(a.dtype))
    return out.view(e * cap, n).index_select(0, flat_pos)


def routed_experts_grouped(
    z: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    act: Act,
) -> torch.Tensor:
    """Weighted expert sum with one grouped GEMM per projection (torch, any device, no sync).

    Same contract as :func:`k3serve.kernels.moe.naive.routed_experts_loop`:

    Args:
        z: ``[T, W]`` expert inputs; the GEMMs run in ``z.dtype``.
        w13: ``[E, 2I, W]`` gate rows ``[0, I)`` then up rows ``[I, 2I)``.
        w2: ``[E, W, I]``.
        topk_ids: ``[T, k]`` int64 in ``[0, E)``; an expert appears at most once per token.
        topk_weights: ``[T, k]`` float32.
        act: the GLU.

    Returns:
        ``[T, W]`` float32.
    """
    t, k = topk_ids.shape
    inter = w2.shape[-1]
    s = sort_by_expert(topk_ids, w13.shape[0])
    a = z.index_select(0, s.order // k)
    gu = grouped_mm(a, w13.to(z.dtype), s.ends, t, s.sorted_ids)
    h = act(gu[:, :inter], gu[:, inter:])
    y = grouped_mm(h, w2.to(z.dtype), s.ends, t, s.sorted_ids).float()
    y = y * topk_weights.reshape(-1).float().index_select(0, s.order)[:, None]
    out = torch.empty_like(y).index_copy_(0, s.order, y)
    return out.view(t, k, w2.shape[1]).sum(1)


__all__ = ["ExpertSort", "grouped_mm", "routed_experts_grouped", "sort_by_expert"]
