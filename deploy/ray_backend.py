"""The Ray backend: every prefill / decode instance a Ray actor per rank, placed by placement
groups from the memory plan; the router an actor too. ``k3serve serve --ray --config FILE`` and,
for Ray users, :func:`deploy` (after their own ``ray.init``).

What runs where (one deployment)::

    driver (k3serve serve --ray / deploy())           plan → placement groups → actors
      ├─ router actor   ProcessActor: python -m router --host H --port P --policy NAME
      ├─ prefill-k      rank 0: ProcessActor: python -m prefill.worker --port 0 --router-url …
      │                 ranks 1..R-1: RankActor: python -m k3serve.parallel.ranks (below)
      └─ decode-k       the same with decode.worker

Placement (``deploy/plan.py`` decides the shapes):

* an instance that fits one node: one bundle ``{GPU: ranks}`` per instance in one placement
  group per pool, strategy ``PACK`` (``placement: pack``) or ``SPREAD`` (``spread``);
* an instance spanning nodes (K3: 16 ranks): its own placement group of one whole-node bundle
  ``{GPU: 8}`` per node, ``STRICT_SPREAD`` — its ranks on exactly as many nodes as its memory
  needs, 8 ranks per node.

Restarts: each ProcessActor runs its command as a **child process it supervises**, not in the
actor's own process. The workers and the router are complete programs (their own uvicorn loop,
signal handling, engine thread, Mooncake engine); their command line is the stable interface
while their insides move, and a child can be killed and replaced whole. Two layers:

* the child crashes (non-zero exit, ``kill -9``): the actor starts it again itself, with an
  exponential backoff between failed starts (tenacity), at most ``child_restarts`` times in a
  row (a child that then stays up ``stable_s`` seconds resets the count); past that the actor
  exits (``os._exit``), and Ray's restart takes over. A child that exits 0 (a drained worker,
  SIGTERM) is not restarted (the actor stays, idle: an exiting actor would be restarted).
* the actor dies (a node failure, ``ray.kill``; the kernel then ends the child,
  ``PR_SET_PDEATHSIG``): Ray restarts the actor (``max_restarts`` from the config), whose
  ``__init__`` starts a fresh child.

Every new child runs with ``--port 0``: the worker binds new HTTP, bootstrap and Mooncake ports (nothing pins them; the
launcher removes ``K3SERVE_KV_BOOTSTRAP_PORT`` from the child's environment), prints
``listening on URL``, and registers with the router under its old ``--worker-id``, so peers
never keep talking to a dead endpoint. The driver's :meth:`RayStack.refresh` reads the new URL
and rewrites the Prometheus targets.

A multi-rank instance (``ranks`` = ``ep`` > 1) is R actors in its placement group, one per
accelerator, running the parallel engine of :mod:`k3serve.parallel` as its ranks::

    rank 0  ProcessActor → python -m decode.worker --tp T --ep E --remote-ranks
            (HTTP, registration, Mooncake transfer; the engine drives ParallelModelRunner)
            hosts a TCPStore on a free port, prints "rank rendezvous at HOST:PORT SPEC"
    rank r  RankActor    → python -m k3serve.parallel.ranks --store HOST:PORT --rank r …
            started by rank 0's actor (the address goes through Ray: an actor call)

The ranks meet through ``torch.distributed`` (gloo on CPU, NCCL on GPU). The instance fails
as a whole: a rank whose process exits (or whose actor dies) makes rank 0's actor kill its
child; a rank that hangs makes rank 0's next collective time out (``collective_timeout_s``,
30 s, or the workers' ``--collective-timeout`` in ``worker_args``) and rank 0 exit. Either way
rank 0's actor starts a new child on fresh ports, whose new rendezvous restarts every rank, and
the worker registers again; the router migrates the streams the old one was serving.

On one machine Ray binds to loopback (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` makes Ray's
node-address lookup return 127.0.0.1), with a small object store and no dashboard.
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from deploy.config import DeployConfig, load_deploy_config
from deploy.plan import InstancePlan, Plan, make_plan
from deploy.ray_actors import ProcessActor, RankActor
from deploy.service_discovery import ScrapeTarget, TargetWriter
from k3serve.config import ModelConfig
from k3serve.protocol import API_KEY_ENV, CLUSTER_TOKEN_ENV, api_keys_env, api_keys_from_env

log = logging.getLogger("k3serve.ray")
ROOT = Path(__file__).resolve().parents[1]
LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # "0": Ray's node IP lookup → 127.0.0.1
OBJECT_STORE_BYTES = 80 * 2**20  # Ray's minimum is 75 MiB


# ============================================================================ placement
@dataclass(frozen=True)
class RankSlot:
    """Where one rank goes: placement group index, bundle index and its resources."""

    instance: str
    rank: int
    group: int
    bundle: int


def placement_layout(plan: Plan) -> tuple[list[tuple[list[dict[str, float]], str]],
                                          list[RankSlot]]:
    """Placement groups (bundles, strategy) and every rank's slot in them (pure: no Ray).

    Returns:
        ``(groups, slots)``: ``groups[g] = (bundles, strategy)``; ``slots`` one per rank of
        every instance, in plan order.
    """
    c = plan.config.cluster
    res = c.resource

    def bundle(ranks: int) -> dict[str, float]:
        b: dict[str, float] = {res: float(ranks)} if res == "GPU" else {}
        cpus = c.cpus_per_rank * ranks
        if cpus or not b:
            b["CPU"] = float(cpus) if cpus else 0.001  # Ray rejects empty bundles
        return b

    groups: list[tuple[list[dict[str, float]], str]] = []
    slots: list[RankSlot] = []
    for role in ("prefill", "decode"):
        insts = plan.pool(role)
        if not insts:
            continue
        pool = plan.config.pools[role]
        if insts[0].nodes == 1:
            g = len(groups)
            groups.append(([bundle(i.ranks) for i in insts],
                           "PACK" if pool.placement == "pack" else "SPREAD"))
            for k, inst in enumerate(insts):
                slots += [RankSlot(inst.name, r, g, k) for r in range(inst.ranks)]
        else:
            for inst in insts:
                g = len(groups)
                groups.append(([bundle(inst.ranks_per_node)] * inst.nodes, "STRICT_SPREAD"))
                slots += [RankSlot(inst.name, r, g, r // inst.ranks_per_node)
                          for r in range(inst.ranks)]
    return groups, slots


# ============================================================================ the stack
@dataclass
class RayStack:
    """Handles of a running Ray deployment (from :func:`deploy`); ``stop()`` ends it."""

    url: str
    api_key: str | None
    cluster_token: str
    plan: Plan
    router: Any
    workers: dict[str, Any]  # instance name → rank-0 ProcessActor handle
    ranks: dict[str, list[Any]]  # instance name → all rank handles (rank 0 first)
    placement_groups: list[Any]
    sd: TargetWriter | None = None
    urls: dict[str, str] = field(default_factory=dict)

    def refresh(self, timeout: float = 60.0) -> dict[str, str]:
        """Read every worker's current URL (a restarted one has a new one) and rewrite the
        Prometheus targets; returns ``{instance: url}``."""
        import ray

        infos = ray.get([h.info.remote() for h in self.workers.values()], timeout=timeout)
        for name, inf in zip(self.workers, infos, strict=True):
            if inf["url"] and self.urls.get(name) != inf["url"]:  # "": a child restarting
                self.urls[name] = inf["url"]
                if self.sd is not None:
                    self.sd.set(ScrapeTarget(name, inf["url"], "worker", name.split("-")[0]))
        return dict(self.urls)

    def stop(self, timeout: float = 15.0, drain_s: float = 0.0) -> None:
        """Stop every child process, kill the actors (no restart), remove the placement
        groups and clear the Prometheus targets.

        The workers get SIGTERM first and ``drain_s + timeout`` seconds to drain the requests
        they hold and exit (then SIGKILL), while the router still relays their streams; the
        router is stopped after them, with ``timeout`` seconds."""
        import ray
        from ray.util.placement_group import remove_placement_group

        router = [self.router] if self.router is not None else []
        for handles, wait_s in ((list(self.workers.values()), drain_s + timeout),
                                (router, timeout)):
            try:
                ray.get([h.stop.remote(wait_s) for h in handles], timeout=wait_s + 10)
            except Exception as e:  # noqa: BLE001 - an actor may already be gone
                log.warning("stopping children: %r", e)
        for handles in [*self.ranks.values(), router]:
            for h in handles:
                ray.kill(h, no_restart=True)
        for pg in self.placement_groups:
            remove_placement_group(pg)
        if self.sd is not None:
            self.sd.clear()


def worker_drain_s(dc: DeployConfig) -> float:
    """The workers' drain timeout under ``dc``, seconds: their ``--drain-timeout`` as the
    workers' own parser reads ``worker_args`` (its default when not given)."""
    from worker.config import WorkerEnv, build_parser

    return build_parser("decode", WorkerEnv()).parse_known_args(list(dc.worker_args))[0].drain_timeout


