"""Deployment configs and the memory plan: what each prefill / decode instance holds per rank.

A deployment config (``deploy/configs/*.yaml``) names a model preset, a cluster (nodes ×
accelerators of some memory) and two pools (prefill, decode): instance counts, head tensor
parallelism ``tp`` and expert parallelism ``ep`` per instance, and the cache each instance must
hold at least. :func:`make_plan` turns it into per-rank bytes from the model's byte arithmetic
(:class:`k3serve.config.ModelConfig` for parameters, :mod:`k3serve.cache.specs` for caches) and
refuses a config whose weights or minimum cache do not fit, naming the instance and the
shortfall. Pure Python (no torch, no Ray).

Rank layout of one instance (DeepSeek-style: data-parallel attention, expert-parallel MoE)::

    ranks = ep                       every rank holds 1/ep of the routed experts
    tp    | ep                        heads (KDA and MLA), dense MLP, shared experts, embeddings
                                      and LM head are split over tp ranks
    dp    = ep / tp                   attention groups; each runs its own sequences

Per rank (bytes)::

    weights   = experts / ep (MXFP4: 17/32 B/param = 4-bit values + one E8M0 scale per 32)
              + sharded non-expert weights / tp (model dtype)
              + replicated weights (MoE router gates, norms)
    usable    = accelerator memory × memory_utilization       (the rest: activations, runtime)
    cache     = usable − weights
              = num_slots × kda_slot/tp         KDA state of running sequences (heads split)
              + num_snapshots × kda_slot/tp     KDA snapshot budget
              + tokens × mla_latent_per_token   MLA latents, replicated on every rank of a
                                                head-TP group (one latent per token, all heads)

Refused (:class:`PlanError`): ``weights > usable`` ("weights"), or ``cache`` smaller than the
slots + snapshots + ``min_tokens`` latents ("minimum cache"), or an instance / all instances
needing more accelerators or nodes than the cluster has.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass, field
from typing import Any

from deploy.config import GB, ROLES, DeployConfig, load_deploy_config
from k3serve.cache.specs import CacheDtypes, KDAStateSpec, MLALatentSpec, dtype_bytes
from k3serve.config import ModelConfig, load_config
from k3serve.process import CommandParser, flag_message

MXFP4_BYTES_PER_PARAM = 17 / 32  # 4-bit element + one 8-bit E8M0 scale per 32 elements


class PlanError(ValueError):
    """A config that cannot run: the message names the instance and the shortfall."""


# ============================================================================ weights
@dataclass(frozen=True)
class WeightParams:
    """Parameter counts by how they are laid out over an instance's ranks."""

    routed_experts: int  # split over ep ranks
    replicated: int  # MoE router gates + biases, norms, AttnRes vectors: on every rank
    sharded: int  # everything else: split over tp ranks

    @property
    def total(self) -> int:
        return self.routed_experts + self.replicated + self.sharded


def weight_params(cfg: ModelConfig) -> WeightParams:
    """Split ``cfg.num_params`` into routed-expert, replicated and tp-sharded parameters.

    Routed experts: ``3 × width × moe_intermediate_size`` per expert (gate, up, down at the
    latent width when ``moe_latent_size`` is set), ``n_routed_experts`` per MoE layer.
    """
    d = cfg.hidden_size
    moe_layers = cfg.num_layers - cfg.first_k_dense
    width = cfg.moe_latent_size or d
    experts = moe_layers * cfg.n_routed_experts * 3 * width * cfg.moe_intermediate_size
    per_layer_norms = 2 * d + (4 * d if cfg.attn_res_block_layers else 0)
    replicated = (moe_layers * (d * cfg.n_routed_experts + cfg.n_routed_experts)
                  + cfg.num_layers * per_layer_norms + d
                  + (2 * d if cfg.attn_res_block_layers else 0))
    sharded = cfg.num_params - experts - replicated
    if sharded < 0:  # the split must account for every parameter
        raise ValueError(f"model: parameter split failed for {cfg.name} (sharded {sharded})")
    return WeightParams(experts, replicated, sharded)


def expert_bytes_per_param(cfg: ModelConfig, dtype: str) -> float:
    """MXFP4 experts: 17/32 B/param (≈ 0.53); otherwise the weight dtype's bytes."""
    return MXFP4_BYTES_PER_PARAM if cfg.expert_quant == "mxfp4" else dtype_bytes(dtype)


# ============================================================================ the plan
@dataclass(frozen=True)
class InstancePlan:
    """Per-rank memory of one instance (bytes unless named otherwise)."""

    name: str  # "prefill-0"
    role: str
    index: int
    ranks: int
    tp: int
    ep: int
    dp: int
    nodes: int  # whole nodes when it spans several; 1 otherwise
    ranks_per_node: int
    weights_per_rank: int
    usable_per_rank: int
    cache_per_rank: int
    kda_slot_bytes_per_rank: int
    num_slots: int
    num_snapshots: int
    mla_bytes_per_token: int
    mla_tokens_per_rank: int
    num_pages: int  # MLA pages of block_size tokens per rank (the worker's --num-pages)


