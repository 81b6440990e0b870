"""The one switch between the plain-torch kernels and the Triton kernels.

``K3SERVE_KERNELS`` (read here and nowhere else):

* unset or ``triton`` — Triton for CUDA tensors (when Triton imports), torch for everything else;
* ``torch`` — torch everywhere (references; debugging a suspected kernel bug).

``K3SERVE_FUSED_DECODE`` (read here only): ``0`` turns off the fused decode-step kernels of the
model (:func:`fused_decode`: residual + AttnRes + norm per sublayer boundary, the whole KDA step,
the MLA decode pieces, MoE routing and tail, stacked-weight GEMMs) and keeps the unfused Triton
path they replace — for before/after measurements. Unset or ``1``: on wherever
:func:`use_triton` is, without gradients.

CPU tensors go to Triton only under ``TRITON_INTERPRET=1`` with ``K3SERVE_KERNELS=triton`` set
explicitly (how the CPU tests exercise the Triton code).
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

_ENV = "K3SERVE_KERNELS"
_CHOICES = ("torch", "triton")


def kernel_backend() -> str:
    """The configured backend name (``"triton"`` when unset).

    Raises:
        ValueError: ``K3SERVE_KERNELS`` set to something other than ``torch`` / ``triton``.
    """
    val = os.environ.get(_ENV, "").strip().lower() or "triton"
    if val not in _CHOICES:
        raise ValueError(f"{_ENV}={val!r}: expected one of {_CHOICES}")
    return val


@functools.cache
def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except (ImportError, RuntimeError):
        return False
    return True


def use_triton(device: Any = None) -> bool:
    """Whether kernels should run in Triton for tensors on ``device`` (a device, string or None).

    True for CUDA devices unless ``K3SERVE_KERNELS=torch``; for CPU only when
    ``K3SERVE_KERNELS=triton`` and ``TRITON_INTERPRET=1`` are both set explicitly.
    """
    if kernel_backend() == "torch" or device is None or not _triton_importable():
        return False
    dev = torch.device(device)
    if dev.type == "cuda":
        return True
    return (
        os.environ.get(_ENV, "").strip().lower() == "triton"
        and os.environ.get("TRITON_INTERPRET", "") == "1"
    )


def fused_decode(device: Any = None) -> bool:
    """Whether the model's decode step takes its fused Triton kernels (:func:`use_triton` and
    ``K3SERVE_FUSED_DECODE`` not ``0``; gradients always take the unfused path).

    Raises:
        ValueError: ``K3SERVE_FUSED_DECODE`` other than ``0`` / ``1``.
    """
    val = os.environ.get("K3SERVE_FUSED_DECODE", "").strip() or "1"
    if val not in ("0", "1"):
        raise ValueError(f"K3SERVE_FUSED_DECODE={val!r}: expected '0' or '1'")
    return val == "1" and use_triton(device) and not torch.is_grad_enabled()


def needs_grad(*xs: torch.Tensor | None) -> bool:
    """Whether autograd is on and any of ``xs`` requires a gradient (the Triton kernels are
    forward-only)."""
    return torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in xs)


__all__ = ["fused_decode", "kernel_backend", "needs_grad", "use_triton"]
