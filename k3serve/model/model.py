"""K3ForCausalLM: the whole K3-architecture model (Kimi Linear as a special case), in torch.

Layer i: mixer = Gated MLA if ``i in cfg.mla_layers`` else KDA; FFN = dense MLP if
``i < cfg.first_k_dense`` else MoE; residual stream = Block AttnRes (``attn_res_block_layers``)
or plain (DESIGN.md §2). State-dict keys mirror the published checkpoint names without the
``language_model.`` prefix (``model.layers.{i}.self_attn.q_proj.weight``, ``lm_head.weight``…).

One code path serves prefill (varlen; from the initial states in the slots and the cached latents
in the pages; writes final states and new latents) and decode (``batch.is_decode``).
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from k3serve.config import ModelConfig
from k3serve.kernels import dispatch
from k3serve.kernels.naive import attn_res_mix as _attn_res_mix
from k3serve.model.attn_res import make_res_params
from k3serve.model.batch import ForwardBatch
from k3serve.model.kda import KDAMixer
from k3serve.model.layers import MLP, RMSNorm
from k3serve.model.mla import MLAMixer
from k3serve.model.moe import Expert, MoE, Router

if TYPE_CHECKING:
    from k3serve.cache.pools import KVPools

INIT_STD = 0.02


class DecoderLayer(nn.Module):
    """One decoder layer: mixer (KDA or MLA), FFN (dense or MoE), norms, AttnRes weights.

    Args:
        cfg: model config.
        idx: 0-based global layer index.
        dtype: parameter dtype.
    """

    def __init__(self, cfg: ModelConfig, idx: int, dtype: torch.dtype | None) -> None:
        super().__init__()
        d = cfg.hidden_size
        self.idx = idx
        self.is_mla = cfg.is_mla(idx)
        self.self_attn = MLAMixer(cfg, dtype) if self.is_mla else KDAMixer(cfg, dtype)
        self.mlp = (
            MoE(cfg, dtype) if cfg.is_moe(idx) else MLP(cfg, d, cfg.dense_intermediate_size, dtype)
        )
        self.input_layernorm = RMSNorm(d, cfg.rms_norm_eps, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(d, cfg.rms_norm_eps, dtype=dtype)
        if cfg.attn_res_block_layers:
            self.self_attention_res_norm, self.self_attention_res_proj = make_res_params(
                d, cfg.rms_norm_eps, dtype
            )
            self.mlp_res_norm, self.mlp_res_proj = make_res_params(d, cfg.rms_norm_eps, dtype)


class K3Model(nn.Module):
    """Embedding, decoder layers, final norm (and the output AttnRes weights)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype | None) -> None:
        super().__init__()
        # filled by K3ForCausalLM.reset_parameters (skips nn.Embedding's own init, slow on meta)
        emb = torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=emb)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, dtype) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        if cfg.attn_res_block_layers:
            self.output_attn_res_norm, self.output_attn_res_proj = make_res_params(
                cfg.hidden_size, cfg.rms_norm_eps, dtype
            )


