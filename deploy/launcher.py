"""Starting a k3serve stack: the router and the prefill/decode workers, one launcher for every
backend (:func:`start_stack`; the ``k3serve serve`` command around it is ``deploy/serve.py``).

A backend (:class:`LaunchBackend`) starts one component — ``python -m router``,
``python -m prefill.worker``, ``python -m decode.worker`` with their flags and environment — and
hands back something to poll and stop. :mod:`deploy.local` runs them as child processes of
this one; ``deploy/ray_backend.py`` runs instances as Ray actors from a deployment config.

The launcher generates a cluster token that every internal call carries (passed in the
environment, as is the API key, so neither shows in ``ps``), waits until the router reports
every worker healthy and stops every component on :meth:`Stack.stop`. A component that
crashes is restarted (:mod:`deploy.supervisor`: backoff, a restart limit, a worker on fresh
ports). A router port that is taken ends with :class:`PortInUseError`, before anything
starts. A worker address that is not private or loopback is warned about
(:func:`address_warning`; README "Deployment security").
"""

from __future__ import annotations

import errno
import functools
import importlib
import ipaddress
import os
import secrets
import socket
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import httpx
from pydantic import ValidationError

from deploy.supervisor import Spec, Supervisor
from k3serve.messages import RouterHealth
from k3serve.process import TITLE_ROLE_ENV
from k3serve.protocol import API_KEY_ENV, CLUSTER_TOKEN_ENV, api_keys_env


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


class StartupCancelled(Exception):
    """The start was called off (``cancelled()`` turned true: a stop signal)."""


def check_port_free(host: str, port: int) -> None:
    """Raise :class:`PortInUseError` when ``host:port`` cannot be bound now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                msg = f"port {port} on {host} is already in use; choose another with --port"
            else:
                msg = f"{host}:{port} cannot be bound ({e}); check --host and --port"
            raise PortInUseError(msg) from None


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
    signalled: set[int] = field(default_factory=set)  # indices :meth:`stop` sent SIGTERM

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the stack: no restart from here on, one SIGTERM to the router(s) and every
        worker (a worker drains its requests, the router finishes its open streams; a
        component that already received the signal, sent to the whole process group, ignores
        the repeat); whatever is left after ``timeout`` seconds is killed. Once they have
        exited, the store's master is killed: the launcher starts it without snapshots or an
        operation log (deploy/local.py), so it holds nothing that outlives the stack, and its
        own SIGTERM path takes about 1 s. Idempotent: a second call sends no second SIGTERM."""
        self.stopping = True
        if self.supervisor is not None:
            self.supervisor.stop()
        last = [i for i, s in enumerate(self.specs) if s.kind == "store"]
        first = [i for i in range(len(self.procs)) if i not in last]
        deadline = time.monotonic() + timeout
        for i in first:
            if i not in self.signalled and self.procs[i].poll() is None:
                self.signalled.add(i)
                self.procs[i].terminate()
        for i in first:
            p = self.procs[i]
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except Exception:  # noqa: BLE001 - subprocess.TimeoutExpired or a backend's own
                p.kill()
                p.wait()
        for i in last:
            self.signalled.add(i)
            if self.procs[i].poll() is None:
                self.procs[i].kill()
            self.procs[i].wait()
        if self.supervisor is not None:
            self.supervisor.close()

    def kill(self) -> None:
        """SIGKILL every component still running (a second Ctrl-C: stop without draining)."""
        self.stopping = True
        for p in self.procs:
            if p.poll() is None:
                p.kill()


