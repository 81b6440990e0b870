"""The local-processes backend of :mod:`deploy.launcher`: each component is a child process
(``python -m router.app`` / ``prefill.worker`` / ``decode.worker``) of the launcher.

Children die with the launcher: on Linux each asks the kernel for SIGTERM when its parent dies
(``PR_SET_PDEATHSIG``), so even a SIGKILLed launcher leaves nothing behind.
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Mapping


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
              env: Mapping[str, str]) -> subprocess.Popen:
        """Start ``python -m {module} {args}`` with exactly ``env`` as its environment.

        Returns:
            The child (a :class:`subprocess.Popen`: ``poll``/``terminate``/``kill``/``wait``).

        Raises:
            OSError: the process could not be started or its log file opened.
        """
        out = None
        if self.log_dir:
            os.makedirs(self.log_dir, exist_ok=True)
            out = open(os.path.join(self.log_dir, f"{name}.log"), "w")  # noqa: SIM115
        pre = _die_with_parent if sys.platform.startswith("linux") else None
        try:  # preexec_fn runs one prctl call, nothing that a forked thread could deadlock on
            return subprocess.Popen(
                [sys.executable, "-m", module, *args], env=dict(env), stdout=out,
                stderr=subprocess.STDOUT if out else None, preexec_fn=pre,  # noqa: PLW1509
            )
        finally:
            if out is not None:  # the child holds its own copy of the descriptor
                out.close()


__all__ = ["LocalBackend", "free_port"]
