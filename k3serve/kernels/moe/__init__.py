"""Routed-expert kernels of the latent MoE: ``naive.py`` (per-expert loop, the reference),
``grouped.py`` (sort by expert + grouped GEMMs in torch, any device, no host sync) and
``grouped_triton.py`` (two Triton grouped-GEMM launches, bf16 or MXFP4 experts; imported lazily
by ``k3serve.kernels.dispatch``)."""

from __future__ import annotations

from k3serve.kernels.moe.grouped import (
    ExpertSort,
    grouped_mm,
    routed_experts_grouped,
    sort_by_expert,
)
from k3serve.kernels.moe.naive import routed_experts_loop

__all__ = [
    "ExpertSort",
    "grouped_mm",
    "routed_experts_grouped",
    "routed_experts_loop",
    "sort_by_expert",
]
