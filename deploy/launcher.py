"""``k3serve serve``: start the router and the prefill/decode workers, one launcher for every
backend.

A backend (:class:`LaunchBackend`) starts one component — ``python -m router``,
``python -m prefill.worker``, ``python -m decode.worker`` with their flags and environment — and
hands back something to poll and stop. :mod:`deploy.local` runs them as child processes of
this one (the only backend today; Ray actors are the next one, behind the same interface).

The launcher generates a cluster token that every internal call carries (passed in the
environment, as is the API key, so neither shows in ``ps``), waits until the router reports
every worker healthy, prints the URL, and stops every component on Ctrl-C / SIGTERM. A
component that crashes is restarted (:mod:`deploy.supervisor`: backoff, a restart limit, a
worker on fresh ports); the stack stops only when the router cannot be restarted. A router
port that is taken ends with one line, before anything starts. A worker address that is not
private or loopback is warned about (:func:`address_warning`; README "Deployment security").
"""

from __future__ import annotations

import argparse
import errno
import importlib
import ipaddress
import os
import secrets
import signal
import socket
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

import httpx
from pydantic import ValidationError

from deploy.supervisor import Spec, Supervisor
from k3serve.messages import RouterHealth
from k3serve.protocol import API_KEY_ENV, CLUSTER_TOKEN_ENV


class Component(Protocol):
    """A launched component (a :class:`subprocess.Popen` for the local backend)."""

    def poll(self) -> int | None: ...
    def terminate(self) -> None: ...
    def kill(self) -> None: ...
    def wait(self, timeout: float | None = None) -> int: ...


class LaunchBackend(Protocol):
    """Where components run.

    Attributes:
        name: the backend's name (``--backend``).
        internal_host: the host workers listen on and the router calls them at.
    """

    name: str
    internal_host: str

    def free_port(self, host: str) -> int:
        """A port a component on ``host`` may listen on."""
        ...

    def spawn(self, name: str, module: str, args: list[str], env: Mapping[str, str]) -> Component:
        """Start ``python -m {module} {args}`` named ``name`` with environment ``env``."""
        ...


#: Backends by name, imported when chosen (``"module:Class"``).
BACKENDS: dict[str, str] = {"local": "deploy.local:LocalBackend"}


def backend(name: str, **kwargs: object) -> LaunchBackend:
    """The backend called ``name``, built with ``kwargs``.

    Raises:
        ValueError: unknown backend name.
    """
    if name not in BACKENDS:
        raise ValueError(f"backend: {name!r} is not one of {sorted(BACKENDS)}")
    mod, cls = BACKENDS[name].split(":")
    return getattr(importlib.import_module(mod), cls)(**kwargs)


class PortInUseError(RuntimeError):
    """The router's port is taken (the message names host and port)."""


class StartupError(RuntimeError):
    """A component exited during startup, or the stack was not ready in time."""


