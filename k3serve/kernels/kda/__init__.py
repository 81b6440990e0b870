"""Kimi Delta Attention kernels (fla-core conventions; DESIGN.md §2, INTERFACES.md §3).

``naive.py`` is the spec (token recurrence, any float dtype), ``chunk.py`` the chunkwise
prefill/training path, ``recurrent.py`` the decode step over a state pool. Triton versions
live beside them (``*_triton.py``) and are picked by ``k3serve.kernels.dispatch``.
"""

from k3serve.kernels.kda.chunk import chunk_kda
from k3serve.kernels.kda.naive import kda_gate, naive_recurrent_kda
from k3serve.kernels.kda.recurrent import fused_recurrent_kda, fused_recurrent_kda_step

__all__ = [
    "chunk_kda",
    "fused_recurrent_kda",
    "fused_recurrent_kda_step",
    "kda_gate",
    "naive_recurrent_kda",
]
