"""Gated MLA without rotary embedding (DeepSeek-V2 §2.1 MLA; K3 / Kimi Linear NoPE variant).

    q        = q_b(RMSNorm(q_a(x)))  (or q_proj(x))          [T, H, nope+rope]
    [c ; kpe] = kv_a_proj_with_mqa(x);  c = kv_a_layernorm(c)   cached latent [kv_lora + rope]
    k_h      = [W_uk,h c ; kpe],  v_h = W_uv,h c               (kv_b_proj; rope part NOT rotated)
    attn     = softmax(q·k / sqrt(nope + rope)) v                causal
    out      = o_proj(attn ⊙ σ(g_proj x))    (gate only when cfg.mla_output_gate; K3)

Prefill: naive decompressed attention over [cached latents from pages ; new latents].
Decode: weight-absorbed MQA over the paged latents (``k3serve.kernels.dispatch``: the torch
reference ``k3serve.kernels.mla.naive`` on CPU, Triton on CUDA).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from k3serve.config import ModelConfig
from k3serve.kernels import dispatch
from k3serve.kernels.mla import naive as mla_ref
from k3serve.model.fused_weights import StackedWeights
from k3serve.model.layers import RMSNorm


class MLAMixer(nn.Module):
    """Gated Multi-head Latent Attention. Parameter names follow the published checkpoints.

    Args:
        cfg: model config (MLA fields, ``mla_output_gate``).
        dtype: parameter dtype.
    """

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        d, h = cfg.hidden_size, cfg.mla_num_heads
        self.num_heads = h
        self.scale = cfg.qk_head_dim**-0.5

        def lin(i: int, o: int) -> nn.Linear:
            return nn.Linear(i, o, bias=False, dtype=dtype)

        if cfg.q_lora_rank is None:
            self.q_proj = lin(d, h * cfg.qk_head_dim)
        else:
            self.q_a_proj = lin(d, cfg.q_lora_rank)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps, dtype=dtype)
            self.q_b_proj = lin(cfg.q_lora_rank, h * cfg.qk_head_dim)
        self.kv_a_proj_with_mqa = lin(d, cfg.mla_latent_dim)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps, dtype=dtype)
        self.kv_b_proj = lin(cfg.kv_lora_rank, h * (cfg.qk_nope_head_dim + cfg.v_head_dim))
        if cfg.mla_output_gate:
            self.g_proj = lin(d, h * cfg.v_head_dim)
        self.o_proj = lin(h * cfg.v_head_dim, d)
        # fused decode: [q_a_proj | kv_a_proj_with_mqa | g_proj] as one matrix
        self._x_stack = StackedWeights(
            ["q_a_proj.weight", "kv_a_proj_with_mqa.weight", "g_proj.weight"]
        )

    def queries(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, d]`` → ``q [T, H, nope+rope]``."""
        if self.cfg.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        return q.view(x.shape[0], self.num_heads, self.cfg.qk_head_dim)

    def latents(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, d]`` → cached latents ``[T, kv_lora + rope]`` = ``[kv_a_layernorm(c) ; k_pe]``."""
        ckv = self.kv_a_proj_with_mqa(x)
        c, kpe = ckv.split([self.cfg.kv_lora_rank, self.cfg.qk_rope_head_dim], -1)
        return torch.cat([self.kv_a_layernorm(c), kpe], -1)

    def absorbed_query(self, q: torch.Tensor) -> torch.Tensor:
        """``q [N, H, nope+rope]`` → ``[N, H, kv_lora+rope]`` = ``[W_ukᵀ q_nope ; q_pe]``."""
        cfg = self.cfg
        w = self.kv_b_proj.weight.view(
            self.num_heads, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank
        )
        w_uk = w[:, : cfg.qk_nope_head_dim]
        q_nope, q_pe = q.split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], -1)
        return torch.cat(
            [torch.einsum("nhd,hdc->nhc", q_nope.float(), w_uk.float()), q_pe.float()], -1
        )

    def absorbed_output(self, o_lat: torch.Tensor) -> torch.Tensor:
        """``o_lat [N, H, kv_lora]`` → ``[N, H, v]`` = ``W_uv ô``."""
        cfg = self.cfg
        w = self.kv_b_proj.weight.view(
            self.num_heads, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank
        )
        return torch.einsum("nhc,hvc->nhv", o_lat.float(), w[:, cfg.qk_nope_head_dim :].float())

    def _attend_per_query(self, q: torch.Tensor, num_cached: torch.Tensor,
                          block_table: torch.Tensor, latent_pool: torch.Tensor, query_len: int,
                          max_seq_len: int | None) -> torch.Tensor:
        """Causal attention of ``N`` sequences' ``query_len`` new tokens each (latents already
        in the pages) as ``N · query_len`` rows of the absorbed paged decode kernel: row
        ``(n, j)`` reads sequence ``n``'s pages up to ``num_cached[n] + j + 1`` tokens.

        Returns:
            ``[N · query_len, H, v]`` float32.
        """
        n = num_cached.shape[0]
        steps = torch.arange(1, query_len + 1, device=num_cached.device, dtype=num_cached.dtype)
        seq_lens = (num_cached[:, None] + steps).reshape(-1)
        table = block_table[:, None, :].expand(n, query_len, block_table.shape[1])
        o_lat = dispatch.mla_decode_absorbed_paged(
            self.absorbed_query(q), latent_pool, table.reshape(n * query_len, -1), seq_lens,
            self.cfg.kv_lora_rank, self.scale, max_seq_len=max_seq_len,
        )  # fmt: skip
        return self.absorbed_output(o_lat)

    def _forward_decode_fused(
        self,
        x: torch.Tensor,
        num_cached: torch.Tensor,
        block_table: torch.Tensor,
        slot_mapping: torch.Tensor,
        latent_pool: torch.Tensor,
        max_seq_len: int | None,
    ) -> torch.Tensor:
        """Decode (one token per sequence) in ~8 launches: one GEMM for ``q_a | kv_a | g``
        (stacked weights), ``q_a_layernorm``, ``q_b``, the latent write (norm + page store +
        ``seq_lens``), the absorbed query, the paged decode kernel, the absorbed output with
        the gate, ``o_proj`` (:mod:`k3serve.kernels.fused_triton`; same math as the plain path).
        """
        from k3serve.kernels.fused_triton import (
            mla_absorb_out_triton,
            mla_absorb_q_triton,
            mla_latent_write_triton,
        )

        cfg = self.cfg
        qa, lat_w = cfg.q_lora_rank, cfg.mla_latent_dim
        proj = F.linear(x, self._x_stack.get(self))  # [N, q_lora | kv_lora + rope | H·v]
        q = self.q_b_proj(self.q_a_layernorm(proj[:, :qa]))
        seq_lens = mla_latent_write_triton(
            proj, qa, self.kv_a_layernorm.weight, self.kv_a_layernorm.eps, slot_mapping,
            latent_pool, num_cached,
        )  # fmt: skip
        q_lat = mla_absorb_q_triton(
            q, self.kv_b_proj.weight, self.num_heads, cfg.qk_nope_head_dim, latent_pool.dtype
        )
        o_lat = dispatch.mla_decode_absorbed_paged(
            q_lat, latent_pool, block_table, seq_lens, cfg.kv_lora_rank, self.scale,
            max_seq_len=max_seq_len,
        )  # fmt: skip
        o = mla_absorb_out_triton(
            o_lat, self.kv_b_proj.weight, cfg.qk_nope_head_dim, proj[:, qa + lat_w :], x.dtype
        )
        return self.o_proj(o)

    def forward(
        self,
        x: torch.Tensor,
        cu_seqlens: torch.Tensor,
        num_cached: torch.Tensor | None = None,
        block_table: torch.Tensor | None = None,
        slot_mapping: torch.Tensor | None = None,
        latent_pool: torch.Tensor | None = None,
        is_decode: bool = False,
        max_seq_len: int | None = None,
        host_meta: tuple | None = None,
        query_len: int | None = None,
    ) -> torch.Tensor:
        """Attend the new tokens of N packed sequences; write their latents into the pages.

        Args:
            x: ``[T, d]`` normed hidden states of the new tokens.
            cu_seqlens: ``[N+1]`` int64 boundaries in ``x``.
            num_cached: ``[N]`` int64 cached tokens per sequence (None: 0, training).
            block_table: ``[N, max_blocks]`` int64 pages.
            slot_mapping: ``[T]`` int64 flat latent slot of each new token.
            latent_pool: ``[P, B, D]`` this layer's pages, updated in place; None = no cache
                (training: attention within the new tokens only).
            is_decode: one new token per sequence → weight-absorbed attention.
            max_seq_len: host-side upper bound on ``num_cached + new`` for the decode kernel's
                grid (None: the kernel reads the longest from the device, a host sync).
            host_meta: prefill only: the forward's host copy of ``(cu_seqlens, num_cached,
                block_table)`` (``k3serve.kernels.mla.prefill_sdpa.make_host_meta``), shared
                by the MLA layers so that none reads them back again; None: read per layer.
            query_len: every sequence has exactly this many new tokens (not decode): query ``j``
                of a sequence attends its first ``num_cached + j + 1`` latents through the
                paged decode kernel, one row per query, with ``max_seq_len`` as its bound —
                no host metadata, the shape a CUDA graph captures (the speculative verify
                step). None: the prefill path.

        Returns:
            ``[T, d]`` in ``x.dtype``.

        Raises:
            ValueError: ``latent_pool`` without ``block_table``/``slot_mapping``/``num_cached``.
        """
        cfg = self.cfg
        t = x.shape[0]
        if (
            is_decode
            and latent_pool is not None
            and cfg.q_lora_rank is not None
            and cfg.mla_output_gate
            and latent_pool.is_contiguous()
            and x.dtype != torch.float64
            and dispatch.fused_decode(x.device)
        ):
            if block_table is None or slot_mapping is None or num_cached is None:
                raise ValueError("block_table/slot_mapping/num_cached: required with latent_pool")
            return self._forward_decode_fused(
                x, num_cached, block_table, slot_mapping, latent_pool, max_seq_len
            )
        q = self.queries(x)
        lat = self.latents(x)
        if latent_pool is None:
            attn = []
            cu = cu_seqlens.tolist()
            for i in range(len(cu) - 1):
                attn.append(
                    mla_ref.mla_attention_naive(
                        q[cu[i] : cu[i + 1]],
                        lat[cu[i] : cu[i + 1]],
                        self.kv_b_proj.weight,
                        cfg.qk_nope_head_dim,
                        cfg.v_head_dim,
                        self.scale,
                        0,
                    )
                )
            o = torch.cat(attn, 0)
        else:
            if block_table is None or slot_mapping is None or num_cached is None:
                raise ValueError("block_table/slot_mapping/num_cached: required with latent_pool")
            latent_pool.view(-1, latent_pool.shape[-1])[slot_mapping] = lat.to(latent_pool.dtype)
            if is_decode:
                seq_lens = num_cached + (cu_seqlens[1:] - cu_seqlens[:-1])
                o_lat = dispatch.mla_decode_absorbed_paged(
                    self.absorbed_query(q),
                    latent_pool,
                    block_table,
                    seq_lens,
                    cfg.kv_lora_rank,
                    self.scale,
                    max_seq_len=max_seq_len,
                )
                o = self.absorbed_output(o_lat)
            elif query_len is not None:
                o = self._attend_per_query(q, num_cached, block_table, latent_pool, query_len,
                                           max_seq_len)
            else:
                o = dispatch.mla_prefill_paged(
                    q,
                    latent_pool,
                    block_table,
                    cu_seqlens,
                    num_cached,
                    self.kv_b_proj.weight,
                    cfg.qk_nope_head_dim,
                    cfg.v_head_dim,
                    self.scale,
                    host_meta=host_meta,
                )
        o = o.to(x.dtype).reshape(t, self.num_heads * cfg.v_head_dim)
        if cfg.mla_output_gate:
            o = o * torch.sigmoid(self.g_proj(x))
        return self.o_proj(o)


__all__ = ["MLAMixer"]