def check_port_free(host: str, port: int) -> None:
    """Raise :class:`PortInUseError` when ``host:port`` cannot be bound now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            why = "is already in use" if e.errno == errno.EADDRINUSE else f"cannot be bound ({e})"
            raise PortInUseError(f"port {port} on {host} {why}; choose another with --port") \
                from None


@dataclass
class Stack:
    """Handles of a running stack (used by ``serve`` and by tests). ``procs``: the router
    first, then the store's master (``store=True``), the prefill workers, the decode workers."""

    url: str
    api_key: str | None
    cluster_token: str
    procs: list[Component] = field(default_factory=list)
    worker_urls: list[str] = field(default_factory=list)
    specs: list[Spec] = field(default_factory=list)  # specs[i] restarts procs[i]
    supervisor: Supervisor | None = None
    stopping: bool = False

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the supervisor, terminate every component (workers drain first: SIGTERM),
        then kill what is left after ``timeout`` seconds."""
        self.stopping = True
        if self.supervisor is not None:
            self.supervisor.stop()
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        deadline = time.monotonic() + timeout
        for p in self.procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except Exception:  # noqa: BLE001 - subprocess.TimeoutExpired or a backend's own
                p.kill()
                p.wait()
        if self.supervisor is not None:
            self.supervisor.close()


def start_stack(
    model: str = "k3-tiny",
    host: str = "127.0.0.1",
    port: int = 0,
    num_prefill: int = 2,
    num_decode: int = 1,
    api_key: str | None = None,
    policy: str = "prefix_home",
    block_size: int = 64,
    device: str = "cpu",
    extra_worker_args: list[str] | None = None,
    extra_router_args: list[str] | None = None,
    ready_timeout: float = 180.0,
    log_dir: str | None = None,
    launch: LaunchBackend | None = None,
    sd_dir: str | None = None,
    store: bool = False,
    monolithic: int = 0,
    supervise: bool = False,
    max_restarts: int = 5,
    routers: int = 1,
) -> Stack:
    """Start router + workers and wait until the router sees every worker healthy.

    Args:
        model: preset name or checkpoint folder.
        port: router port; 0 picks a free one.
        ready_timeout: seconds to wait for all workers to register.
        log_dir: per-component log files (local backend; ``launch`` given: ignored).
        launch: the backend (default: local processes).
        sd_dir: write Prometheus file-based service discovery for the router and every worker
            here (deploy/service_discovery.py; the same files the Ray backend writes).
        store: also start a ``mooncake_master`` on loopback (the shared store below the
            workers; :func:`deploy.local.start_store_master`) and make every worker a client.
        monolithic: > 0: start this many workers that each prefill AND decode (no prefill
            pool, no transfers; ``num_prefill`` / ``num_decode`` are ignored) — the router
            serves a stack without prefill workers through ``/internal/generate``.
        supervise: restart crashed components (:class:`deploy.supervisor.Supervisor`,
            ``stack.supervisor``), at most ``max_restarts`` times each.
        routers: router processes behind the one router address (``--replicas``,
            router/replicas.py); workers register with any of them.

    Returns:
        A :class:`Stack`; call ``stop()`` to end it.

    Raises:
        ValueError: ``num_prefill``, ``num_decode`` or ``routers`` < 1, or ``monolithic`` < 0.
        PortInUseError: the router port is taken.
        StartupError: a component exited or the stack was not ready within ``ready_timeout``.
    """
    if monolithic < 0:
        raise ValueError("monolithic: must be >= 0")
    if monolithic:
        num_prefill, num_decode = 0, monolithic
    elif num_prefill < 1:
        raise ValueError("num_prefill: must be >= 1")
    if num_decode < 1:
        raise ValueError("num_decode: must be >= 1")
    if routers < 1:
        raise ValueError("routers: must be >= 1")
    launch = launch if launch is not None else backend("local", log_dir=log_dir)
    if port:
        check_port_free(host, port)
    port = port or launch.free_port(host)
    token = secrets.token_hex(16)
    env = dict(os.environ)
    env[CLUSTER_TOKEN_ENV] = token
    env.setdefault("PYTHONUNBUFFERED", "1")
    if api_key:  # through the environment, so it does not show in `ps`
        env[API_KEY_ENV] = api_key
    stack = Stack(url=f"http://{'127.0.0.1' if host == '0.0.0.0' else host}:{port}",
                  api_key=api_key, cluster_token=token)
    def spawn(spec: Spec) -> None:
        stack.procs.append(launch.spawn(spec.name, spec.module, spec.args, spec.env))
        stack.specs.append(spec)

    try:
        spawn(Spec("router", "router", [
            "--host", host, "--port", str(port), "--policy", policy, "--model", model,
            *(["--replicas", str(routers)] if routers > 1 else []),
            *(extra_router_args or [])], env, "router"))
        extra_worker_args = [*(extra_worker_args or []), *_store_args(stack, store, log_dir)]
        workers = [("prefill", i) for i in range(num_prefill)] + [
            ("decode", i) for i in range(num_decode)]
        ihost = launch.internal_host
        for warning in filter(None, [address_warning(ihost, "worker"),
                                     address_warning(env.get("K3SERVE_KV_HOSTNAME", ihost),
                                                     "Mooncake transfer engine")]):
            print(f"k3serve: warning: {warning}", file=sys.stderr, flush=True)
        for role, i in workers:
            wport = launch.free_port(ihost)
            stack.worker_urls.append(f"http://{ihost}:{wport}")
            name = f"mono-{i}" if monolithic else f"{role}-{i}"
            spawn(Spec(name, f"{role}.worker", [
                "--host", ihost, "--port", str(wport), "--model", model,
                "--router-url", f"http://127.0.0.1:{port}", "--block-size", str(block_size),
                "--device", device, "--worker-id", name, *(extra_worker_args or [])],
                env, "worker", url_index=len(stack.worker_urls) - 1))
        wait_ready(stack, num_prefill + num_decode, ready_timeout, launch=launch)
        if supervise:
            stack.supervisor = Supervisor(stack, launch, max_restarts=max_restarts).start()
        if sd_dir:
            from deploy.service_discovery import ScrapeTarget, TargetWriter

            TargetWriter(sd_dir, "local").replace_all(
                [ScrapeTarget("router", stack.url, "router")]
                + [ScrapeTarget(f"mono-{i}" if monolithic else f"{r}-{i}", u, "worker", r)
                   for (r, i), u in zip(workers, stack.worker_urls)])
    except BaseException:
        stack.stop()
        raise
    return stack


def _store_args(stack: Stack, store: bool, log_dir: str | None) -> list[str]:
    """Start the store's master (appended to ``stack.procs``, so ``stop`` ends it after the
    workers) and return the workers' ``--store-url`` flag; ``[]`` without a store."""
    if not store:
        return []
    from deploy.local import start_store_master

    log = os.path.join(log_dir, "mooncake_master.log") if log_dir else None
    if log_dir:
        os.makedirs(log_dir, exist_ok=True)
    proc, url = start_store_master(log_path=log)
    stack.procs.append(proc)
    stack.specs.append(Spec("mooncake_master", "", [], {}, "store"))
    return ["--store-url", url]


