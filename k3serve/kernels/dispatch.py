"""The dispatching wrappers: each op runs its Triton kernel where :func:`use_triton` allows
(:mod:`k3serve.kernels.backend` reads ``K3SERVE_KERNELS`` and ``K3SERVE_FUSED_DECODE``) and
its plain-torch reference everywhere else.

``K3SERVE_MLA_PREFILL`` (read here only): ``sdpa`` sends MLA prefill on the kernel path to
torch SDPA (:mod:`k3serve.kernels.mla.prefill_sdpa`); ``naive`` keeps the float32 reference
loop. Unset: ``sdpa`` for CUDA tensors (every MLA sublayer within bf16 tolerance of the
reference: ``tests/gpu/test_k3mini_fast_path.py``), ``naive`` elsewhere (CPU, also under
TRITON_INTERPRET).

The chunked KDA kernel is forward-only, so a call that needs gradients always takes the torch
path. Triton modules are imported lazily: a CPU install without Triton never touches them.
"""

from __future__ import annotations

import functools
import os

import torch

from k3serve.kernels.backend import fused_decode, kernel_backend, needs_grad, use_triton


def chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
              cu_seqlens=None, chunk_size=64, cu_seqlens_host=None, gate=None):  # fmt: skip
    """:func:`k3serve.kernels.kda.chunk_kda` contract; Triton when :func:`use_triton` allows,
    the inputs are bf16/fp16/fp32, ``chunk_size == 64`` and no gradient is needed.
    ``cu_seqlens_host``: the same boundaries as host ints (the Triton path then reads nothing
    back from the device; the torch reference ignores it). ``gate``: ``(A_log, dt_bias,
    lower_bound)`` — then ``g`` is the raw gate input ``f`` and the gate
    (``k3serve.kernels.kda.naive.kda_gate``) is fused into the Triton kernel (computed first
    on the torch path)."""
    if (
        use_triton(q.device)
        and chunk_size == 64
        and q.dtype in (torch.bfloat16, torch.float16, torch.float32)
        and not needs_grad(q, k, v, g, beta, initial_state)
    ):
        from k3serve.kernels.kda.chunk_triton import chunk_kda_triton

        # Under autocast q/k (l2-normed in fp32) and v (a bf16 matmul) can differ in dtype;
        # the kernel wants one operand dtype. The output keeps v's dtype as the torch path does.
        out_dtype = v.dtype
        k, v = k.to(q.dtype), v.to(q.dtype)
        gkw = {} if gate is None else {"A_log": gate[0], "dt_bias": gate[1], "lower_bound": gate[2]}
        o, final = chunk_kda_triton(
            q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
            cu_seqlens_host=cu_seqlens_host, **gkw,
        )
        return o.to(out_dtype), final
    from k3serve.kernels.kda.chunk import chunk_kda as ref

    if gate is not None:
        from k3serve.kernels.kda.naive import kda_gate

        g = kda_gate(g, *gate)

    return ref(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, chunk_size)


def fused_recurrent_kda_step(q, k, v, g, beta, state_pool, slots, scale=None):
    """:func:`k3serve.kernels.kda.fused_recurrent_kda_step` contract, in place on the pool."""
    if use_triton(q.device) and state_pool.dtype == torch.float32:
        from k3serve.kernels.kda.recurrent_triton import fused_recurrent_kda_step_triton

        return fused_recurrent_kda_step_triton(q, k, v, g, beta, state_pool, slots, scale)
    from k3serve.kernels.kda.recurrent import fused_recurrent_kda_step as ref

    return ref(q, k, v, g, beta, state_pool, slots, scale)


def causal_conv_step(x, conv_pool, weight, slots):
    """:func:`k3serve.kernels.kda.recurrent.causal_conv_step` contract, in place on the pool."""
    if use_triton(x.device):
        from k3serve.kernels.kda.recurrent_triton import causal_conv_step_triton

        return causal_conv_step_triton(x, conv_pool, weight, slots)
    from k3serve.kernels.kda.recurrent import causal_conv_step as ref

    return ref(x, conv_pool, weight, slots)


def mla_decode_absorbed_paged(q_lat, latent_pool, block_table, seq_lens, kv_lora, scale,
                              max_seq_len=None):  # fmt: skip
    """:func:`k3serve.kernels.mla.naive.mla_decode_absorbed_paged` contract; ``max_seq_len``
    (a host int ≥ every ``seq_lens``, or None) lets the Triton kernel size its splits without
    reading ``seq_lens`` back (a host sync a CUDA graph cannot capture)."""
    if use_triton(q_lat.device) and latent_pool.dtype != torch.float64:
        from k3serve.kernels.mla.decode_triton import mla_decode_absorbed_paged_triton

        return mla_decode_absorbed_paged_triton(
            q_lat, latent_pool, block_table, seq_lens, kv_lora, scale, max_seq_len=max_seq_len
        )
    from k3serve.kernels.mla.naive import mla_decode_absorbed_paged as ref

    return ref(q_lat, latent_pool, block_table, seq_lens, kv_lora, scale)


