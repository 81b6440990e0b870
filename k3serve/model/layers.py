"""Small building blocks: RMSNorm, gated RMSNorm, the GLU choice, dense MLP.

The math (RMSNorm, Zhang & Sennrich 2019; SwiGLU, Shazeer 2020; SiTU-GLU, K3's bounded SwiGLU
``[β·tanh(g/β)·σ(g)] · [β_l·tanh(u/β_l)]``) lives in :mod:`k3serve.kernels.naive` beside the
fused kernels; the gated output norm of KDA follows Kimi Linear (arXiv 2510.26692 §3, fla
``FusedRMSNormGated`` with sigmoid). Norms compute in float32 and return the input dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from k3serve.config import ModelConfig
from k3serve.kernels import dispatch
from k3serve.kernels.naive import situ_glu, swiglu

FUSED_MLP_MAX_TOKENS = 1024
"""Up to this many tokens (decode batches) a dense MLP on a fused-decode device
(``dispatch.fused_decode``) runs gate and up as one GEMM over stacked weights."""


class RMSNorm(nn.Module):
    """RMSNorm with a learned ``weight [D]`` (initialised to ones).

    Args:
        dim: normalised width D.
        eps: numerical epsilon (``cfg.rms_norm_eps``).
        dtype: parameter dtype.
    """

    def __init__(self, dim: int, eps: float = 1e-5, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., D]`` → ``[..., D]`` in ``x.dtype`` (one fused launch on a Triton device)."""
        return dispatch.rms_norm(x, self.weight, self.eps)


class GatedRMSNorm(nn.Module):
    """Per-head RMSNorm × weight × σ(gate): the KDA output norm (fla ``FusedRMSNormGated``).

    Args:
        head_dim: normalised width V (one head).
        eps: numerical epsilon.
        dtype: parameter dtype.
    """

    def __init__(self, head_dim: int, eps: float = 1e-5, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(head_dim, dtype=dtype))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """Normalise each head and gate it.

        Args:
            x: ``[T, H, V]`` attention output.
            gate: ``[T, H, V]`` pre-sigmoid gate (same shape as ``x``).

        Returns:
            ``[T, H, V]`` in ``x.dtype``; computed in float32.
        """
        if gate.shape != x.shape:
            raise ValueError(f"gate: shape {tuple(gate.shape)} != x shape {tuple(x.shape)}")
        return dispatch.rms_norm(x, self.weight, self.eps, gate)


def glu_act(cfg: ModelConfig, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The GLU chosen by ``cfg.hidden_act``: ``"situ"`` (K3) or ``"silu"`` (SwiGLU, Kimi Linear).

    Raises:
        ValueError: unknown ``cfg.hidden_act``.
    """
    if cfg.hidden_act == "situ":
        return situ_glu(gate, up, cfg.situ_beta, cfg.situ_beta_linear)
    if cfg.hidden_act == "silu":
        return swiglu(gate, up)
    raise ValueError(f"hidden_act: {cfg.hidden_act!r} is not 'situ' or 'silu'")


class MLP(nn.Module):
    """Dense gated MLP ``down(act(gate(x), up(x)))`` (layer 0, and the MoE shared experts).

    Parameter names: ``gate_proj``, ``up_proj`` ``[I, D]``, ``down_proj`` ``[D, I]``.

    Args:
        cfg: model config (``hidden_act``, SiTU betas).
        hidden: input / output width D.
        intermediate: inner width I.
        dtype: parameter dtype.
    """

    def __init__(
        self, cfg: ModelConfig, hidden: int, intermediate: int, dtype: torch.dtype | None = None
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False, dtype=dtype)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False, dtype=dtype)
        self._gu_stack = None  # fused decode: [gate_proj; up_proj] (fused_weights.StackedWeights)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., D]`` → ``[..., D]`` (the GLU is one fused launch on a Triton device)."""
        cfg = self.cfg
        if x.dim() == 2 and x.shape[0] <= FUSED_MLP_MAX_TOKENS and dispatch.fused_decode(x.device):
            # decode batch: gate and up as one GEMM over the stacked weights, GLU on its slices
            from k3serve.model.fused_weights import StackedWeights

            if self._gu_stack is None:
                self._gu_stack = StackedWeights(["gate_proj.weight", "up_proj.weight"])
            gu = F.linear(x, self._gu_stack.get(self))
            i = self.gate_proj.weight.shape[0]
            gate, up = gu[:, :i], gu[:, i:]
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        h = dispatch.glu(gate, up, cfg.hidden_act, cfg.situ_beta, cfg.situ_beta_linear)
        return self.down_proj(h)


__all__ = ["FUSED_MLP_MAX_TOKENS", "MLP", "GatedRMSNorm", "RMSNorm", "glu_act"]