def address_warning(host: str, what: str) -> str | None:
    """A warning when ``host`` (an IP or a name) is not a loopback or private address: the
    internal endpoints there take the cluster token, but Mooncake's transfer engine listens on
    all interfaces without one and lets any peer read and write registered cache memory
    (README "Deployment security"). ``None``: loopback / private (RFC 1918, ULA, link-local).
    """
    h = host.strip("[]")
    if h in ("localhost", ""):
        return None
    try:
        ip = ipaddress.ip_address(h)
    except ValueError:
        try:
            ip = ipaddress.ip_address(socket.gethostbyname(h))
        except (OSError, ValueError):
            return f"{what} address {host!r} does not resolve; cannot check that it is private"
    if ip.is_unspecified:  # before is_private: 0.0.0.0 counts as private in ipaddress
        return (f"{what} listens on {host} (every interface): keep the cluster network "
                f"isolated; see README 'Deployment security'")
    if ip.is_loopback or ip.is_private or ip.is_link_local:
        return None
    return (f"{what} address {host} is not private or loopback: peers that reach it can call "
            f"Mooncake's transfer engine without a token (read/write cache memory); isolate "
            f"the cluster network (README 'Deployment security')")


#: times :func:`wait_ready` starts a worker again on a fresh port when its port was taken
#: between the launcher picking it and the worker binding it (another process's connection)
PORT_RETRIES = 3