def mla_prefill_impl(device: torch.device | str | None = None) -> str:
    """``"sdpa"`` or ``"naive"`` from ``K3SERVE_MLA_PREFILL``; unset: ``"sdpa"`` when
    ``device`` is a CUDA device, else ``"naive"``.

    Raises:
        ValueError: any other value.
    """
    default = "sdpa" if device is not None and torch.device(device).type == "cuda" else "naive"
    val = os.environ.get("K3SERVE_MLA_PREFILL", "").strip().lower() or default
    if val not in ("naive", "sdpa"):
        raise ValueError(f"K3SERVE_MLA_PREFILL={val!r}: expected 'naive' or 'sdpa'")
    return val


def mla_prefill_paged(q, latent_pool, block_table, cu_seqlens, num_cached, kv_b_weight,
                      qk_nope, v_dim, scale, host_meta=None):  # fmt: skip
    """:func:`k3serve.kernels.mla.naive.mla_prefill_naive_paged` contract (output dtype may be
    ``q.dtype``). With ``K3SERVE_MLA_PREFILL=sdpa`` (the default for CUDA tensors), where
    :func:`use_triton` allows and no gradient is needed: SDPA in ``q.dtype``
    (:mod:`k3serve.kernels.mla.prefill_sdpa`, no ``[H, T, L]`` scores in memory; ``host_meta``:
    the forward's host copy of the sequence metadata, see ``prefill_sdpa.make_host_meta``);
    else the naive float32 reference."""
    if (mla_prefill_impl(q.device) == "sdpa" and use_triton(q.device) and q.dtype != torch.float64
            and not needs_grad(q, kv_b_weight)):
        from k3serve.kernels.mla.prefill_sdpa import mla_prefill_sdpa_paged as fast

        return fast(q, latent_pool, block_table, cu_seqlens, num_cached, kv_b_weight, qk_nope,
                    v_dim, scale, host_meta)  # fmt: skip
    from k3serve.kernels.mla.naive import mla_prefill_naive_paged as ref

    return ref(q, latent_pool, block_table, cu_seqlens, num_cached, kv_b_weight, qk_nope, v_dim,
               scale)  # fmt: skip


def rms_norm(x, weight, eps, gate=None):
    """RMSNorm (× ``σ(gate)`` when given): :func:`k3serve.kernels.naive.rms_norm` contract, in
    ``x.dtype``. One fused Triton launch (:mod:`k3serve.kernels.fused_triton`) when
    :func:`use_triton` allows and no gradient is needed, else the torch reference."""
    if (
        use_triton(x.device)
        and x.is_floating_point()
        and x.dtype != torch.float64
        and not needs_grad(x, weight, gate)
    ):
        from k3serve.kernels.fused_triton import rms_norm_triton

        return rms_norm_triton(x, weight, eps, gate)
    from k3serve.kernels.naive import rms_norm as ref

    if gate is None:
        return ref(x, weight, eps)
    return (ref(x.float(), weight, eps) * torch.sigmoid(gate.float())).to(x.dtype)


def glu(gate, up, act, beta=4.0, beta_l=25.0):
    """SiTU-GLU / SwiGLU (:func:`k3serve.model.layers.glu_act` contract); one fused Triton
    launch when :func:`use_triton` allows and no gradient is needed, else the torch reference."""
    if use_triton(gate.device) and gate.dtype != torch.float64 and not needs_grad(gate, up):
        from k3serve.kernels.fused_triton import glu_triton

        return glu_triton(gate, up, act, beta, beta_l)
    from k3serve.kernels.naive import situ_glu, swiglu

    if act == "situ":
        return situ_glu(gate, up, beta, beta_l)
    if act == "silu":
        return swiglu(gate, up)
    raise ValueError(f"hidden_act: {act!r} is not 'situ' or 'silu'")


def l2norm_heads(x, eps=1e-6, dtype=None):
    """:func:`k3serve.kernels.naive.l2norm` of ``x [T, G, H, K]`` regrouped to ``[G, T, H, K]``
    (contiguous, ``dtype`` or ``x.dtype``): one Triton launch
    (:func:`k3serve.kernels.prefill_triton.l2norm_heads_triton`) when :func:`use_triton`
    allows and no gradient is needed, else the torch reference."""
    if use_triton(x.device) and x.dtype != torch.float64 and not needs_grad(x):
        from k3serve.kernels.prefill_triton import l2norm_heads_triton

        return l2norm_heads_triton(x, eps, dtype)
    from k3serve.kernels.naive import l2norm

    return l2norm(x, eps).to(dtype or x.dtype).transpose(0, 1).contiguous()


