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

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from k3serve.cache.specs import CacheDtypes, KDAStateSpec, MLALatentSpec, dtype_bytes
from k3serve.config import ModelConfig, load_config

MXFP4_BYTES_PER_PARAM = 17 / 32  # 4-bit element + one 8-bit E8M0 scale per 32 elements
GB = 10**9  # accelerator memory is quoted in decimal GB (an H200 has 141 GB)
ROLES = ("prefill", "decode")
PLACEMENTS = ("pack", "spread")
RESOURCES = ("GPU", "CPU")


class PlanError(ValueError):
    """A config that cannot run: the message names the instance and the shortfall."""


# ============================================================================ the config
@dataclass(frozen=True)
class ClusterSpec:
    """The machines: ``nodes`` × ``accelerators_per_node`` ranks of ``accelerator_memory`` bytes.

    Attributes:
        nodes: Ray nodes.
        accelerators_per_node: ranks one node holds (GPUs; on a CPU cluster: rank slots).
        accelerator_memory: bytes of one accelerator (or one CPU rank's budget).
        memory_utilization: fraction of it for weights + cache, in (0, 1].
        resource: ``"GPU"`` (one Ray GPU per rank) or ``"CPU"`` (``cpus_per_rank`` CPUs).
        cpus_per_rank: Ray CPUs each rank actor asks for (may be fractional or 0).
    """

    nodes: int
    accelerators_per_node: int
    accelerator_memory: int
    memory_utilization: float = 0.9
    resource: str = "GPU"
    cpus_per_rank: float = 0.0

    @property
    def num_accelerators(self) -> int:
        return self.nodes * self.accelerators_per_node


@dataclass(frozen=True)
class PoolSpec:
    """One pool (prefill or decode) of identical instances.

    Attributes:
        role: ``"prefill"`` or ``"decode"``.
        instances: instance count (scale the pool here).
        tp: head tensor-parallel ranks per attention group.
        ep: expert-parallel ranks = ranks of one instance (a multiple of ``tp``).
        placement: ``"pack"`` (instances on as few nodes as possible) or ``"spread"`` (one per
            node where possible); an instance spanning nodes always gets whole nodes.
        num_slots: KDA state slots per attention group (running sequences).
        num_snapshots: KDA snapshot budget per attention group.
        min_tokens: MLA latent tokens an attention group must hold at least.
    """

    role: str
    instances: int
    tp: int = 1
    ep: int = 1
    placement: str = "pack"
    num_slots: int = 32
    num_snapshots: int = 32
    min_tokens: int = 4096

    @property
    def ranks(self) -> int:
        return self.ep

    @property
    def dp(self) -> int:
        return self.ep // self.tp


@dataclass(frozen=True)
class RouterSpec:
    """Where the router listens and how it places (``python -m router`` flags);
    ``replicas``: router processes behind that address (``--replicas``, router/replicas.py)."""

    host: str = "127.0.0.1"
    port: int = 8000
    policy: str = "prefix_home"
    replicas: int = 1


@dataclass(frozen=True)
class DeployConfig:
    """A parsed ``deploy/configs/*.yaml`` (see :func:`load_deploy_config` for the keys).

    Attributes:
        name: config name (the file's stem).
        model: preset name or checkpoint folder (:func:`k3serve.config.load_config`).
        dtype: non-expert weight and cache dtype (``"bfloat16"`` on GPUs, ``"float32"`` on CPU).
        device: worker ``--device`` (``"cuda"`` or ``"cpu"``).
        block_size: tokens per cache block.
        max_restarts: Ray restarts of a dead actor before it stays dead.
        cluster, router, pools: see the classes.
        worker_args: extra flags for every worker command line.
    """

    name: str
    model: str
    dtype: str
    device: str
    block_size: int
    max_restarts: int
    cluster: ClusterSpec
    router: RouterSpec
    pools: dict[str, PoolSpec]
    worker_args: tuple[str, ...] = ()


def _need(cond: bool, field_name: str, msg: str) -> None:
    if not cond:
        raise ValueError(f"{field_name}: {msg}")


def _int(d: dict[str, Any], key: str, where: str, lo: int, default: int | None = None) -> int:
    v = d.get(key, default)
    _need(isinstance(v, int) and not isinstance(v, bool) and v >= lo, f"{where}.{key}",
          f"must be an int >= {lo}, got {v!r}")
    return v


def _num(d: dict[str, Any], key: str, where: str, default: float | None = None) -> float:
    v = d.get(key, default)
    _need(isinstance(v, (int, float)) and not isinstance(v, bool), f"{where}.{key}",
          f"must be a number, got {v!r}")
    return float(v)


def _known(d: dict[str, Any], where: str, keys: set[str]) -> None:
    extra = sorted(set(d) - keys)
    _need(not extra, where, f"unknown key(s) {extra}; known: {sorted(keys)}")