def wait_ready(stack: Stack, num_workers: int, timeout: float, poll_s: float = 0.3,
               launch: LaunchBackend | None = None) -> None:
    """Poll the router's ``/health?detail=1`` until ``num_workers`` are healthy.

    A worker that exits with :data:`worker.serve.EXIT_PORT_IN_USE` (the port picked for it was
    taken before it could bind it) is started again on a fresh port, at most
    :data:`PORT_RETRIES` times (``launch`` given).

    Raises:
        StartupError: a component exited (the message names it, its exit status and the end
            of its log when the backend keeps one), or ``timeout`` seconds passed.
    """
    from worker.serve import EXIT_PORT_IN_USE

    deadline = time.monotonic() + timeout
    last = ""
    port_retries: dict[int, int] = {}
    while time.monotonic() < deadline:
        for i, p in enumerate(stack.procs):
            rc = p.poll()
            if rc is None:
                continue
            spec = stack.specs[i] if i < len(stack.specs) else None
            if (spec is not None and spec.kind == "worker" and rc == EXIT_PORT_IN_USE
                    and launch is not None and port_retries.get(i, 0) < PORT_RETRIES):
                port_retries[i] = port_retries.get(i, 0) + 1
                _respawn_on_fresh_port(stack, launch, i)
                continue
            name = spec.name if spec is not None else f"component {i}"
            raise StartupError(f"a k3serve process exited during startup: {name} (code {rc})"
                               f"{_log_tail(launch, name)}")
        try:
            r = httpx.get(f"{stack.url}/health", params={"detail": 1}, timeout=2.0)
            if r.status_code == 200:
                health = RouterHealth.model_validate_json(r.content)
                if health.num_workers_healthy >= num_workers:
                    return
                last = r.text[:500]
        except (httpx.HTTPError, ValidationError) as e:
            last = repr(e)[:500]
        time.sleep(poll_s)
    raise StartupError(f"stack not ready after {timeout:.0f} s (last health: {last})")


def _respawn_on_fresh_port(stack: Stack, launch: LaunchBackend, i: int) -> None:
    """Start worker ``i`` again with a new ``--port`` (``stack.worker_urls`` follows)."""
    from deploy.supervisor import move_to_fresh_port

    spec = stack.specs[i]
    url = move_to_fresh_port(spec, launch)
    print(f"k3serve: {spec.name}: its port was taken before it bound it; starting it on {url}",
          file=sys.stderr, flush=True)
    stack.procs[i] = launch.spawn(spec.name, spec.module, spec.args, spec.env)
    stack.worker_urls[spec.url_index] = url
    spec.events.append(f"port taken at startup: {url}")


def _log_tail(launch: LaunchBackend | None, name: str, n_chars: int = 2000) -> str:
    """The last ``n_chars`` of component ``name``'s log file (the local backend with a
    ``log_dir``), as ``"; the end of its log (PATH):\n..."``; ``""`` when there is none."""
    log_dir = getattr(launch, "log_dir", None)
    if not log_dir:
        return ""
    try:
        with open(os.path.join(log_dir, f"{name}.log"), errors="replace") as f:
            text = f.read()[-n_chars:]
    except OSError:
        return ""
    return f"; the end of its log ({os.path.join(log_dir, name + '.log')}):\n{text}"


def build_parser(prog: str = "k3serve serve") -> argparse.ArgumentParser:
    """The flags of ``k3serve serve`` (= ``python -m deploy``)."""
    p = argparse.ArgumentParser(prog=prog, formatter_class=argparse.ArgumentDefaultsHelpFormatter,
                                description="start router + prefill and decode workers")
    p.add_argument("--model", default="k3-tiny", help="preset name or checkpoint folder")
    p.add_argument("--host", default="127.0.0.1", help="router bind address")
    p.add_argument("--port", type=int, default=8000, help="router port")
    p.add_argument("--prefill", type=int, default=2, help="number of prefill workers")
    p.add_argument("--decode", type=int, default=1, help="number of decode workers")
    p.add_argument("--monolithic", type=int, default=0, metavar="N",
                   help="N > 0: N workers that each prefill and decode (no disaggregation; "
                        "--prefill / --decode ignored)")
    p.add_argument("--routers", type=int, default=1, metavar="N",
                   help="router processes behind the one address (each keeps its own index "
                        "from the workers' events; router/replicas.py)")
    p.add_argument("--api-key", default=None,
                   help="bearer token required on the public API (or set K3SERVE_API_KEY)")
    p.add_argument("--policy", default="prefix_home",
                   help="placement policy: prefix_home | cache_aware | approx_radix | "
                        "round_robin | least_load | random")
    p.add_argument("--block-size", type=int, default=64, help="tokens per cache block")
    p.add_argument("--device", default="cpu", help="worker device (cpu or cuda)")
    p.add_argument("--ray", action="store_true",
                   help="run every instance as a Ray actor (needs --config; `pip install -e .[ray]`)")
    p.add_argument("--config", default=None,
                   help="deployment config for --ray (deploy/configs/*.yaml); its model, pools "
                        "and router replace --model/--prefill/--decode/--policy")
    p.add_argument("--ray-address", default=None,
                   help="join this Ray cluster (default: start a local one on loopback)")
    p.add_argument("--sd-dir", default=None,
                   help="write Prometheus file-SD targets here (see deploy/prometheus)")
    p.add_argument("--max-restarts", type=int, default=5,
                   help="restarts allowed per crashed component (exponential backoff between "
                        "failed starts); 0: none")
    p.add_argument("--store", action="store_true",
                   help="start a mooncake_master on loopback: a shared DRAM store below the "
                        "workers (prefixes cross workers; turn 2 hits after PD)")
    _add_passthrough(p)
    return p