def conv_varlen(x, weight, cu_seqlens, history):
    """The KDA prefill conv (:func:`k3serve.kernels.kda.naive.causal_conv_varlen` contract):
    one Triton launch (:func:`k3serve.kernels.prefill_triton.conv_varlen_triton`, no host
    sync) when :func:`use_triton` allows and no gradient is needed, else the torch
    reference."""
    if use_triton(x.device) and x.dtype != torch.float64 and not needs_grad(x, weight, history):
        from k3serve.kernels.prefill_triton import conv_varlen_triton

        return conv_varlen_triton(x, weight, cu_seqlens, history)
    from k3serve.kernels.kda.naive import causal_conv_varlen

    return causal_conv_varlen(x, weight, cu_seqlens, history)


def attn_res_mix_prefill(sources, norm_weight, query, eps):
    """:func:`k3serve.kernels.naive.attn_res_mix` contract for prefill-sized inputs: one Triton
    launch (:func:`k3serve.kernels.prefill_triton.attn_res_mix_triton`) when :func:`use_triton`
    allows, no gradient is needed and there are at most ``ATTN_RES_MAX_SOURCES`` sources, else
    the torch reference. The decode step does not come here."""
    from k3serve.kernels.naive import attn_res_mix as ref

    if (
        len(sources) > 1
        and use_triton(sources[0].device)
        and sources[0].dtype != torch.float64
        and not needs_grad(*sources, norm_weight, query)
    ):
        from k3serve.kernels.prefill_triton import ATTN_RES_MAX_SOURCES, attn_res_mix_triton

        if len(sources) <= ATTN_RES_MAX_SOURCES:
            return attn_res_mix_triton(sources, norm_weight, query, eps)
    return ref(sources, norm_weight, query, eps)


def routed_experts(z, w13, w2, topk_ids, topk_weights, act, beta=4.0, beta_l=25.0, packed=None):
    """Routed-expert sum ``Σ_j w[t, j] E_{ids[t, j]}(z[t])`` as grouped GEMMs (no host sync).

    Args:
        z: ``[T, W]`` expert inputs. w13: ``[E, 2I, W]`` gate then up rows; w2: ``[E, W, I]``
            (dense, any float dtype; cast to ``z.dtype``).
        topk_ids: ``[T, k]`` int64; topk_weights: ``[T, k]`` float32.
        act: ``"situ"`` or ``"silu"``; beta, beta_l: the SiTU-GLU bounds.
        packed: optional MXFP4 ``(w13 uint8 [E, 2I, W/2], s13 [E, 2I, W/32], w2 [E, W, I/2],
            s2 [E, W, I/32])``: the Triton path reads these instead of the dense weights.

    Returns:
        ``[T, W]`` float32. Triton (:mod:`k3serve.kernels.moe.grouped_triton`) when
        :func:`use_triton` allows and ``z`` is bf16/fp16/fp32 — from
        ``LARGE_M_ROWS_PER_EXPERT`` rows per expert on average (prefill) through
        ``routed_experts_large_m`` (``torch._grouped_mm`` on the dense weights, which equal the
        dequantised MXFP4 bytes), below it the two-launch kernels — else the torch grouped path
        (:mod:`k3serve.kernels.moe.grouped`); reference: ``k3serve.kernels.moe.naive``.
    """
    if use_triton(z.device) and z.dtype in (torch.bfloat16, torch.float16, torch.float32):
        from k3serve.kernels.moe import grouped_triton as gt
        from k3serve.kernels.moe.grouped import has_grouped_mm
        from k3serve.kernels.moe.grouped_triton import TritonExperts, routed_experts_triton

        if (
            z.shape[0] * topk_ids.shape[1] >= gt.LARGE_M_ROWS_PER_EXPERT * w13.shape[0]
            and w13.dtype == z.dtype == w2.dtype
            and has_grouped_mm(z.device.type, z.dtype)
        ):  # prefill-sized: the dense weights (= the dequantised MXFP4 bytes), grouped GEMM
            return gt.routed_experts_large_m(z, w13, w2, topk_ids, topk_weights, act, beta, beta_l)
        if packed is not None:
            experts = TritonExperts(packed[0], packed[2], packed[1], packed[3])
        else:
            experts = TritonExperts(w13.to(z.dtype), w2.to(z.dtype))
        return routed_experts_triton(z, experts, topk_ids, topk_weights, act, beta, beta_l)
    from k3serve.kernels.moe.grouped import routed_experts_grouped
    from k3serve.kernels.naive import situ_glu, swiglu

    if act == "situ":
        fn = functools.partial(situ_glu, beta=beta, beta_l=beta_l)
    elif act == "silu":
        fn = swiglu
    else:
        raise ValueError(f"act: {act!r} is not 'situ' or 'silu'")
    return routed_experts_grouped(z, w13, w2, topk_ids, topk_weights, fn)


__all__ = [
    "attn_res_mix_prefill",
    "causal_conv_step",
    "chunk_kda",
    "conv_varlen",
    "fused_decode",
    "fused_recurrent_kda_step",
    "glu",
    "kernel_backend",
    "mla_decode_absorbed_paged",
    "mla_prefill_impl",
    "mla_prefill_paged",
    "rms_norm",
    "routed_experts",
    "use_triton",
]