class K3ForCausalLM(nn.Module):
    """K3-architecture causal LM.

    Args:
        cfg: model config (``k3serve.config.ModelConfig``).
        dtype: parameter / activation dtype (CPU: float32). KDA ``A_log``/``dt_bias`` and the
            router correction bias stay float32.

    Build on the meta device (``with torch.device("meta"): K3ForCausalLM(cfg)``) to inspect
    shapes without allocating.
    """

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.cfg = cfg
        self.dtype = dtype
        # K3 builds ~330 k modules: a paused cyclic GC keeps that linear (3x faster on meta)
        gc_was_on = gc.isenabled()
        gc.disable()
        try:
            self.model = K3Model(cfg, dtype)
        finally:
            if gc_was_on:
                gc.enable()
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype)
        self.reset_parameters()
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self._kda_idx = {l: j for j, l in enumerate(cfg.kda_layers)}
        self._mla_idx = {l: m for m, l in enumerate(cfg.mla_layers)}

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Numerically tame random init: linear / embedding / expert / router weights N(0, 0.02²),
        norms 1, AttnRes pseudo-queries 0, KDA decay fla-style (set in ``KDAMixer``).
        A no-op on the meta device (nothing to fill; meta init is slow at K3 scale)."""
        if self.lm_head.weight.is_meta:
            return
        for name, mod in self.named_modules():
            if name.endswith("_res_proj"):  # AttnRes pseudo-query: uniform mix at init
                nn.init.zeros_(mod.weight)
            elif isinstance(mod, (nn.Linear, nn.Embedding, Router)):
                nn.init.normal_(mod.weight, 0.0, INIT_STD)
            elif isinstance(mod, Expert):
                for w in (mod.w1, mod.w2, mod.w3):
                    nn.init.normal_(w.weight, 0.0, INIT_STD)

    def num_params(self) -> int:
        """Number of distinct parameters (tied weights counted once)."""
        return sum(p.numel() for p in self.parameters())

    # ------------------------------------------------------------------ core
    def _layers(
        self,
        x: torch.Tensor,
        mixer: Callable[[DecoderLayer, torch.Tensor], torch.Tensor],
        layer_hook: Callable[[int], None] | None,
        prefill: bool = False,
    ) -> torch.Tensor:
        """Run every decoder layer over ``x [T, d]`` (embeddings) → final-normed hidden ``[T, d]``.

        ``prefill``: the AttnRes mixes go through the fused prefill kernel
        (:func:`k3serve.kernels.dispatch.attn_res_mix_prefill`, the same function); the decode
        step (``False``) keeps :func:`attn_res_mix`."""
        cfg, eps = self.cfg, self.cfg.rms_norm_eps
        block = cfg.attn_res_block_layers
        attn_res_mix = dispatch.attn_res_mix_prefill if prefill else _attn_res_mix
        blocks: list[torch.Tensor] = []
        p = x
        for layer in self.model.layers:
            if block:
                h = attn_res_mix(
                    blocks + [p],
                    layer.self_attention_res_norm.weight,
                    layer.self_attention_res_proj.weight,
                    eps,
                )
                if layer.idx % block == 0:
                    blocks.append(p)
                    p = torch.zeros_like(p)
            else:
                h = p
            p = p + mixer(layer, layer.input_layernorm(h))
            if layer_hook is not None:
                layer_hook(layer.idx)
            if block:
                h = attn_res_mix(
                    blocks + [p], layer.mlp_res_norm.weight, layer.mlp_res_proj.weight, eps
                )
            else:
                h = p
            p = p + layer.mlp(layer.post_attention_layernorm(h))
        if block:
            p = attn_res_mix(
                blocks + [p],
                self.model.output_attn_res_norm.weight,
                self.model.output_attn_res_proj.weight,
                eps,
            )
        return self.model.norm(p)

    def _fusable(self, x: torch.Tensor) -> bool:
        """Whether a decode step takes :meth:`_layers_fused` (Triton device, no gradient,
        ``K3SERVE_FUSED_DECODE`` not 0, at most ``MAX_RES_SOURCES`` AttnRes sources)."""
        cfg = self.cfg
        if x.dtype == torch.float64 or not dispatch.fused_decode(x.device):
            return False
        from k3serve.kernels.fused_triton import MAX_RES_SOURCES

        block = cfg.attn_res_block_layers
        n_blocks = -(-cfg.num_layers // block) if block else 0
        return n_blocks + 1 <= MAX_RES_SOURCES

    def _layers_fused(
        self,
        x: torch.Tensor,
        mixer: Callable[[DecoderLayer, torch.Tensor], torch.Tensor],
        layer_hook: Callable[[int], None] | None,
    ) -> torch.Tensor:
        """:meth:`_layers` for a decode step with every residual-stream boundary in one launch
        (:func:`k3serve.kernels.fused_triton.res_mix_norm_triton`: ``P += sublayer output``,
        the AttnRes mix, the next RMSNorm) instead of ~20; same math, same roundings (the
        reference is :meth:`_layers`, which CPU / prefill / ``K3SERVE_FUSED_DECODE=0`` run)."""
        from k3serve.kernels.fused_triton import res_mix_norm_triton

        cfg, eps = self.cfg, self.cfg.rms_norm_eps
        block = cfg.attn_res_block_layers
        blocks: list[torch.Tensor] = []
        p: torch.Tensor | None = x
        pend: tuple[torch.Tensor, ...] = ()

        def boundary(deltas, norm, res_norm, res_proj):  # P += deltas; → normed h
            nonlocal p
            if p is None:  # P was reset to 0 at a block start: P' = the one delta, exactly
                p, deltas = deltas[0], deltas[1:]
            rw = res_norm.weight if block else None
            rq = res_proj.weight if block else None
            p, hn = res_mix_norm_triton(p, deltas, blocks, rw, rq, eps, norm.weight, norm.eps)
            return hn

        for layer in self.model.layers:
            hn = boundary(
                pend,
                layer.input_layernorm,
                getattr(layer, "self_attention_res_norm", None),
                getattr(layer, "self_attention_res_proj", None),
            )
            if block and layer.idx % block == 0:
                blocks.append(p)
                p = None
            delta = mixer(layer, hn)
            if layer_hook is not None:
                layer_hook(layer.idx)
            hn = boundary(
                (delta,),
                layer.post_attention_layernorm,
                getattr(layer, "mlp_res_norm", None),
                getattr(layer, "mlp_res_proj", None),
            )
            pend = (layer.mlp(hn),)
        return boundary(
            pend,
            self.model.norm,
            getattr(self.model, "output_attn_res_norm", None),
            getattr(self.model, "output_attn_res_proj", None),
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        batch: ForwardBatch,
        pools: KVPools,
        layer_hook: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """Prefill or decode N packed sequences against the cache pools (INTERFACES.md §2).

        Args:
            input_ids: ``[T]`` int64 new tokens, packed by ``batch.cu_seqlens``.
            batch: sequence metadata (slots, pages, ``is_decode``, ``logits_indices``).
            pools: ``k3serve.cache.pools.KVPools`` (``kda_state``, ``conv_state``,
                ``mla_latent``); the slots' states are read and overwritten with the final
                states, the new tokens' latents written at ``batch.slot_mapping``.
            layer_hook: called as ``layer_hook(layer_idx)`` after each layer wrote its cache.

        Returns:
            ``[R, V]`` float32 logits of the rows ``batch.rows_for_logits()`` (default: the last
            new token of each sequence, R = N).

        Raises:
            ValueError: ``input_ids`` not 1-D or its length ≠ ``batch.num_tokens``.
        """
        if input_ids.ndim != 1 or input_ids.shape[0] != batch.num_tokens:
            raise ValueError(
                f"input_ids: shape {tuple(input_ids.shape)}, expected [{batch.num_tokens}]"
            )

        host: list = []  # prefill: the batch metadata on the host once, shared by the MLA layers

        def mixer(layer: DecoderLayer, h: torch.Tensor) -> torch.Tensor:
            if layer.is_mla:
                m = self._mla_idx[layer.idx]
                if not batch.is_decode and batch.query_len is None and not host:
                    if batch.host is not None:  # the scheduler's ints: no device read at all
                        bh = batch.host
                        host.append((list(bh.cu_seqlens), list(bh.num_cached),
                                     [list(r) for r in bh.block_table]))  # fmt: skip
                    else:
                        from k3serve.kernels.mla.prefill_sdpa import make_host_meta

                        host.append(make_host_meta(batch.cu_seqlens, batch.num_cached,
                                                   batch.block_table))  # fmt: skip
                return layer.self_attn(
                    h,
                    batch.cu_seqlens,
                    batch.num_cached,
                    batch.block_table,
                    batch.slot_mapping,
                    pools.mla_latent[m],
                    batch.is_decode,
                    batch.max_seq_len,
                    host_meta=host[0] if host else None,
                    query_len=batch.query_len,
                )
            j = self._kda_idx[layer.idx]
            return layer.self_attn(
                h,
                batch.cu_seqlens,
                batch.state_slots,
                pools.kda_state[j],
                pools.conv_state[j],
                batch.is_decode,
                cu_host=batch.host.cu_seqlens if batch.host is not None else None,
                capture=(batch.capture, j) if batch.capture is not None else None,
            )

        x = self.model.embed_tokens(input_ids)
        if batch.is_decode and self._fusable(x):
            h = self._layers_fused(x, mixer, layer_hook)
        else:
            h = self._layers(x, mixer, layer_hook, prefill=not batch.is_decode)
        if batch.is_decode and batch.logits_indices is None:
            return self.lm_head(h).float()  # one token per sequence: every row gets logits
        return self.lm_head(h[batch.rows_for_logits()]).float()

    def forward_train(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Training / scoring forward without caches (states start at zero), differentiable.

        Args:
            input_ids: ``[B, T]`` int64.

        Returns:
            ``[B, T, V]`` logits in float32.

        Raises:
            ValueError: ``input_ids`` not 2-D.
        """
        if input_ids.ndim != 2:
            raise ValueError(f"input_ids: shape {tuple(input_ids.shape)}, expected [B, T]")
        b, t = input_ids.shape
        cu = torch.arange(b + 1, device=input_ids.device, dtype=torch.int64) * t

        def mixer(layer: DecoderLayer, h: torch.Tensor) -> torch.Tensor:
            return layer.self_attn(h, cu)

        h = self._layers(self.model.embed_tokens(input_ids.reshape(-1)), mixer, None)
        return self.lm_head(h).float().view(b, t, -1)


__all__ = ["DecoderLayer", "K3ForCausalLM", "K3Model"]