#: Flags of ``router`` / ``{prefill,decode}.worker`` the launcher sets itself.
_LAUNCHER_OWNS = {"help", "host", "port", "model", "policy", "api_key", "replicas",
                  "replica_index", "fd", "advertise_host", "router_url", "worker_id",
                  "block_size", "device", "store_url"}


def _component_parsers() -> dict[str, argparse.ArgumentParser]:
    from router.config import build_parser as router_parser
    from worker.config import WorkerEnv, _parser

    return {"router": router_parser(), "worker": _parser("prefill", WorkerEnv())}


#: Flags the router and the workers both have that mean the same there: one flag, both get it.
_BOTH = {"log_level"}


def _passthrough_specs() -> list[tuple[str, argparse.Action, str, list[str]]]:
    """(component, its action, dest in ``k3serve serve``, the flags there) for every router
    and worker flag the launcher does not set. A worker flag whose name the router has too
    with another meaning (``--max-queued``: the router's admission queue vs a worker's
    own) is ``--worker-NAME`` in ``k3serve serve``; those in ``_BOTH`` are one flag."""
    out, taken = [], set()
    for name, parser in _component_parsers().items():
        for a in parser._actions:
            if a.dest in _LAUNCHER_OWNS or a.help == argparse.SUPPRESS:
                continue
            dest, flags = a.dest, list(a.option_strings)
            if isinstance(a, argparse.BooleanOptionalAction):
                flags = flags[:1]  # argparse adds the --no- form itself
            if dest in taken and dest not in _BOTH:
                dest, flags = f"worker_{dest}", ["--worker-" + flags[0][2:]]
            out.append((name, a, dest, flags))
            taken.add(a.dest)
    return out


def _add_passthrough(p: argparse.ArgumentParser) -> None:
    """Add the router's and the workers' own flags (those the launcher does not set) to
    ``p``, in two groups, defaulting to "not given" so only what the user typed is passed on
    (:func:`_passthrough_specs` names them)."""
    groups = {name: p.add_argument_group(
        f"{name} flags", "passed to the router process(es)" if name == "router" else
        "passed to every prefill and decode worker (python -m prefill.worker --help); a name "
        "the router has too is --worker-NAME here") for name in ("router", "worker")}
    added: set[str] = set()
    for name, a, dest, flags in _passthrough_specs():
        if dest in added:  # a flag of _BOTH: added with the router's
            continue
        added.add(dest)
        shown = "" if a.default in (None, False) or "default" in (a.help or "") else (
            f"(default: {a.default})")
        kwargs: dict = dict(dest=dest, default=argparse.SUPPRESS, metavar=a.metavar,
                            help=" ".join(filter(None, [a.help, shown])) or None)
        if isinstance(a, argparse.BooleanOptionalAction):
            kwargs["action"] = argparse.BooleanOptionalAction
        elif a.nargs == 0:  # store_true
            kwargs["action"] = "store_true"
            kwargs.pop("metavar")
        else:
            kwargs.update(type=a.type, choices=a.choices)
        groups[name].add_argument(*flags, **kwargs)