def start_stack(
    model: str = "k3-tiny",
    host: str = "127.0.0.1",
    port: int = 0,
    num_prefill: int = 2,
    num_decode: int = 1,
    api_key: str | Sequence[str] | None = None,
    policy: str = "prefix_home",
    block_size: int = 64,
    device: str | None = "cpu",
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
    cancelled: Callable[[], bool] | None = None,
) -> Stack:
    """Start router + workers and wait until the router sees every worker healthy.

    Args:
        model: preset name or checkpoint folder.
        port: router port; 0 picks a free one.
        device: the workers' ``--device`` (``None``: each worker picks CUDA when present);
            off the CPU the workers split the card (``--workers-per-gpu``, worker/device.py).
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
        cancelled: polled while waiting for the workers; once it returns True the start
            stops what it started and raises :class:`StartupCancelled`.

    Returns:
        A :class:`Stack`; call ``stop()`` to end it.

    Raises:
        ValueError: ``num_prefill``, ``num_decode`` or ``routers`` < 1, or ``monolithic`` < 0.
        PortInUseError: the router port is taken.
        StartupError: a component exited or the stack was not ready within ``ready_timeout``.
        StartupCancelled: ``cancelled()`` turned true before the stack was ready.
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
    keys = api_keys_env(api_key)  # through the environment, so they do not show in `ps`
    env = {**os.environ, CLUSTER_TOKEN_ENV: token, **({API_KEY_ENV: keys} if keys else {})}
    env.setdefault("PYTHONUNBUFFERED", "1")
    stack = Stack(url=f"http://{'127.0.0.1' if host == '0.0.0.0' else host}:{port}",
                  api_key=keys.split()[0] if keys else None, cluster_token=token)
    def spawn(spec: Spec, first: bool = False) -> None:
        add_component(stack, launch.spawn(spec.name, spec.module, spec.args, spec.env), spec, first)

    try:
        store_args = _store_args(stack, store, log_dir)  # the router shows it on /health
        spawn(Spec("router", "router", [
            "--host", host, "--port", str(port), "--policy", policy, "--model", model,
            *(["--replicas", str(routers)] if routers > 1 else []), *store_args,
            *(extra_router_args or [])], env, "router"), first=True)
        extra_worker_args = [*(extra_worker_args or []), *store_args]
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
                *gpu_args(device, len(workers)), "--worker-id", name,
                *(extra_worker_args or [])],
                {**env, TITLE_ROLE_ENV: "monolithic"} if monolithic else env, "worker",
                url_index=len(stack.worker_urls) - 1))
        wait_ready(stack, num_prefill + num_decode, ready_timeout, launch=launch,
                   cancelled=cancelled)
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


def add_component(stack: Stack, proc: Component, spec: Spec, first: bool = False) -> None:
    """Add a started component to ``stack``: at the end, or ``first`` (the router, started
    after the store's master, whose address it is given, still comes first in ``procs``)."""
    at = 0 if first else len(stack.procs)
    stack.procs.insert(at, proc)
    stack.specs.insert(at, spec)


def gpu_args(device: str | None, num_workers: int) -> list[str]:
    """The device flags of each of ``num_workers`` workers placed on one machine: its
    ``--device`` when given, and off the CPU ``--workers-per-gpu`` so that each worker's
    default memory share is its part of the card (:func:`worker.device.default_share`)."""
    dev = ["--device", device] if device else []
    return dev if device == "cpu" else [*dev, "--workers-per-gpu", str(num_workers)]


def _store_args(stack: Stack, store: bool, log_dir: str | None) -> list[str]:
    """Start the store's master (appended to ``stack.procs``, so ``stop`` ends it after the
    workers) and return the workers' ``--store-url`` flag; ``[]`` without a store."""
    if not store:
        return []
    from deploy.local import start_store_master, start_store_master_process

    log = os.path.join(log_dir, "mooncake_master.log") if log_dir else None
    if log_dir:
        os.makedirs(log_dir, exist_ok=True)
    proc, url = start_store_master(log_path=log)
    host, port = url.rsplit(":", 1)
    stack.procs.append(proc)
    # restarted on the same port: the workers' --store-url stays valid
    stack.specs.append(Spec("mooncake_master", "", [], {}, "store", url=url, start=functools.partial(
        start_store_master_process, int(port), host, log)))
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
               launch: LaunchBackend | None = None,
               cancelled: Callable[[], bool] | None = None) -> None:
    """Poll the router's ``/health`` until ``num_workers`` are healthy.

    A worker that exits with :data:`worker.serve.EXIT_PORT_IN_USE` (the port picked for it was
    taken before it could bind it) is started again on a fresh port, at most
    :data:`PORT_RETRIES` times (``launch`` given).

    Raises:
        StartupError: a component exited (the message names it, its exit status and the end
            of its log when the backend keeps one), or ``timeout`` seconds passed.
        StartupCancelled: ``cancelled()`` returned True.
    """
    from worker.serve import EXIT_PORT_IN_USE

    deadline = time.monotonic() + timeout
    last = ""
    port_retries: dict[int, int] = {}
    client = httpx.Client(timeout=2.0)  # one client: its TLS context is built once
    try:
        while time.monotonic() < deadline:
            if cancelled is not None and cancelled():
                raise StartupCancelled("stopped during startup")
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
                r = client.get(f"{stack.url}/health")  # the counts: no API key
                if r.status_code == 200:
                    health = RouterHealth.model_validate_json(r.content)
                    if health.num_workers_healthy >= num_workers:
                        return
                    last = r.text[:500]
            except (httpx.HTTPError, ValidationError) as e:
                last = repr(e)[:500]
            time.sleep(poll_s)
    finally:
        client.close()
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


__all__ = [
    "BACKENDS",
    "PORT_RETRIES",
    "Component",
    "LaunchBackend",
    "PortInUseError",
    "Stack",
    "StartupCancelled",
    "StartupError",
    "add_component",
    "address_warning",
    "backend",
    "check_port_free",
    "start_stack",
    "wait_ready",
]
