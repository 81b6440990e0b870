"""``k3serve serve``: start the router and the prefill/decode worker processes on one machine.

Each component is its own process (``python -m router.app``, ``python -m prefill.worker``,
``python -m decode.worker``). The launcher generates a cluster token that every internal call
carries, waits until the router reports the workers healthy, prints the URL, and stops every
child on Ctrl-C / SIGTERM (or when any child dies).
"""

from __future__ import annotations

import ctypes
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field

import httpx

from k3serve.protocol import API_KEY_ENV, CLUSTER_TOKEN_ENV


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    """Linux: ask the kernel to SIGTERM this child when the launcher dies (even by SIGKILL)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG = 1
    except OSError:
        pass


def free_port(host: str = "127.0.0.1") -> int:
    """An unused TCP port on ``host`` (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass
class Stack:
    """Handles of a running stack (used by ``serve`` and by tests)."""

    url: str
    api_key: str | None
    cluster_token: str
    procs: list[subprocess.Popen] = field(default_factory=list)
    worker_urls: list[str] = field(default_factory=list)

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM every child, then SIGKILL what is left after ``timeout`` seconds."""
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        deadline = time.monotonic() + timeout
        for p in self.procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def dead_children(self) -> list[subprocess.Popen]:
        return [p for p in self.procs if p.poll() is not None]


def start_stack(
    model: str = "k3-tiny",
    host: str = "127.0.0.1",
    port: int = 0,
    num_prefill: int = 2,
    num_decode: int = 1,
    api_key: str | None = None,
    policy: str = "cache_aware",
    block_size: int = 64,
    device: str = "cpu",
    extra_worker_args: list[str] | None = None,
    extra_router_args: list[str] | None = None,
    ready_timeout: float = 180.0,
    log_dir: str | None = None,
) -> Stack:
    """Start router + workers and wait until the router sees every worker healthy.

    Args:
        model: preset name or checkpoint folder.
        port: router port; 0 picks a free one.
        ready_timeout: seconds to wait for all workers to register.

    Returns:
        A :class:`Stack`; call ``stop()`` to end it.

    Raises:
        ValueError: ``num_prefill`` or ``num_decode`` < 1.
        RuntimeError: a child exited or the stack was not ready within ``ready_timeout``.
    """
    if num_prefill < 1:
        raise ValueError("num_prefill: must be >= 1")
    if num_decode < 1:
        raise ValueError("num_decode: must be >= 1")
    token = secrets.token_hex(16)
    port = port or free_port(host)
    router_url = f"http://{host}:{port}"
    internal_host = "127.0.0.1"
    env = dict(os.environ)
    env[CLUSTER_TOKEN_ENV] = token
    env.setdefault("PYTHONUNBUFFERED", "1")
    stack = Stack(url=router_url if host != "0.0.0.0" else f"http://127.0.0.1:{port}",
                  api_key=api_key, cluster_token=token)

    def spawn(args: list[str], name: str) -> subprocess.Popen:
        out = None
        if log_dir:
            os.makedirs(log_dir, exist_ok=True)
            out = open(os.path.join(log_dir, f"{name}.log"), "w")  # noqa: SIM115
        try:
            p = subprocess.Popen(
                [sys.executable, *args], env=env, stdout=out,
                stderr=subprocess.STDOUT if out else None,
                preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
            )
        finally:
            if out is not None:  # the child holds its own copy of the descriptor
                out.close()
        stack.procs.append(p)
        return p

    try:
        rargs = ["-m", "router.app", "--host", host, "--port", str(port), "--policy", policy,
                 "--model", model]
        if api_key:  # through the environment, so it does not show in `ps`
            env[API_KEY_ENV] = api_key
        spawn(rargs + list(extra_router_args or []), "router")
        workers = [("prefill", i) for i in range(num_prefill)] + [("decode", i) for i in range(num_decode)]
        for role, i in workers:
            wport = free_port(internal_host)
            url = f"http://{internal_host}:{wport}"
            stack.worker_urls.append(url)
            spawn(
                ["-m", f"{role}.worker", "--host", internal_host, "--port", str(wport),
                 "--model", model, "--router-url", f"http://127.0.0.1:{port}",
                 "--block-size", str(block_size), "--device", device,
                 "--worker-id", f"{role}-{i}", *(extra_worker_args or [])],
                f"{role}-{i}",
            )
        _wait_ready(stack, num_prefill + num_decode, ready_timeout)
    except BaseException:
        stack.stop()
        raise
    return stack


def _wait_ready(stack: Stack, num_workers: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        dead = stack.dead_children()
        if dead:
            raise RuntimeError(f"a k3serve process exited during startup (code {dead[0].returncode})")
        try:
            r = httpx.get(f"{stack.url}/health", params={"detail": 1}, timeout=2.0)
            if r.status_code == 200:
                body = r.json()
                if body.get("num_workers_healthy", 0) >= num_workers:
                    return
                last = str(body)
        except httpx.HTTPError as e:
            last = repr(e)
        time.sleep(0.3)
    raise RuntimeError(f"stack not ready after {timeout:.0f} s (last health: {last})")


def serve(args) -> int:
    """Entry point of ``k3serve serve``: run until Ctrl-C / SIGTERM or a child dies."""
    stack = start_stack(
        model=args.model, host=args.host, port=args.port, num_prefill=args.prefill,
        num_decode=args.decode, api_key=args.api_key, policy=args.policy,
        block_size=args.block_size, device=args.device,
    )
    stopping = False

    def _stop(signum, frame):  # noqa: ARG001
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    print(f"k3serve: serving {args.model} at {stack.url}/v1  "
          f"({args.prefill} prefill + {args.decode} decode workers; Ctrl-C stops)", flush=True)
    try:
        while not stopping:
            if stack.dead_children():
                print("k3serve: a child process died; stopping the stack", file=sys.stderr)
                stack.stop()
                return 1
            time.sleep(0.5)
    finally:
        stack.stop()
    print("k3serve: stopped", flush=True)
    return 0
