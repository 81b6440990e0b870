"""The local-processes backend of :mod:`deploy.launcher`: each component is a process
(``python -m router`` / ``prefill.worker`` / ``decode.worker``) of its own. On Linux they are
forks of the launcher's fork server (deploy/forkserver.py), which imported torch and the web
stack once; ``K3SERVE_FORKSERVER=0`` (or another OS) starts each as a child of the launcher.

Components die with the launcher: on Linux each asks the kernel for SIGTERM when its parent
dies (``PR_SET_PDEATHSIG``), and the fork server exits with the launcher, so even a SIGKILLed
launcher leaves nothing behind.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
from collections.abc import Mapping

from deploy import forkserver
from k3serve.process import die_with_parent, start_component

log = logging.getLogger("k3serve.deploy")


def free_port(host: str = "127.0.0.1") -> int:
    """An unused TCP port on ``host`` (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class LocalBackend:
    """Launch components as child processes of this one.

    Args:
        log_dir: write each child's stdout + stderr to ``{log_dir}/{name}.log`` (``None``: the
            children share the launcher's stdout / stderr).
    """

    name = "local"
    internal_host = "127.0.0.1"

    def __init__(self, log_dir: str | None = None) -> None:
        self.log_dir = log_dir

    def free_port(self, host: str) -> int:
        """A port the component on ``host`` may listen on."""
        return free_port(host)

    def spawn(self, name: str, module: str, args: list[str],
              env: Mapping[str, str]) -> subprocess.Popen | forkserver.ForkedProcess:
        """Start ``python -m {module} {args}`` with exactly ``env`` as its environment, SIGINT
        ignored until the component sets its own handler: a fork of the fork server
        (:func:`deploy.forkserver.enabled`), else a child started by ``subprocess.Popen``
        (:func:`k3serve.process.start_component`). A log file is appended to: a restarted
        component keeps its predecessor's log (why it died).

        Returns:
            The process (``poll``/``terminate``/``kill``/``wait``/``pid``).

        Raises:
            OSError: the process could not be started or its log file opened.
        """
        log_path = os.path.join(self.log_dir, f"{name}.log") if self.log_dir else None
        if self.log_dir:
            os.makedirs(self.log_dir, exist_ok=True)
        if forkserver.enabled(env):
            try:
                server = forkserver.ForkServer.shared(env)
            except OSError as e:  # start each component with its own interpreter instead
                log.warning("%s; starting %s without it", e, name)
            else:
                return server.spawn(module, args, env, log=log_path)
        out = open(log_path, "a") if log_path else None  # noqa: SIM115
        try:  # preexec_fn runs two libc calls, nothing that a forked thread could deadlock on
            return subprocess.Popen(
                [sys.executable, "-m", module, *args], env=dict(env), stdout=out,
                stderr=subprocess.STDOUT if out else None,
                preexec_fn=start_component,  # noqa: PLW1509
            )
        finally:
            if out is not None:  # the child holds its own copy of the descriptor
                out.close()


def mooncake_master_path() -> str:
    """The ``mooncake_master`` executable of the installed Mooncake wheel (next to the python
    that runs us, or inside the ``mooncake`` package).

    Raises:
        FileNotFoundError: no ``mooncake_master`` found.
    """
    cand = [os.path.join(os.path.dirname(sys.executable), "mooncake_master")]
    try:
        import importlib.util

        spec = importlib.util.find_spec("mooncake")
        if spec is not None and spec.origin:
            cand.append(os.path.join(os.path.dirname(spec.origin), "mooncake_master"))
    except (ImportError, ValueError):
        pass
    for c in cand:
        if os.access(c, os.X_OK):
            return c
    raise FileNotFoundError(f"mooncake_master: not found (looked at {cand})")


def start_store_master(port: int = 0, host: str = "127.0.0.1",
                       log_path: str | None = None) -> tuple[subprocess.Popen, str]:
    """Start a ``mooncake_master`` (the shared store's metadata service, no etcd) bound to
    ``host`` (loopback by default: its RPC and metrics ports never listen on other
    interfaces, DESIGN.md §7).

    Args:
        port: its RPC port (0: a free one).
        host: bind address of the RPC and metrics servers.
        log_path: its stdout + stderr go there (``None``: discarded).

    Returns:
        ``(process, "host:port")`` — the address workers take as ``--store-url``.

    Raises:
        FileNotFoundError: no ``mooncake_master``; OSError: it could not start.
    """
    port = port or free_port(host)
    return start_store_master_process(port, host, log_path), f"{host}:{port}"


def start_store_master_process(port: int, host: str = "127.0.0.1",
                               log_path: str | None = None) -> subprocess.Popen:
    """Start ``mooncake_master`` on ``host:port`` (:func:`start_store_master`; the supervisor
    restarts it with this, on the same port) in a process group of its own: a terminal's
    Ctrl-C reaches the workers, which drain with the store still there, and the launcher
    stops the master after them. It still dies with the launcher (``PR_SET_PDEATHSIG``).

    Raises:
        FileNotFoundError: no ``mooncake_master``; OSError: it could not start.
    """
    out = open(log_path, "a") if log_path else subprocess.DEVNULL  # noqa: SIM115
    pre = die_with_parent if sys.platform.startswith("linux") else None
    try:
        return subprocess.Popen(
            [mooncake_master_path(), f"--rpc_address={host}", f"--rpc_port={port}",
             f"--metrics_host={host}", f"--metrics_port={free_port(host)}", "--client_ttl=5"],
            stdout=out, stderr=subprocess.STDOUT, preexec_fn=pre,  # noqa: PLW1509
            process_group=0)
    finally:
        if log_path:
            out.close()  # type: ignore[union-attr]


__all__ = ["LocalBackend", "free_port", "mooncake_master_path", "start_store_master",
           "start_store_master_process"]
