"""Kernels: plain-torch references and (on GPU) Triton fast paths.

``use_triton`` is the one dispatch switch (``K3SERVE_KERNELS``, read in ``backend.py``): model
code asks it before choosing a fast path, or calls the dispatching wrappers in ``dispatch.py``.
"""

from __future__ import annotations

from k3serve.kernels.backend import use_triton

__all__ = ["use_triton"]
