"""The KDA mixer (Kimi Delta Attention; Kimi Linear, arXiv 2510.26692 §3; DESIGN.md §2).

Per token (x ∈ R^d, H heads of width K == V):

    q, k, v = SiLU(causal_conv4(W_q x)), …   depthwise, no bias, over PRE-conv inputs
    q, k    = l2norm(q), l2norm(k)           (the kernel scales q by K^-1/2: fla ``scale=None``)
    g       = lb·σ(exp(A_log)·(f + dt_bias))            K3 bounded gate (cfg.kda_gate_lower_bound)
            | −exp(A_log)·softplus(f + dt_bias)         Kimi Linear (lower bound None)
              with f = f_b(f_a(x)) ∈ R^{H·K}
    β       = σ(W_b x) ∈ R^H
    o       = KDA(q, k, v, g, β)                        chunk form (prefill) | recurrent step (decode)
    out     = o_proj(RMSNorm_head(o) · w · σ(gate(x)))  gate: g_proj (K3) | g_b(g_a(x)) (Kimi Linear)

Cache (INTERFACES.md §1): per slot, ``state [H, K, V]`` fp32 and ``conv [W-1, 3·H·K]`` = the last
W−1 pre-conv ``q | k | v`` inputs, oldest first, in the model dtype.

Kernels come through ``k3serve.kernels.dispatch`` (torch references on CPU, Triton on CUDA;
fla-core conventions); the gate is ``k3serve.kernels.kda.naive.kda_gate``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from k3serve.config import ModelConfig
from k3serve.kernels import dispatch
from k3serve.kernels.kda.naive import kda_gate
from k3serve.kernels.naive import l2norm
from k3serve.model.capture import KDACapture
from k3serve.model.fused_weights import StackedWeights
from k3serve.model.layers import GatedRMSNorm


class KDAMixer(nn.Module):
    """Kimi Delta Attention mixer. Parameter names follow the published K3 checkpoint.

    Args:
        cfg: model config (KDA fields, ``kda_gate_lower_bound``, ``kda_output_gate_rank``).
        dtype: parameter dtype (``A_log``, ``dt_bias`` are always float32).
    """

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        d, h, k = cfg.hidden_size, cfg.kda_num_heads, cfg.kda_head_dim
        hk, w = h * k, cfg.kda_conv_kernel
        self.num_heads, self.head_dim = h, k

        def lin(i: int, o: int) -> nn.Linear:
            return nn.Linear(i, o, bias=False, dtype=dtype)

        self.q_proj, self.k_proj, self.v_proj = lin(d, hk), lin(d, hk), lin(d, hk)
        self.q_conv1d = nn.Conv1d(hk, hk, w, groups=hk, bias=False, dtype=dtype)
        self.k_conv1d = nn.Conv1d(hk, hk, w, groups=hk, bias=False, dtype=dtype)
        self.v_conv1d = nn.Conv1d(hk, hk, w, groups=hk, bias=False, dtype=dtype)
        self.f_a_proj, self.f_b_proj = lin(d, cfg.kda_gate_rank), lin(cfg.kda_gate_rank, hk)
        self.b_proj = lin(d, h)
        if cfg.kda_output_gate_rank is None:
            self.g_proj = lin(d, hk)
        else:
            self.g_a_proj = lin(d, cfg.kda_output_gate_rank)
            self.g_b_proj = lin(cfg.kda_output_gate_rank, hk)
        self.o_proj = lin(hk, d)
        self.A_log = nn.Parameter(torch.empty(h, dtype=torch.float32))
        self.dt_bias = nn.Parameter(torch.empty(hk, dtype=torch.float32))
        self.o_norm = GatedRMSNorm(k, cfg.rms_norm_eps, dtype=dtype)
        self._in_stack = StackedWeights([f"{n}.weight" for n in ("q_proj", "k_proj", "v_proj",
                                         "g_proj", "f_a_proj", "b_proj")])  # fmt: skip
        self._conv_stack = StackedWeights(["q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight"])
        self.reset_gate_parameters()

    @torch.no_grad()
    def reset_gate_parameters(self) -> None:
        """fla-style decay init: ``A = U(1, 16)``, ``dt = exp(U(log 1e-3, log 1e-1))``,
        ``dt_bias = softplus⁻¹(dt)`` (mamba / fla ``KimiDeltaAttention`` init). No-op on meta."""
        if self.A_log.is_meta:
            return
        self.A_log.copy_(torch.empty_like(self.A_log).uniform_(1.0, 16.0).log())
        dt = (
            torch.empty_like(self.dt_bias)
            .uniform_(math.log(1e-3), math.log(1e-1))
            .exp()
            .clamp_min(1e-4)
        )
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))

    def conv_weight(self) -> torch.Tensor:
        """``[3·H·K, W]`` taps of the q | k | v convs, in the conv-state channel order."""
        if self._conv_stack.valid(self):  # the three conv weights view it: no per-step cat
            return self._conv_stack.get(self).squeeze(1)
        return torch.cat(
            [self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight], 0
        ).squeeze(1)

    def decode_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The input projections of the fused decode step stacked into one matrix.

        Returns ``(w_in [3HK + HK + R + H, d], conv_w [3HK, W])``: rows ``q | k | v | g | f_a |
        b`` (``g_proj``, ``f_a_proj`` of rank R, ``b_proj``) and the q | k | v conv taps, both
        :class:`k3serve.model.fused_weights.StackedWeights` (the parameters view them; no
        second copy). Needs the full-rank output gate (``cfg.kda_output_gate_rank is None``).
        """
        return self._in_stack.get(self), self._conv_stack.get(self).squeeze(1)

    def _forward_decode_fused(
        self, x: torch.Tensor, state_slots: torch.Tensor, state_pool: torch.Tensor,
        conv_pool: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        """Decode step in four launches: one GEMM for every input projection, ``f_b_proj``,
        :func:`k3serve.kernels.kda.recurrent_triton.kda_decode_fused_triton` (conv, l2norm,
        gate, β, recurrence, gated norm), ``o_proj``."""
        from k3serve.kernels.kda.recurrent_triton import kda_decode_fused_triton

        cfg = self.cfg
        hk = self.num_heads * self.head_dim
        w_in, conv_w = self.decode_weights()
        proj = F.linear(x, w_in)
        g_off, fa_off = 3 * hk, 4 * hk
        b_off = fa_off + cfg.kda_gate_rank
        fb = self.f_b_proj(proj[:, fa_off:b_off])
        o = kda_decode_fused_triton(
            proj, fb, conv_pool, conv_w, state_pool, state_slots, self.A_log, self.dt_bias,
            cfg.kda_gate_lower_bound, self.o_norm.weight, self.o_norm.eps, self.num_heads,
            g_off, b_off,
        )  # fmt: skip
        return self.o_proj(o)

    def _forward_prefill_stacked(
        self, x: torch.Tensor, cu_seqlens: torch.Tensor, state_slots: torch.Tensor,
        state_pool: torch.Tensor, conv_pool: torch.Tensor, cu_host: Sequence[int] | None,
        capture: tuple[KDACapture, int] | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """Prefill with the decode step's stacked input projection: one GEMM for
        ``q | k | v | g | f_a | b``, the varlen conv on its column slice, one launch for the
        q / k L2 norms (``dispatch.l2norm_heads``), ``f_b_proj``, and the gate fused into the
        chunk kernel (``dispatch.chunk_kda(gate=…)``); same function as the unstacked branch of
        :meth:`forward` (its reference), ~12 fewer launches per layer."""
        cfg = self.cfg
        h, k = self.num_heads, self.head_dim
        hk, t = h * k, x.shape[0]
        w_in, conv_w = self.decode_weights()
        proj = F.linear(x, w_in)
        g_off, fa_off = 3 * hk, 4 * hk
        b_off = fa_off + cfg.kda_gate_rank
        hist = conv_pool[state_slots]
        qkv, new_hist = dispatch.conv_varlen(proj[:, :g_off], conv_w, cu_seqlens, hist)
        if capture is None:
            conv_pool[state_slots] = new_hist.to(conv_pool.dtype)
        qk = dispatch.l2norm_heads(qkv[:, : 2 * hk].view(t, 2, h, k), dtype=x.dtype)
        v = qkv[:, 2 * hk :].view(t, h, k)
        f = self.f_b_proj(proj[:, fa_off:b_off]).view(t, h, k)
        beta = torch.sigmoid(proj[:, b_off : b_off + h].float())
        gate = (self.A_log, self.dt_bias, cfg.kda_gate_lower_bound)
        o, final = dispatch.chunk_kda(
            qk[0][None], qk[1][None], v[None], f[None], beta[None],
            initial_state=state_pool[state_slots], output_final_state=capture is None,
            cu_seqlens=cu_seqlens, cu_seqlens_host=cu_host, gate=gate,
        )  # fmt: skip
        if capture is None:
            state_pool[state_slots] = final.float()
        else:
            capture[0].put(capture[1], proj[:, :g_off], qk[1], v, kda_gate(f, *gate), beta)
        o = self.o_norm(o[0].to(x.dtype).view(t, h, k), proj[:, g_off:fa_off].view(t, h, k))
        return self.o_proj(o.reshape(t, hk))

    def forward(
        self,
        x: torch.Tensor,
        cu_seqlens: torch.Tensor,
        state_slots: torch.Tensor | None = None,
        state_pool: torch.Tensor | None = None,
        conv_pool: torch.Tensor | None = None,
        is_decode: bool = False,
        cu_host: Sequence[int] | None = None,
        capture: tuple[KDACapture, int] | None = None,
    ) -> torch.Tensor:
        """Mix the new tokens of N packed sequences; read and write their cached state.

        Args:
            x: ``[T, d]`` normed hidden states of the new tokens.
            cu_seqlens: ``[N+1]`` int64 boundaries of each sequence in ``x``.
            state_slots: ``[N]`` int64 slots; None with no pools (training: zero states).
            state_pool: ``[S, H, K, V]`` float32 this layer's KDA states; updated in place.
            conv_pool: ``[S, W-1, 3·H·K]`` this layer's conv states; updated in place.
            is_decode: every sequence has one new token → recurrent step kernel.
            cu_host: ``cu_seqlens`` as host ints (``ForwardBatch.host``), or None; the chunked
                prefill kernel then builds its chunk tables without reading the device.
            capture: ``(KDACapture, j)`` for a verify forward (not decode): read the slots'
                states, write neither, keep the state-update inputs as layer ``j``'s
                (:mod:`k3serve.model.capture`).

        Returns:
            ``[T, d]`` in ``x.dtype``.

        Raises:
            ValueError: pools given without ``state_slots`` (or only one pool).
        """
        cfg = self.cfg
        h, k = self.num_heads, self.head_dim
        t = x.shape[0]
        if (state_pool is None) != (conv_pool is None) or (
            state_pool is not None and state_slots is None
        ):
            raise ValueError("state_slots/state_pool/conv_pool: give all three or none")
        decode = is_decode and state_pool is not None
        if capture is not None and (decode or state_pool is None):
            raise ValueError("capture: needs the pools and a non-decode forward")
        if (
            decode
            and cfg.kda_output_gate_rank is None
            and state_pool.dtype == torch.float32
            and x.dtype != torch.float64
            and dispatch.fused_decode(x.device)
        ):
            return self._forward_decode_fused(x, state_slots, state_pool, conv_pool)
        if (
            not is_decode
            and state_pool is not None
            and cfg.kda_output_gate_rank is None
            and x.dtype != torch.float64
            and dispatch.use_triton(x.device)
            and not torch.is_grad_enabled()
        ):
            return self._forward_prefill_stacked(
                x, cu_seqlens, state_slots, state_pool, conv_pool, cu_host, capture
            )
        qkv = pre = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], -1)
        if decode:  # shifts conv_pool[state_slots] in place
            qkv = dispatch.causal_conv_step(qkv, conv_pool, self.conv_weight(), state_slots)
        else:
            hist = conv_pool[state_slots] if conv_pool is not None else None
            qkv, new_hist = dispatch.conv_varlen(qkv, self.conv_weight(), cu_seqlens, hist)
            if conv_pool is not None and capture is None:
                conv_pool[state_slots] = new_hist.to(conv_pool.dtype)
        q, kk, v = qkv.view(t, 3, h, k).unbind(1)
        q, kk = l2norm(q).to(x.dtype), l2norm(kk).to(x.dtype)
        g = kda_gate(
            self.f_b_proj(self.f_a_proj(x)).view(t, h, k),
            self.A_log,
            self.dt_bias,
            cfg.kda_gate_lower_bound,
        )
        beta = torch.sigmoid(self.b_proj(x).float())
        if decode:
            o = dispatch.fused_recurrent_kda_step(q, kk, v, g, beta, state_pool, state_slots)
        else:
            init = state_pool[state_slots] if state_pool is not None else None
            o, final = dispatch.chunk_kda(
                q[None],
                kk[None],
                v[None],
                g[None],
                beta[None],
                initial_state=init,
                output_final_state=state_pool is not None and capture is None,
                cu_seqlens=cu_seqlens,
                cu_seqlens_host=cu_host,
            )
            o = o[0]
            if capture is not None:
                capture[0].put(capture[1], pre, kk, v, g, beta)
            elif state_pool is not None:
                state_pool[state_slots] = final.float()
        if cfg.kda_output_gate_rank is None:
            gate = self.g_proj(x)
        else:
            gate = self.g_b_proj(self.g_a_proj(x))
        o = self.o_norm(o.to(x.dtype).view(t, h, k), gate.view(t, h, k))
        return self.o_proj(o.reshape(t, h * k))


__all__ = ["KDAMixer"]