@dataclass(frozen=True)
class Plan:
    """The memory plan of a :class:`DeployConfig` (see the module docstring)."""

    config: DeployConfig
    model: str
    num_params: int
    weights_total: int  # one instance's weights, all ranks' shards once (experts as planned)
    weights_total_bf16: int  # the same with every parameter in bf16
    kda_state_bytes_per_seq: int  # one sequence's KDA recurrent + conv state, all heads
    mla_latent_bytes_per_token: int
    instances: list[InstancePlan] = field(default_factory=list)

    def pool(self, role: str) -> list[InstancePlan]:
        return [i for i in self.instances if i.role == role]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the figures and every instance (bytes as ints)."""
        return {
            "config": self.config.name, "model": self.model, "num_params": self.num_params,
            "weights_total_bytes": self.weights_total,
            "weights_total_bf16_bytes": self.weights_total_bf16,
            "kda_state_bytes_per_seq": self.kda_state_bytes_per_seq,
            "mla_latent_bytes_per_token": self.mla_latent_bytes_per_token,
            "cluster": asdict(self.config.cluster),
            "instances": [asdict(i) for i in self.instances],
        }

    def format(self) -> str:
        """The table ``k3serve plan`` prints."""
        c = self.config.cluster
        lines = [
            (f"config {self.config.name}: model {self.model} on {c.nodes} "
            f"node{'s' if c.nodes != 1 else ''} × "
            f"{c.accelerators_per_node} {c.resource} of {_gb(c.accelerator_memory)} "
            f"({c.memory_utilization:.0%} usable)"),
            (f"weights (one instance) {_gb(self.weights_total)}  (all bf16: "
            f"{_gb(self.weights_total_bf16)})   KDA state / sequence "
            f"{self.kda_state_bytes_per_seq / 2**20:.1f} MiB   MLA latent / token "
            f"{self.mla_latent_bytes_per_token / 1024:.1f} KiB"),
            (f"{'instance':<11} {'ranks':>5} {'tp×dp':>6} {'nodes':>5} {'weights/rank':>13} "
            f"{'cache/rank':>11} {'KDA slot/rank':>14} {'slots':>6} {'snaps':>6} "
            f"{'MLA tokens/rank':>16}"),
        ]
        for i in self.instances:
            lines.append(
                f"{i.name:<11} {i.ranks:>5} {f'{i.tp}×{i.dp}':>6} {i.nodes:>5} "
                f"{_gb(i.weights_per_rank):>13} {_gb(i.cache_per_rank):>11} "
                f"{i.kda_slot_bytes_per_rank / 2**20:>10.1f} MiB {i.num_slots:>6} "
                f"{i.num_snapshots:>6} {i.mla_tokens_per_rank:>16,}")
        return "\n".join(lines)


def _gb(n: float) -> str:
    return f"{n / GB:,.1f} GB" if n >= GB / 10 else f"{n / 2**20:,.1f} MiB"


def make_plan(dc: DeployConfig, model: ModelConfig | None = None) -> Plan:
    """The memory plan of ``dc``.

    Args:
        dc: the deployment config.
        model: the model config (default: ``load_config(dc.model)``).

    Returns:
        A :class:`Plan` with one :class:`InstancePlan` per instance, prefill first.

    Raises:
        PlanError: weights or the minimum cache do not fit a rank, an instance needs more
            nodes than the cluster has, or all instances need more accelerators than it has;
            the message names the instance and the shortfall.
        ValueError: a pool's ``tp`` does not divide the model's heads, or ``ep`` the experts.
    """
    cfg = model or load_config(dc.model)
    c = dc.cluster
    wp = weight_params(cfg)
    rest_b = dtype_bytes(dc.dtype)
    ebpp = expert_bytes_per_param(cfg, dc.dtype)
    kda = KDAStateSpec.from_config(cfg, CacheDtypes.for_config(cfg, dc.dtype))
    mla = MLALatentSpec.from_config(cfg, dc.block_size, dc.dtype)
    usable = int(c.accelerator_memory * c.memory_utilization)
    plan = Plan(
        config=dc, model=cfg.name, num_params=cfg.num_params,
        weights_total=int(wp.routed_experts * ebpp + (wp.sharded + wp.replicated) * rest_b),
        weights_total_bf16=wp.total * 2, kda_state_bytes_per_seq=kda.slot_size_bytes,
        mla_latent_bytes_per_token=mla.bytes_per_token)
    total_ranks = 0
    for role in ROLES:
        p = dc.pools[role]
        where = f"pools.{role}"
        for heads, what in ((cfg.kda_num_heads, "KDA"), (cfg.mla_num_heads, "MLA")):
            if heads and heads % p.tp:
                raise ValueError(f"{where}.tp: {p.tp} does not divide the {heads} {what} heads")
        if cfg.n_routed_experts and cfg.n_routed_experts % p.ep:
            raise ValueError(f"{where}.ep: {p.ep} does not divide the {cfg.n_routed_experts} "
                             f"experts")
        per_node = c.accelerators_per_node
        nodes = math.ceil(p.ranks / per_node)
        if nodes > 1 and p.ranks % per_node:
            raise PlanError(f"{role}-0: {p.ranks} ranks span nodes of {per_node} but are not "
                            f"whole nodes")
        if nodes > c.nodes:
            raise PlanError(f"{role}-0: {p.ranks} ranks need {nodes} nodes of {per_node}, the "
                            f"cluster has {c.nodes}; short by {nodes - c.nodes} nodes")
        weights = math.ceil(wp.routed_experts * ebpp / p.ep + wp.sharded * rest_b / p.tp
                            + wp.replicated * rest_b)
        slot = kda.slot_size_bytes // p.tp
        for k in range(p.instances):
            name = f"{role}-{k}"
            if weights > usable:
                raise PlanError(
                    f"{name}: weights need {_gb(weights)} per rank (tp {p.tp}, ep {p.ep}) but "
                    f"{_gb(usable)} are usable; short by {_gb(weights - usable)} per rank")
            cache = usable - weights
            fixed = (p.num_slots + p.num_snapshots) * slot
            need = fixed + p.min_tokens * mla.bytes_per_token
            if cache < need:
                raise PlanError(
                    f"{name}: minimum cache ({p.num_slots} KDA slots + {p.num_snapshots} "
                    f"snapshots of {_gb(slot)} + {p.min_tokens:,} MLA tokens) needs "
                    f"{_gb(need)} per rank, {_gb(cache)} are left after the weights; short "
                    f"by {_gb(need - cache)} per rank")
            tokens = (cache - fixed) // mla.bytes_per_token
            plan.instances.append(InstancePlan(
                name=name, role=role, index=k, ranks=p.ranks, tp=p.tp, ep=p.ep, dp=p.dp,
                nodes=nodes, ranks_per_node=min(p.ranks, per_node), weights_per_rank=weights,
                usable_per_rank=usable, cache_per_rank=cache, kda_slot_bytes_per_rank=slot,
                num_slots=p.num_slots, num_snapshots=p.num_snapshots,
                mla_bytes_per_token=mla.bytes_per_token, mla_tokens_per_rank=int(tokens),
                num_pages=int(tokens // dc.block_size)))
            total_ranks += p.ranks
    if total_ranks > c.num_accelerators:
        raise PlanError(f"cluster: the instances need {total_ranks} accelerators, the cluster "
                        f"has {c.num_accelerators}; short by {total_ranks - c.num_accelerators}")
    return plan


def build_parser(prog: str = "k3serve plan") -> argparse.ArgumentParser:
    """The flags of ``k3serve plan`` (= ``python -m deploy.plan``)."""
    ap = CommandParser(prog=prog, formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                       description="memory plan of a deployment config; refuses what cannot fit")
    ap.add_argument("--config", required=True, help="deploy/configs/*.yaml")
    ap.add_argument("--json", default=None, metavar="OUT", help="also write the plan as JSON")
    return ap


def run(args: argparse.Namespace) -> int:
    """Print the memory plan of ``args.config`` (and write ``args.json``). A config that cannot
    fit is refused on stderr naming the instance and the shortfall (exit status 1); a missing
    or bad config file, or an unwritable ``--json``, is one line on stderr (exit status 2)."""
    try:
        plan = make_plan(load_deploy_config(args.config))
    except PlanError as e:
        print(f"k3serve plan: refused: {e}", file=sys.stderr)
        return 1
    except ValueError as e:
        print(f"k3serve plan: error: {flag_message(str(e), args)}", file=sys.stderr)
        return 2
    print(plan.format())
    if args.json:
        try:
            with open(args.json, "w") as f:
                json.dump(plan.to_dict(), f, indent=2)
        except OSError as e:
            print(f"k3serve plan: error: --json: cannot write {args.json} ({e.strerror or e})",
                  file=sys.stderr)
            return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m deploy.plan [flags]`` = ``k3serve plan [flags]``."""
    return run(build_parser().parse_args(argv))


__all__ = [
    "MXFP4_BYTES_PER_PARAM",
    "InstancePlan",
    "Plan",
    "PlanError",
    "WeightParams",
    "build_parser",
    "expert_bytes_per_param",
    "main",
    "make_plan",
    "run",
    "weight_params",
]


if __name__ == "__main__":
    raise SystemExit(main())
