"""Deployment configs (``deploy/configs/*.yaml``): a model preset, a cluster (nodes ×
accelerators of some memory), two pools (prefill, decode) with instance counts, head tensor
parallelism ``tp`` and expert parallelism ``ep`` per instance and the cache each instance must
hold at least, and the router. :func:`load_deploy_config` reads and checks one (a wrong key is a
``ValueError`` naming it); ``deploy/plan.py`` turns it into per-rank memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from k3serve.cache.specs import dtype_bytes

GB = 10**9  # accelerator memory is quoted in decimal GB (an H200 has 141 GB)
ROLES = ("prefill", "decode")
PLACEMENTS = ("pack", "spread")
RESOURCES = ("GPU", "CPU")


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
        num_slots: KDA state slots of each rank's pool: the instance's running sequences
            (slot s belongs to attention group ``s mod dp``, whose ranks hold its live state).
        num_snapshots: KDA snapshot budget of each rank (replicated over the attention groups).
        min_tokens: MLA latent tokens each rank must hold at least (latents are replicated).
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
        ValueError: the file cannot be read, is not YAML, or a key is wrong (named).
    """
    import yaml

    path = Path(path)
    try:
        doc = yaml.safe_load(path.read_text())
    except OSError as e:
        raise ValueError(f"config: cannot read {path} ({e.strerror or e})") from None
    except yaml.YAMLError as e:
        raise ValueError(f"config: {path} is not valid YAML: {yaml_error_line(e)}") from None
    return parse_deploy_config(doc, name=path.stem)


def yaml_error_line(e: Exception) -> str:
    """PyYAML's error ``e`` in one line: its context and problem, and where the problem is
    (``line L, column C``, counted from 1) instead of its excerpt with a caret."""
    problem = getattr(e, "problem", None)
    if not problem:
        return " ".join(str(e).split())
    context = getattr(e, "context", None)
    mark = getattr(e, "problem_mark", None)
    where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
    return f"{context}: {problem}{where}" if context else f"{problem}{where}"


__all__ = [
    "GB",
    "PLACEMENTS",
    "RESOURCES",
    "ROLES",
    "ClusterSpec",
    "DeployConfig",
    "PoolSpec",
    "RouterSpec",
    "load_deploy_config",
    "parse_deploy_config",
    "yaml_error_line",
]