def check_runnable(dc: DeployConfig, model: ModelConfig | None = None) -> None:
    """Refuse a pool shape the parallel engine cannot run, before anything starts: the
    engine's shape rules (``k3serve.parallel``) checked on the config alone.

    An instance of ``ep`` ranks runs ``dp = ep / tp`` attention groups of ``tp`` ranks
    (``k3serve.parallel.layout.attention_groups``): the heads (KDA, MLA), the dense MLP and the
    shared experts are split over the ``tp`` ranks of a group, the routed experts over all ``ep``.

    Args:
        dc: the deployment config.
        model: the model config (default: ``load_config(dc.model)``).

    Raises:
        ValueError: naming the field — ``pools.ROLE.ep`` not a multiple of ``tp`` or not
            dividing the routed experts; ``pools.ROLE.tp`` not dividing a head count, the dense
            MLP width or the shared experts' width.
    """
    from k3serve.config import load_config
    from k3serve.parallel.layout import attention_groups

    cfg = model or load_config(dc.model)
    for role, pool in dc.pools.items():
        where = f"pools.{role}"
        try:
            attention_groups(pool.tp, pool.ep)
        except ValueError as e:
            raise ValueError(f"{where}.{e}") from None
        if cfg.n_routed_experts and cfg.n_routed_experts % pool.ep:
            raise ValueError(f"{where}.ep: {pool.ep} ranks do not divide the "
                             f"{cfg.n_routed_experts} routed experts")
        widths = {"kda_num_heads": cfg.kda_num_heads,
                  "mla_num_heads": cfg.mla_num_heads if cfg.mla_layers else 0,
                  "dense_intermediate_size": cfg.dense_intermediate_size,
                  "shared experts' width": cfg.n_shared_experts * cfg.moe_intermediate_size}
        for what, n in widths.items():
            if n and n % pool.tp:
                raise ValueError(f"{where}.tp: {pool.tp} does not divide {what} = {n}")