def parse_deploy_config(doc: dict[str, Any], name: str = "config") -> DeployConfig:
    """A :class:`DeployConfig` from the YAML document's dict.

    Keys: ``model``, ``dtype``, ``device``, ``block_size``, ``max_restarts``, ``cluster``
    {``nodes``, ``accelerators_per_node``, ``accelerator_memory_gb``, ``memory_utilization``,
    ``resource``, ``cpus_per_rank``}, ``router`` {``host``, ``port``, ``policy``}, ``pools``
    {``prefill``, ``decode``: {``instances``, ``tp``, ``ep``, ``placement``, ``num_slots``,
    ``num_snapshots``, ``min_tokens``}}, ``worker_args`` (list of strings).

    Raises:
        ValueError: a missing, unknown or out-of-range key (named, e.g. ``pools.decode.tp``).
    """
    _need(isinstance(doc, dict), "config", "must be a mapping")
    _known(doc, "config", {"model", "dtype", "device", "block_size", "max_restarts", "cluster",
                           "router", "pools", "worker_args"})
    _need(isinstance(doc.get("model"), str), "model", "must be a preset name or folder")
    dtype = doc.get("dtype", "bfloat16")
    dtype_bytes(dtype)
    device = doc.get("device", "cuda")
    _need(device in ("cuda", "cpu"), "device", f"must be cuda or cpu, got {device!r}")
    c = doc.get("cluster")
    _need(isinstance(c, dict), "cluster", "must be a mapping")
    _known(c, "cluster", {"nodes", "accelerators_per_node", "accelerator_memory_gb",
                          "memory_utilization", "resource", "cpus_per_rank"})
    util = _num(c, "memory_utilization", "cluster", 0.9)
    _need(0 < util <= 1, "cluster.memory_utilization", f"must lie in (0, 1], got {util}")
    mem = _num(c, "accelerator_memory_gb", "cluster")
    _need(mem > 0, "cluster.accelerator_memory_gb", "must be > 0")
    res = c.get("resource", "GPU")
    _need(res in RESOURCES, "cluster.resource", f"must be one of {RESOURCES}, got {res!r}")
    cpus = _num(c, "cpus_per_rank", "cluster", 0.0)
    _need(cpus >= 0, "cluster.cpus_per_rank", "must be >= 0")
    cluster = ClusterSpec(
        nodes=_int(c, "nodes", "cluster", 1), accelerators_per_node=_int(
            c, "accelerators_per_node", "cluster", 1),
        accelerator_memory=int(mem * GB), memory_utilization=util, resource=res,
        cpus_per_rank=cpus)
    r = doc.get("router", {}) or {}
    _known(r, "router", {"host", "port", "policy", "replicas"})
    router = RouterSpec(host=str(r.get("host", "127.0.0.1")),
                        port=_int(r, "port", "router", 0, 8000),
                        policy=str(r.get("policy", "prefix_home")),
                        replicas=_int(r, "replicas", "router", 1, 1))
    pools_doc = doc.get("pools")
    _need(isinstance(pools_doc, dict) and set(pools_doc) == set(ROLES), "pools",
          f"must have exactly the keys {ROLES}")
    pools: dict[str, PoolSpec] = {}
    for role in ROLES:
        p, where = pools_doc[role], f"pools.{role}"
        _need(isinstance(p, dict), where, "must be a mapping")
        _known(p, where, {"instances", "tp", "ep", "placement", "num_slots", "num_snapshots",
                          "min_tokens"})
        tp = _int(p, "tp", where, 1, 1)
        ep = _int(p, "ep", where, 1, tp)
        _need(ep % tp == 0, f"{where}.ep", f"must be a multiple of tp={tp}, got {ep}")
        placement = p.get("placement", "pack")
        _need(placement in PLACEMENTS, f"{where}.placement",
              f"must be one of {PLACEMENTS}, got {placement!r}")
        pools[role] = PoolSpec(
            role=role, instances=_int(p, "instances", where, 1), tp=tp, ep=ep,
            placement=placement, num_slots=_int(p, "num_slots", where, 1, 32),
            num_snapshots=_int(p, "num_snapshots", where, 0, 32),
            min_tokens=_int(p, "min_tokens", where, 1, 4096))
    wargs = doc.get("worker_args", []) or []
    _need(isinstance(wargs, list) and all(isinstance(a, str) for a in wargs), "worker_args",
          "must be a list of strings")
    return DeployConfig(
        name=name, model=doc["model"], dtype=dtype, device=device,
        block_size=_int(doc, "block_size", "config", 1, 64),
        max_restarts=_int(doc, "max_restarts", "config", 0, 3), cluster=cluster,
        router=router, pools=pools, worker_args=tuple(wargs))


def load_deploy_config(path: str | Path) -> DeployConfig:
    """Read a YAML deployment config.

    Raises:
        ValueError: the file is not YAML or a key is wrong (named).
    """
    import yaml

    path = Path(path)
    try:
        doc = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ValueError(f"config: {path} is not valid YAML: {e}") from None
    return parse_deploy_config(doc, name=path.stem)


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
            (f"config {self.config.name}: model {self.model} on {c.nodes} nodes × "
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


__all__ = [
    "MXFP4_BYTES_PER_PARAM",
    "ClusterSpec",
    "DeployConfig",
    "InstancePlan",
    "Plan",
    "PlanError",
    "PoolSpec",
    "RouterSpec",
    "WeightParams",
    "expert_bytes_per_param",
    "load_deploy_config",
    "make_plan",
    "parse_deploy_config",
    "weight_params",
]


def main(argv: list[str] | None = None) -> int:
    """``k3serve plan --config FILE [--json OUT]`` (= ``python -m deploy.plan``): print the memory
    plan; a config that cannot fit is refused on stderr naming the instance and the shortfall
    (exit status 1)."""
    import argparse
    import json
    import sys

    ap = argparse.ArgumentParser(prog="k3serve plan",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                                 description="memory plan of a deployment config; refuses what "
                                             "cannot fit")
    ap.add_argument("--config", required=True, help="deploy/configs/*.yaml")
    ap.add_argument("--json", default=None, metavar="OUT", help="also write the plan as JSON")
    args = ap.parse_args(argv)
    try:
        plan = make_plan(load_deploy_config(args.config))
    except PlanError as e:
        print(f"k3serve plan: refused: {e}", file=sys.stderr)
        return 1
    except ValueError as e:
        print(f"k3serve plan: error: {e}", file=sys.stderr)
        return 2
    print(plan.format())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(plan.to_dict(), f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