def passthrough_args(args: argparse.Namespace) -> dict[str, list[str]]:
    """The flags of ``args`` that belong to the router / the workers, as the argv lists of
    those processes (``{"router": [...], "worker": [...]}``); empty lists when none given."""
    out: dict[str, list[str]] = {"router": [], "worker": []}
    for name, a, dest, _flags in _passthrough_specs():
        if not hasattr(args, dest):
            continue
        value, flag = getattr(args, dest), a.option_strings[0]
        if isinstance(a, argparse.BooleanOptionalAction):
            out[name].append(flag if value else "--no-" + flag[2:])
        elif a.nargs == 0:
            out[name] += [flag] if value else []
        else:
            out[name] += [flag, str(value)]
    return out


def serve(args: argparse.Namespace) -> int:
    """Run the stack of ``args`` (:func:`build_parser`) until Ctrl-C / SIGTERM, restarting
    crashed components (exit status 1 when the router cannot be restarted); returns the exit
    status. ``--ray`` runs it on the Ray backend (deploy/ray_backend.py).

    Raises:
        ValueError: ``--ray`` without ``--config``, or ``--config`` without ``--ray``.
    """
    extra = passthrough_args(args)
    if args.ray:
        if extra["router"] or extra["worker"]:
            given = " ".join(x for x in extra["router"] + extra["worker"] if x.startswith("--"))
            raise ValueError(f"{given}: with --ray the router and worker settings come from "
                             "--config (deploy/configs/*.yaml)")
        if not args.config:
            raise ValueError("--config: `serve --ray` needs a deployment config "
                             "(deploy/configs/*.yaml)")
        from deploy.ray_backend import serve_ray

        return serve_ray(args)
    if args.config:
        raise ValueError("--config: only used with --ray (the local backend takes flags)")
    stack = start_stack(
        model=args.model, host=args.host, port=args.port, num_prefill=args.prefill,
        num_decode=args.decode, api_key=args.api_key, policy=args.policy,
        block_size=args.block_size, device=args.device, sd_dir=args.sd_dir,
        store=args.store, monolithic=args.monolithic, supervise=True,
        max_restarts=args.max_restarts, routers=args.routers,
        extra_router_args=extra["router"], extra_worker_args=extra["worker"],
    )
    stopping = False

    def _stop(signum, frame):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    shape = (f"{args.monolithic} monolithic workers" if args.monolithic
             else f"{args.prefill} prefill + {args.decode} decode workers")
    if args.routers > 1:
        shape += f", {args.routers} router replicas"
    print(f"k3serve: serving {args.model} at {stack.url}/v1  ({shape}; Ctrl-C stops)",
          flush=True)
    try:
        while not stopping:
            sup = stack.supervisor
            if sup is not None and sup.fatal:
                print(f"k3serve: {sup.fatal}; stopping the stack", file=sys.stderr, flush=True)
                stack.stop()
                return 1
            time.sleep(0.5)
    finally:
        stack.stop()
    print("k3serve: stopped", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m deploy [flags]`` / ``k3serve serve [flags]``: a taken port, a component that
    exits during startup or a bad flag value end with one line on stderr (exit status 1, 2)."""
    args = build_parser().parse_args(argv)
    try:
        return serve(args)
    except (PortInUseError, StartupError) as e:
        print(f"k3serve serve: error: {e}", file=sys.stderr, flush=True)
        return 1
    except ValueError as e:
        print(f"k3serve serve: error: {e}", file=sys.stderr, flush=True)
        return 2


__all__ = ["BACKENDS", "Component", "LaunchBackend", "PortInUseError", "Stack", "StartupError",
           "address_warning", "backend", "build_parser", "check_port_free", "main", "passthrough_args",
           "serve", "start_stack",
           "wait_ready"]
