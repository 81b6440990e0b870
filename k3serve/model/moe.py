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
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from k3serve.config import ModelConfig
from k3serve.kernels import dispatch
from k3serve.model.fused_weights import StackedWeights
from k3serve.model.layers import MLP, RMSNorm, glu_act

CPU_GROUPED_MAX_TOKENS = 64
"""On CPU, ``expert_impl="auto"`` takes the grouped path up to this many tokens (decode) and the
per-expert loop above it (measured; see ``MoE.routed_experts``)."""


FUSED_ROUTE_MAX_TOKENS = 1024
"""Up to this many tokens (decode batches) the router runs as one Triton launch
(``k3serve.kernels.moe.route_triton.route_topk_triton``) where ``dispatch.fused_decode``
allows; larger calls (prefill) keep the torch router."""


def buffer_of(module: torch.nn.Module, name: str) -> torch.Tensor | None:
    """``module``'s own registered buffer ``name`` (not a child's), or ``None``."""
    return dict(module.named_buffers(recurse=False)).get(name)

class StackedExperts(NamedTuple):
    """Routed-expert weights stacked for the grouped GEMMs (views shared with the parameters).

    Fields:
        w13: ``[E, 2I, W]`` gate rows ``[0, I)``, up rows ``[I, 2I)``.
        w2: ``[E, W, I]``.
        packed: ``None`` or MXFP4 ``(w13 uint8 [E, 2I, W/2], s13 uint8 [E, 2I, W/32],
            w2 uint8 [E, W, I/2], s2 uint8 [E, W, I/32])``.
        key: data pointers the stack was built from (staleness check).
    """

    w13: torch.Tensor
    w2: torch.Tensor
    packed: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None
    key: tuple[int, ...]


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
        self.expert_impl = "auto"
        self.prefer_packed = True  # read MXFP4 bytes when attached (``use_packed``)
        self._stacked: StackedExperts | None = None
        self.experts = nn.ModuleList(
            Expert(width, cfg.moe_intermediate_size, dtype) for _ in range(cfg.n_routed_experts)
        )
        if cfg.n_shared_experts > 0:
            self.shared_experts = MLP(
                cfg, d, cfg.n_shared_experts * cfg.moe_intermediate_size, dtype
            )
        # fused decode: [latent down-projection | shared gate | shared up] as one matrix
        self._x_stack = StackedWeights(["routed_expert_down_proj.weight",
                                        "shared_experts.gate_proj.weight",
                                        "shared_experts.up_proj.weight"])  # fmt: skip
        # routed tokens per expert since the last reset (k3serve.parallel.counters reads it)
        self.register_buffer(
            "expert_load", torch.zeros(cfg.n_routed_experts, dtype=torch.int64), persistent=False
        )
        # expert parallelism: ``routed_experts``' replacement (k3serve.parallel.ep.EPExperts) or None
        self.ep: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] | None = None

    # ------------------------------------------------------------------ routed experts
    def routed_experts(
        self, x_latent: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        """Weighted routed-expert sum ``Σ_j w[t, j] E_{ids[t, j]}(z[t])`` — the one swap point
        for the expert compute (expert parallelism replaces this method).

        Path (``self.expert_impl``): ``"grouped"`` — tokens sorted by expert on the device and one
        grouped GEMM per projection (Triton with MXFP4 or bf16 experts on CUDA, the torch
        grouped path elsewhere; :func:`k3serve.kernels.dispatch.routed_experts`), static shapes,
        no host sync; ``"loop"`` — :meth:`routed_loop`, the plain-torch reference; ``"auto"``
        (default) — grouped on CUDA; on CPU grouped for decode-sized batches
        (``T ≤ CPU_GROUPED_MAX_TOKENS``) and the loop above, as measured
        (``docs/results/gpu_moe.md``, CPU section).

        Args:
            x_latent: ``[T, W]`` expert inputs (the latent ``z`` of a latent MoE, else ``x``).
            topk_ids: ``[T, k]`` int64 expert ids.
            topk_weights: ``[T, k]`` float32 routing weights.

        Returns:
            ``[T, W]`` float32.
        """
        impl = self.expert_impl
        if impl == "auto":
            on_cpu = x_latent.device.type == "cpu"
            impl = "loop" if on_cpu and x_latent.shape[0] > CPU_GROUPED_MAX_TOKENS else "grouped"
        if impl == "loop":
            return self.routed_loop(x_latent, topk_weights, topk_ids)
        if impl != "grouped":
            raise ValueError(f"expert_impl: {impl!r} is not 'auto', 'grouped' or 'loop'")
        st = self.stacked_experts()
        cfg = self.cfg
        return dispatch.routed_experts(
            x_latent, st.w13, st.w2, topk_ids, topk_weights, cfg.hidden_act,
            cfg.situ_beta, cfg.situ_beta_linear, packed=st.packed if self.use_packed else None,
        )  # fmt: skip

    def routed_loop(
        self, z: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor
    ) -> torch.Tensor:
        """Reference weighted expert sum: tokens sorted by expert, one matmul group per active
        expert, one Python iteration each (reads the per-expert counts back to the host).

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

    routed = routed_loop  # the name earlier code used

    @property
    def use_packed(self) -> bool:
        """Whether the grouped path reads the MXFP4 bytes (``cfg.expert_quant == "mxfp4"``, the
        bytes attached by the checkpoint loader, ``prefer_packed``, and a Triton device: the
        torch path computes on the dense weights, which equal the dequantised bytes)."""
        st = self._stacked
        return (
            self.prefer_packed
            and self.cfg.expert_quant == "mxfp4"
            and st is not None
            and st.packed is not None
            and dispatch.use_triton(st.w13.device)
        )

    def stacked_experts(self) -> StackedExperts:
        """The expert weights stacked for the grouped GEMMs, built once and then shared.

        The per-expert parameters (``experts.{e}.w1.weight`` …, the checkpoint names) are
        re-pointed to views of ``w13 [E, 2I, W]`` / ``w2 [E, W, I]`` (and MXFP4 bytes, when
        attached, to views of the stacked packed tensors), so memory is not doubled and an
        in-place load (``copy_``, ``load_state_dict``) updates both. The stack is rebuilt when
        the first or last expert's tensor is no longer the view (``model.to``, a fresh
        ``register_buffer`` by the loader). Call it once after loading / moving the model and
        before capturing CUDA graphs (building it allocates). After replacing a single middle
        expert's tensor by assignment, call :meth:`invalidate_stacked`.
        """
        st = self._stacked
        if st is not None and st.key == self._stack_key():
            return st
        self._stacked = st = self._build_stack()
        return st

    def invalidate_stacked(self) -> None:
        """Drop the cached stack (the next grouped call rebuilds it from the parameters)."""
        self._stacked = None

    def _stack_key(self) -> tuple[int, ...]:
        first, last = self.experts[0], self.experts[-1]
        key = (first.w1.weight.data_ptr(), last.w2.weight.data_ptr())
        p1, p2 = buffer_of(first.w1, "weight_packed"), buffer_of(last.w2, "weight_packed")
        if p1 is not None and p2 is not None:
            key += (p1.data_ptr(), p2.data_ptr())
        return key

    def _build_stack(self) -> StackedExperts:
        ex = list(self.experts)
        inter = self.cfg.moe_intermediate_size
        # normal tensors even when first called under inference_mode: the loader copies into them
        with torch.inference_mode(False), torch.no_grad():
            w13 = torch.stack([torch.cat((e.w1.weight, e.w3.weight)) for e in ex])
            w2 = torch.stack([e.w2.weight for e in ex])
            for i, e in enumerate(ex):
                e.w1.weight.data = w13[i, :inter]
                e.w3.weight.data = w13[i, inter:]
                e.w2.weight.data = w2[i]
            packed = None
            names = ("weight_packed", "weight_scale")
            if all(buffer_of(w, n) is not None
                   for e in ex for w in (e.w1, e.w2, e.w3) for n in names):  # fmt: skip
                stacks = []
                for n in names:
                    s13 = torch.stack([torch.cat((buffer_of(e.w1, n), buffer_of(e.w3, n)))
                                       for e in ex])
                    s2 = torch.stack([buffer_of(e.w2, n) for e in ex])
                    for i, e in enumerate(ex):
                        # an existing buffer's name: nn.Module.__setattr__ replaces it in
                        # place and keeps its persistence
                        setattr(e.w1, n, s13[i, :inter])
                        setattr(e.w3, n, s13[i, inter:])
                        setattr(e.w2, n, s2[i])
                    stacks.append((s13, s2))
                packed = (stacks[0][0], stacks[1][0], stacks[0][1], stacks[1][1])
        st = StackedExperts(w13, w2, packed, ())
        return st._replace(key=self._stack_key())

    def _routed(self, z: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The local routed experts, or the expert-parallel group's when ``self.ep`` is set."""
        if self.ep is not None:
            return self.ep(z, weights, idx)
        return self.routed_experts(z, idx, weights)

    def _forward_fused_tail(
        self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """Latent MoE + shared expert for a decode batch in few launches: one GEMM for the
        latent down-projection and the shared gate / up (stacked weights,
        :class:`k3serve.model.fused_weights.StackedWeights`), the routed experts, the expert
        sum's rounding fused into its RMSNorm, the shared GLU on the GEMM's column slices, and
        ``up(norm(r)) + shared`` as one ``addmm``. Same math as :meth:`forward`'s plain path."""
        from k3serve.kernels.fused_triton import rms_norm_triton

        cfg = self.cfg
        w = cfg.moe_latent_size
        inter = self.shared_experts.gate_proj.weight.shape[0]
        zx = F.linear(x, self._x_stack.get(self))  # [T, W + 2·I_shared]
        r = self._routed(zx[:, :w], idx, weights)
        rn = rms_norm_triton(
            r, self.routed_expert_norm.weight, self.routed_expert_norm.eps, out_dtype=x.dtype,
            round_input=True,
        )  # fmt: skip
        h = dispatch.glu(zx[:, w : w + inter], zx[:, w + inter :], cfg.hidden_act,
                         cfg.situ_beta, cfg.situ_beta_linear)  # fmt: skip
        shared = self.shared_experts.down_proj(h)
        return torch.addmm(shared, rn, self.routed_expert_up_proj.weight.t())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, d]`` → ``[T, d]`` in ``x.dtype``."""
        fused = x.shape[0] <= FUSED_ROUTE_MAX_TOKENS and dispatch.fused_decode(x.device)
        if fused:
            from k3serve.kernels.moe.route_triton import route_topk_triton

            cfg = self.cfg  # router + load counters in one launch (same contract as below)
            weights, idx = route_topk_triton(
                x, self.gate.weight, self.gate.e_score_correction_bias, cfg.num_experts_per_tok,
                cfg.norm_topk_prob, cfg.routed_scaling_factor, self.expert_load,
            )  # fmt: skip
        else:
            weights, idx = self.gate(x)
            flat = idx.reshape(-1)
            self.expert_load.index_add_(0, flat, torch.ones_like(flat))  # on device, no sync
        if fused and self.cfg.moe_latent_size is not None and self.cfg.n_shared_experts > 0:
            return self._forward_fused_tail(x, idx, weights)
        if self.cfg.moe_latent_size is not None:
            z = self.routed_expert_down_proj(x)
            r = self._routed(z, idx, weights).to(x.dtype)
            y = self.routed_expert_up_proj(self.routed_expert_norm(r))
        else:
            y = self._routed(x, idx, weights).to(x.dtype)
        if self.cfg.n_shared_experts > 0:
            y = y + self.shared_experts(x)
        return y


__all__ = [
    "CPU_GROUPED_MAX_TOKENS",
    "FUSED_ROUTE_MAX_TOKENS",
    "Expert",
    "MoE",
    "Router",
    "StackedExperts",
]
