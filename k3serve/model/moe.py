"""Mixture of experts: K3's latent MoE, and plain DeepSeek-V3 style MoE (Kimi Linear).

Routing (DeepSeek-V3 §2.1.2, aux-loss-free bias; DESIGN.md §2), per token x ∈ R^d:

    s      = σ(W_gate x) ∈ R^E                         float32
    top-k  = argtopk(s + e_score_correction_bias)     (bias frozen at serving time)
    w_e    = s_e / Σ_{top-k} s  (if norm_topk_prob) × routed_scaling_factor

Latent MoE (cfg.moe_latent_size set): z = down(x) ∈ R^lat, r = Σ_e w_e E_e(z),
routed = up(RMSNorm(r)). Plain MoE: routed = Σ_e w_e E_e(x). Expert E_e(z) = w2(act(w1 z, w3 z))
with act SiTU-GLU or SwiGLU. Output = routed + shared(x) (shared experts at full width).

Expert weights are per-expert parameters ``experts.{e}.w1.weight`` (gate), ``w3`` (up), ``w2``
(down), the K3 checkpoint names. (transformers' KimiLinear fuses them into 3-D
``experts.gate_up_proj [E, 2I, d]`` (gate rows first) and ``experts.down_proj [E, d, I]``;
``k3serve.model.hf_import`` splits them.)
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from k3serve.config import ModelConfig
from k3serve.model.layers import MLP, RMSNorm, glu_act


class _Weight(nn.Module):
    """A bare ``weight [out, in]`` holder (cheap to build: K3 has 896 × 3 × 92 of them)."""

    def __init__(self, out_f: int, in_f: int, dtype: torch.dtype | None) -> None:
        super().__init__()
        # direct registration: ``self.weight = …`` pays an AttributeError probe per parameter,
        # which dominates building K3's 247k expert weights on the meta device
        self._parameters["weight"] = nn.Parameter(torch.empty(out_f, in_f, dtype=dtype))


class Expert(nn.Module):
    """One routed expert: ``w1`` (gate) and ``w3`` (up) ``[I, W]``, ``w2`` (down) ``[W, I]``."""

    def __init__(self, width: int, inter: int, dtype: torch.dtype | None) -> None:
        super().__init__()
        self.w1 = _Weight(inter, width, dtype)
        self.w2 = _Weight(width, inter, dtype)
        self.w3 = _Weight(inter, width, dtype)

    def run(self, cfg: ModelConfig, z: torch.Tensor) -> torch.Tensor:
        """``z [n, W]`` → ``[n, W]``."""
        return F.linear(
            glu_act(cfg, F.linear(z, self.w1.weight), F.linear(z, self.w3.weight)), self.w2.weight
        )


class Router(nn.Module):
    """Sigmoid top-k router with a frozen correction bias. Names: ``gate.weight [E, d]``,
    ``gate.e_score_correction_bias [E]`` (float32, not trained by gradient)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype | None) -> None:
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size, dtype=dtype))
        self.e_score_correction_bias = nn.Parameter(
            torch.zeros(cfg.n_routed_experts, dtype=torch.float32), requires_grad=False
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Route tokens.

        Args:
            x: ``[T, d]``.

        Returns:
            ``(weights [T, k] float32, experts [T, k] int64)``.
        """
        cfg = self.cfg
        scores = torch.sigmoid(F.linear(x.float(), self.weight.float()))
        idx = torch.topk(
            scores + self.e_score_correction_bias.float(), cfg.num_experts_per_tok, dim=-1
        )[1]
        w = scores.gather(1, idx)
        if cfg.norm_topk_prob:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return w * cfg.routed_scaling_factor, idx


class MoE(nn.Module):
    """Latent (K3) or plain (Kimi Linear) MoE feed-forward with shared experts.

    Args:
        cfg: model config (MoE fields; ``moe_latent_size`` None = plain MoE).
        dtype: parameter dtype.
    """

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        d = cfg.hidden_size
        width = cfg.moe_latent_size or d
        self.gate = Router(cfg, dtype)
        if cfg.moe_latent_size is not None:
            self.routed_expert_down_proj = nn.Linear(d, width, bias=False, dtype=dtype)
            self.routed_expert_norm = RMSNorm(width, cfg.rms_norm_eps, dtype=dtype)
            self.routed_expert_up_proj = nn.Linear(width, d, bias=False, dtype=dtype)
        self.experts = nn.ModuleList(
            Expert(width, cfg.moe_intermediate_size, dtype) for _ in range(cfg.n_routed_experts)
        )
        if cfg.n_shared_experts > 0:
            self.shared_experts = MLP(
                cfg, d, cfg.n_shared_experts * cfg.moe_intermediate_size, dtype
            )
        # routed tokens per expert since the last reset (k3serve.parallel.counters reads it)
        self.register_buffer(
            "expert_load", torch.zeros(cfg.n_routed_experts, dtype=torch.int64), persistent=False
        )
        # expert parallelism: ``routed``'s replacement (k3serve.parallel.ep.EPExperts) or None
        self.ep: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None

    def routed(self, z: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """Weighted expert sum: tokens sorted by expert, one matmul group per active expert.

        Args:
            z: ``[T, W]`` expert inputs.
            weights: ``[T, k]`` float32 routing weights.
            idx: ``[T, k]`` int64 expert ids.

        Returns:
            ``[T, W]`` float32 ``Σ_e w_e E_e(z)``.
        """
        t, k = idx.shape
        flat = idx.reshape(-1)
        order = torch.argsort(flat, stable=True)
        tok = order // k
        counts = torch.bincount(flat, minlength=self.cfg.n_routed_experts).tolist()
        w_sorted = weights.reshape(-1)[order]
        out = torch.zeros(t, z.shape[1], dtype=torch.float32, device=z.device)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            rows = tok[start : start + n]
            y = self.experts[e].run(self.cfg, z[rows]).float() * w_sorted[start : start + n, None]
            out = out.index_add(0, rows, y)
            start += n
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, d]`` → ``[T, d]`` in ``x.dtype``."""
        weights, idx = self.gate(x)
        flat = idx.reshape(-1)
        self.expert_load.index_add_(0, flat, torch.ones_like(flat))  # on device, no host sync
        routed = self.routed if self.ep is None else self.ep
        if self.cfg.moe_latent_size is not None:
            z = self.routed_expert_down_proj(x)
            r = routed(z, weights, idx).to(x.dtype)
            y = self.routed_expert_up_proj(self.routed_expert_norm(r))
        else:
            y = routed(x, weights, idx).to(x.dtype)
        if self.cfg.n_shared_experts > 0:
            y = y + self.shared_experts(x)
        return y


__all__ = ["Expert", "MoE", "Router"]
