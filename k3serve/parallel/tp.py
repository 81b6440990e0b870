"""Tensor parallelism for KDA, Gated MLA and the dense / shared MLPs (Megatron-style split).

Heads (KDA and MLA) and MLP inner channels are split evenly over the TP ranks; every
projection INTO heads is column-parallel (rank p keeps its rows), every projection OUT of them
is row-parallel (rank p keeps its input columns) and ends in an all-reduce (sum)::

    KDA   q/k/v/g/f_b_proj [H·K, ·], q/k/v conv [H·K, W], b_proj [H, d], A_log [H],
          dt_bias [H·K]                                  → heads p·H/tp … (p+1)·H/tp − 1
          f_a_proj (rank 128), o_norm (per head width)   → replicated
          o_proj [d, H·K]                                → columns of the local heads + all-reduce
    MLA   q_b_proj / q_proj [H·(nope+rope), ·], kv_b_proj [H·(nope+v), c], g_proj [H·v, d]
                                                          → local heads
          q_a_proj, q_a_layernorm, kv_a_proj_with_mqa, kv_a_layernorm
                                                          → replicated: the latent [c ; k_pe]
                                                            (one per token, shared by all heads)
                                                            is computed and cached on every rank
          o_proj [d, H·v]                                → row-parallel + all-reduce
    MLP   gate_proj / up_proj [I, d] → rows I/tp;  down_proj [d, I] → row-parallel + all-reduce
          (the dense layer-0 MLP and the MoE's shared experts)

Everything else (embedding, AttnRes, norms, router, routed experts, LM head) is replicated; the
routed experts are split by expert parallelism instead (``k3serve.parallel.ep``).

Per-rank caches follow from ``local_config``: KDA state ``[S, H/tp, K, V]`` and conv state
``[S, W−1, 3·H/tp·K]`` are split (each rank only ever reads its heads' states), the MLA latent
pool ``[P, B, kv_lora + rope]`` is the full one on every rank (replicated: the memory plan
counts it tp times).

Math: Megatron-LM (Shoeybi et al. 2019, §3) column / row parallel linear layers.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from k3serve.config import ModelConfig


class RowParallelLinear(nn.Module):
    """``y = all_reduce(x_p W_pᵀ)`` — a Linear whose input columns are split over the group.

    Args:
        weight: ``[out, in/tp]`` this rank's columns.
        group: process group (None = default).

    Shapes: ``x [..., in/tp]`` → ``[..., out]``, the sum over ranks (same dtype as ``x``).
    """

    def __init__(self, weight: torch.Tensor, group=None) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.detach().clone(), requires_grad=False)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        dist.all_reduce(y, group=self.group)
        return y


def _check(n: int, tp: int, field: str) -> int:
    if n % tp:
        raise ValueError(f"tp: {field} = {n} is not divisible by tp = {tp}")
    return n // tp


def local_config(cfg: ModelConfig, tp: int) -> ModelConfig:
    """The config whose cache shapes are one TP rank's (``KVPools(local_config(cfg, tp), …)``).

    Raises:
        ValueError: ``tp`` < 1 or a head count not divisible by ``tp`` (naming the field).
    """
    if tp < 1:
        raise ValueError(f"tp: must be ≥ 1, got {tp}")
    changes = {"kda_num_heads": _check(cfg.kda_num_heads, tp, "kda_num_heads")}
    if cfg.mla_layers:
        changes["mla_num_heads"] = _check(cfg.mla_num_heads, tp, "mla_num_heads")
    return cfg.replace(**changes)


def _rows(lin: nn.Linear, lo: int, hi: int) -> nn.Linear:
    w = lin.weight.detach()[lo:hi].clone()
    out = nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=w.dtype, device=w.device)
    out.weight = nn.Parameter(w, requires_grad=False)
    return out


def _conv(conv: nn.Conv1d, lo: int, hi: int) -> nn.Conv1d:
    w = conv.weight.detach()[lo:hi].clone()
    out = nn.Conv1d(hi - lo, hi - lo, w.shape[-1], groups=hi - lo, bias=False, dtype=w.dtype,
                    device=w.device)
    out.weight = nn.Parameter(w, requires_grad=False)
    return out


def shard_kda(mix: nn.Module, rank: int, tp: int, group=None) -> None:
    """Keep KDA heads ``rank·H/tp …`` of ``mix`` (a ``KDAMixer``; mutated in place)."""
    h, k = mix.num_heads, mix.head_dim
    hl = _check(h, tp, "kda_num_heads")
    lo, hi = rank * hl * k, (rank + 1) * hl * k
    for name in ("q_proj", "k_proj", "v_proj", "f_b_proj"):
        setattr(mix, name, _rows(getattr(mix, name), lo, hi))
    for name in ("q_conv1d", "k_conv1d", "v_conv1d"):
        setattr(mix, name, _conv(getattr(mix, name), lo, hi))
    if hasattr(mix, "g_proj"):
        mix.g_proj = _rows(mix.g_proj, lo, hi)
    else:
        mix.g_b_proj = _rows(mix.g_b_proj, lo, hi)
    mix.b_proj = _rows(mix.b_proj, rank * hl, (rank + 1) * hl)
    mix.A_log = nn.Parameter(mix.A_log.detach()[rank * hl : (rank + 1) * hl].clone(),
                             requires_grad=False)
    mix.dt_bias = nn.Parameter(mix.dt_bias.detach()[lo:hi].clone(), requires_grad=False)
    mix.o_proj = RowParallelLinear(mix.o_proj.weight[:, lo:hi], group)
    mix.num_heads = hl


def shard_mla(mix: nn.Module, rank: int, tp: int, group=None) -> None:
    """Keep MLA heads ``rank·H/tp …`` of ``mix`` (an ``MLAMixer``; mutated in place); the
    latent projection stays whole."""
    cfg = mix.cfg
    hl = _check(mix.num_heads, tp, "mla_num_heads")
    a, b = rank * hl, (rank + 1) * hl
    qd = cfg.qk_head_dim
    if hasattr(mix, "q_proj"):
        mix.q_proj = _rows(mix.q_proj, a * qd, b * qd)
    else:
        mix.q_b_proj = _rows(mix.q_b_proj, a * qd, b * qd)
    kv = cfg.qk_nope_head_dim + cfg.v_head_dim
    mix.kv_b_proj = _rows(mix.kv_b_proj, a * kv, b * kv)
    v = cfg.v_head_dim
    if hasattr(mix, "g_proj"):
        mix.g_proj = _rows(mix.g_proj, a * v, b * v)
    mix.o_proj = RowParallelLinear(mix.o_proj.weight[:, a * v : b * v], group)
    mix.num_heads = hl


def shard_mlp(mlp: nn.Module, rank: int, tp: int, group=None) -> None:
    """Keep inner channels ``rank·I/tp …`` of a dense gated ``MLP`` (mutated in place)."""
    inter = mlp.gate_proj.weight.shape[0]
    il = _check(inter, tp, "intermediate size")
    lo, hi = rank * il, (rank + 1) * il
    mlp.gate_proj = _rows(mlp.gate_proj, lo, hi)
    mlp.up_proj = _rows(mlp.up_proj, lo, hi)
    mlp.down_proj = RowParallelLinear(mlp.down_proj.weight[:, lo:hi], group)


def shard_model(model: nn.Module, rank: int, tp: int, group=None) -> None:
    """Tensor-parallel split of a whole ``K3ForCausalLM`` (module docstring; in place).

    Raises:
        ValueError: a head count or MLP width not divisible by ``tp``.
    """
    from k3serve.model.layers import MLP
    from k3serve.model.moe import MoE

    local_config(model.cfg, tp)  # validates the head counts
    if tp == 1:
        return
    for layer in model.model.layers:
        if layer.is_mla:
            shard_mla(layer.self_attn, rank, tp, group)
        else:
            shard_kda(layer.self_attn, rank, tp, group)
        if isinstance(layer.mlp, MoE):
            if hasattr(layer.mlp, "shared_experts"):
                shard_mlp(layer.mlp.shared_experts, rank, tp, group)
        elif isinstance(layer.mlp, MLP):
            shard_mlp(layer.mlp, rank, tp, group)


__all__ = [
    "RowParallelLinear",
    "local_config",
    "shard_kda",
    "shard_mla",
    "shard_mlp",
    "shard_model",
]