def worker_argv(dc: DeployConfig, inst: InstancePlan, router_url: str) -> list[str]:
    """Rank 0's command (after ``python``): the role's worker; for ``ranks`` > 1 with the
    instance's ``--tp`` / ``--ep`` and ``--remote-ranks`` (the rank actors start the rest)."""
    par = ["--tp", str(inst.tp), "--ep", str(inst.ep), "--remote-ranks"] if inst.ranks > 1 else []
    return ["-m", f"{inst.role}.worker", "--host", "{host}", "--port", "0",
            "--model", dc.model, "--router-url", router_url, "--worker-id", inst.name,
            "--block-size", str(dc.block_size), "--num-pages", str(inst.num_pages),
            "--num-slots", str(inst.num_slots), "--num-snapshots", str(inst.num_snapshots),
            "--device", dc.device, "--dtype", dc.dtype, *par, *dc.worker_args]


def deploy(config: str | Path | DeployConfig, *, api_key: str | Sequence[str] | None = None,
           router_port: int | None = None, sd_dir: str | Path | None = None,
           placeholders: bool = False, ready_timeout: float = 300.0) -> RayStack:
    """Start a deployment on the Ray cluster this process is connected to (``ray.init`` first).

    The Ray workers must import this repository (``pip install -e .`` on every node, or
    ``ray.init(runtime_env={"env_vars": {"PYTHONPATH": ...}})``, as :func:`serve_ray` does when
    it joins a cluster); a local Ray started from this process inherits its ``PYTHONPATH``.

    Args:
        config: a ``deploy/configs/*.yaml`` path or a :class:`DeployConfig`.
        api_key: bearer token(s) the router requires on its public API.
        router_port: overrides ``router.port`` (0: a free port on the router's node).
        sd_dir: write Prometheus file-SD targets there (``deploy/prometheus/targets``).
        placeholders: place every rank as a :class:`RankActor` and start no programs (a
            placement check of a config whose model cannot run here, e.g. K3 on CPUs).
        ready_timeout: seconds to wait for the placement groups and for each program.

    Returns:
        A :class:`RayStack`.

    Raises:
        deploy.plan.PlanError: the config does not fit (before anything starts).
        ValueError: a pool shape the engine cannot run (:func:`check_runnable`).
        TimeoutError: the cluster cannot hold the placement groups within ``ready_timeout``.
    """
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    dc = config if isinstance(config, DeployConfig) else load_deploy_config(config)
    if not placeholders:
        check_runnable(dc)
    plan = make_plan(dc)
    groups, slots = placement_layout(plan)
    pgs = [placement_group(b, strategy=s, name=f"k3serve-{dc.name}-{i}")
           for i, (b, s) in enumerate(groups)]
    ready, _ = ray.wait([pg.ready() for pg in pgs], num_returns=len(pgs), timeout=ready_timeout)
    if len(ready) < len(pgs):
        for pg in pgs:
            remove_placement_group(pg)
        raise TimeoutError(f"the cluster cannot hold the placement groups of {dc.name} within "
                           f"{ready_timeout:.0f} s ({len(ready)} of {len(pgs)} placed)")
    c = dc.cluster
    token = secrets.token_hex(16)
    env = {CLUSTER_TOKEN_ENV: token, "PYTHONPATH": os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
    rank_opts = {"num_cpus": c.cpus_per_rank, "num_gpus": 1 if c.resource == "GPU" else 0}
    Proc = ray.remote(ProcessActor)
    Rank = ray.remote(RankActor)
    keys = api_keys_env(api_key)
    stack = RayStack(url="", api_key=keys.split()[0] if keys else None, cluster_token=token,
                     plan=plan, router=None,
                     workers={}, ranks={}, placement_groups=pgs)
    try:
        router_url = ""
        if not placeholders:
            rport = dc.router.port if router_port is None else router_port
            rargs = ["-m", "router", "--host", dc.router.host,
                     "--port", str(rport) if rport else "{port}", "--policy", dc.router.policy,
                     "--model", dc.model, "--replicas", str(dc.router.replicas)]
            renv = {**env, **({API_KEY_ENV: keys} if keys else {})}
            stack.router = Proc.options(
                name=f"k3serve-{dc.name}-router", num_cpus=0, max_restarts=dc.max_restarts,
            ).remote("router", rargs, renv, ready="health", ready_timeout=ready_timeout)
            rinfo = ray.get(stack.router.info.remote(), timeout=ready_timeout)
            router_url = rinfo["url"]
            if dc.router.host not in ("0.0.0.0", "127.0.0.1") and rport:
                router_url = f"http://{dc.router.host}:{rport}"
            stack.url = router_url
            if sd_dir is not None:
                stack.sd = TargetWriter(sd_dir, dc.name)
                stack.sd.set(ScrapeTarget("router", router_url, "router"))
        by_name = {i.name: i for i in plan.instances}
        for name, inst in by_name.items():  # ranks 1.. first: rank 0's actor starts them
            mine = [s for s in slots if s.instance == name]
            opts = [dict(rank_opts, scheduling_strategy=PlacementGroupSchedulingStrategy(
                pgs[s.group], placement_group_bundle_index=s.bundle)) for s in mine]
            peers = [Rank.options(max_restarts=dc.max_restarts, **o).remote(name, s.rank, env)
                     for s, o in zip(mine, opts, strict=True) if s.rank > 0 or placeholders]
            if not placeholders:
                h = Proc.options(name=f"k3serve-{dc.name}-{name}",
                                 max_restarts=dc.max_restarts, **opts[0]).remote(
                    name, worker_argv(dc, inst, router_url), env,
                    ready_timeout=ready_timeout, peers=peers)
                stack.workers[name] = h
                peers = [h, *peers]
            stack.ranks[name] = peers
        if not placeholders:
            stack.refresh(timeout=ready_timeout)
            _warn_public(stack.urls.values())
            _wait_registered(stack, ready_timeout)
    except BaseException:
        stack.stop()
        raise
    return stack


def _warn_public(urls: Any) -> None:
    """Warn (log + stderr) for each worker host that is not private or loopback."""
    from urllib.parse import urlsplit

    from deploy.launcher import address_warning

    for h in sorted({urlsplit(u).hostname or "" for u in urls}):
        msg = address_warning(h, "worker")
        if msg:
            log.warning(msg)
            print(f"k3serve: warning: {msg}", file=sys.stderr, flush=True)


def _wait_registered(stack: RayStack, timeout: float) -> None:
    """Until the router lists every worker's current URL as healthy."""
    import httpx

    deadline = time.monotonic() + timeout
    last = ""
    auth = {"Authorization": f"Bearer {stack.api_key}"} if stack.api_key else None
    with httpx.Client(timeout=2.0, trust_env=False, headers=auth) as client:  # one TLS context
        while time.monotonic() < deadline:
            try:
                body = client.get(f"{stack.url}/health", params={"detail": 1}).json()
                healthy = {w["url"] for w in body.get("workers", ()) if w.get("healthy")}
                if set(stack.urls.values()) <= healthy:
                    return
                last = str(body)
            except (httpx.HTTPError, ValueError) as e:
                last = repr(e)
            time.sleep(0.3)
    raise RuntimeError(f"workers not registered after {timeout:.0f} s (last health: {last})")


def init_local_ray(num_cpus: float, num_gpus: int = 0, temp_dir: str | None = None) -> None:
    """Start a one-node Ray on loopback: small object store, no dashboard, logical CPUs.

    Always a new Ray (``address="local"``), never one that already runs on the machine;
    ``temp_dir`` (absolute, short: Ray's socket paths) replaces ``/tmp/ray``.

    Its processes inherit this process' environment, ``PYTHONPATH`` with this repository
    included, so actors import :mod:`deploy.ray_backend` and children run ``python -m …``.
    """
    os.environ[LOOPBACK_ENV] = "0"  # read when ray is first imported: see the check below
    path = os.environ.get("PYTHONPATH", "")
    if str(ROOT) not in path.split(os.pathsep):
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), path) if p)
    import ray

    ray.init(address="local", num_cpus=num_cpus, num_gpus=num_gpus, include_dashboard=False,
             object_store_memory=OBJECT_STORE_BYTES, _node_ip_address="127.0.0.1",
             _temp_dir=temp_dir, log_to_driver=False)
    addrs = {n["NodeManagerAddress"] for n in ray.nodes()}
    if addrs != {"127.0.0.1"}:
        ray.shutdown()
        raise RuntimeError(f"Ray bound to {sorted(addrs)}, not loopback: ray was imported before "
                           f"{LOOPBACK_ENV}=0 was set (set it first, or import ray later)")


def serve_ray(args: Any) -> int:
    """Entry point of ``k3serve serve --ray --config FILE``: run until Ctrl-C / SIGTERM."""
    if args.ray_address is None:
        os.environ[LOOPBACK_ENV] = "0"  # before ray's first import (see init_local_ray)
    import ray

    dc = load_deploy_config(args.config)
    if args.port != 8000 or args.host != "127.0.0.1":  # explicit flags override the config
        dc = replace(dc, router=replace(dc.router, host=args.host, port=args.port))
    plan = make_plan(dc)
    print(plan.format(), flush=True)
    started = args.ray_address is None
    if started:
        c = dc.cluster
        init_local_ray(num_cpus=max(1.0, c.cpus_per_rank * c.accelerators_per_node),
                       num_gpus=c.accelerators_per_node if c.resource == "GPU" else 0)
    else:
        ray.init(address=args.ray_address, runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
    api_key = args.api_key or api_keys_from_env(os.environ.get(API_KEY_ENV))
    stack = deploy(dc, api_key=api_key, sd_dir=args.sd_dir)
    stopping = ""  # the name of the signal that stops the stack

    def _stop(signum, frame):
        nonlocal stopping
        stopping = stopping or signal.Signals(signum).name

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    n = {r: len(plan.pool(r)) for r in ("prefill", "decode")}
    print(f"k3serve: serving {dc.model} at {stack.url}/v1 on Ray ({n['prefill']} prefill + "
          f"{n['decode']} decode instances; Ctrl-C stops)", flush=True)
    try:
        while not stopping:
            try:
                stack.refresh(timeout=5.0)  # a restarted worker: new URL → new SD target
            except Exception as e:  # noqa: BLE001 - an actor restarting: try again
                log.info("refresh: %r", e)
            time.sleep(2.0)
    finally:
        if stopping:
            print(f"k3serve: {stopping}: stopping; the workers drain their requests first",
                  flush=True)
        stack.stop(drain_s=worker_drain_s(dc))
        if started:
            ray.shutdown()
    print("k3serve: stopped", flush=True)
    return 0


__all__ = ["ProcessActor", "RankActor", "RankSlot", "RayStack", "check_runnable", "deploy",
           "init_local_ray",
           "placement_layout", "serve_ray"]
