"""The Ray actors of :mod:`deploy.ray_backend`: :class:`ProcessActor` (one k3serve program as
a supervised child process: restarts, backoff, limit — see ray_backend's docstring) and
:class:`RankActor` (a placeholder rank that holds its accelerator)."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

LISTENING = re.compile(r"listening on (https?://\S+)")
PINNED_PORT_ENV = ("K3SERVE_KV_BOOTSTRAP_PORT",)  # a restarted worker must pick fresh ports


# Runs first in the child: PR_SET_PDEATHSIG (1) = SIGTERM, kept across the exec that follows,
# so the kernel ends the program when the actor process dies (even by SIGKILL). A prelude
# instead of Popen's preexec_fn, which is unsafe in a process with threads (a Ray worker).
_PDEATHSIG_PRELUDE = ("import ctypes, os, sys\n"
                      "try:\n    ctypes.CDLL('libc.so.6', use_errno=True).prctl(1, 15)\n"
                      "except OSError:\n    pass\n"
                      "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])\n")


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ProcessActor:
    """A Ray actor that runs one k3serve program as a supervised child process.

    Args:
        name: ``"router"``, ``"prefill-0"``, …
        argv: the command after ``python`` (``["-m", "decode.worker", …]``); the text
            ``{port}`` is replaced by a free port on this node (the router), and ``{host}`` by
            this node's IP.
        env: variables added to the inherited environment (cluster token, API key).
        ready: ``"listening"`` — wait for the child's ``listening on URL`` line;
            ``"health"`` — wait until ``GET {url}/health`` answers (the router).
        ready_timeout: seconds.
        child_restarts: crashes in a row the actor restarts its child itself (see the module
            docstring); 0: the actor exits at the first one.
        backoff: tenacity wait between failed child starts (default exponential from 0.5 s,
            at most 30 s).
        stable_s: a child up this long has its crash count reset.

    Raises:
        RuntimeError: the child exited or was not ready within ``ready_timeout`` (the actor's
            creation fails; Ray retries it while restarts remain).
    """

    def __init__(self, name: str, argv: list[str], env: dict[str, str], ready: str = "listening",
                 ready_timeout: float = 240.0, child_restarts: int = 3,
                 backoff: Callable[..., float] | None = None, stable_s: float = 60.0) -> None:
        import ray
        import tenacity

        self.name = name
        ctx = ray.get_runtime_context()
        self.node_id = ctx.get_node_id()
        self.restarted = bool(ctx.was_current_actor_reconstructed)
        self.host = ray.util.get_node_ip_address()
        self._argv, self._ready, self._ready_timeout = argv, ready, ready_timeout
        self._env = {**os.environ, **env, "PYTHONUNBUFFERED": "1"}
        for k in PINNED_PORT_ENV:
            self._env.pop(k, None)
        self.child_restarts, self.stable_s = child_restarts, stable_s
        self._backoff = backoff or tenacity.wait_exponential(multiplier=0.5, min=0.5, max=30)
        self.child_starts = 0  # children started (and ready) by this actor incarnation
        self._stopping = False
        self.lines: list[str] = []
        self._launch()
        threading.Thread(target=self._watch, daemon=True).start()

    def _launch(self) -> None:
        """Start the child and wait until it is ready.

        Raises:
            RuntimeError: it exited first, or was not ready within ``ready_timeout``.
        """
        argv, ready = self._argv, self._ready
        port = _free_port(self.host) if any("{port}" in a for a in argv) else 0
        argv = [a.replace("{port}", str(port)).replace("{host}", self.host) for a in argv]
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _PDEATHSIG_PRELUDE, *argv], env=self._env,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
        self.started_at = time.monotonic()
        self.url = f"http://{self.host}:{port}" if ready == "health" else ""
        got_url = threading.Event()
        threading.Thread(target=self._pump, args=(self.proc, got_url), daemon=True).start()
        deadline = time.monotonic() + self._ready_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = "\n".join(self.lines[-20:])
                raise RuntimeError(f"{self.name}: exited with {self.proc.returncode}:\n{tail}")
            if (ready == "listening" and got_url.wait(0.2)) or (
                    ready == "health" and self._healthy()):
                self.child_starts += 1
                return
        self.proc.kill()
        raise RuntimeError(f"{self.name}: not ready after {self._ready_timeout:.0f} s")

    def _pump(self, proc: subprocess.Popen, got_url: threading.Event) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.rstrip("\n")
            self.lines = (self.lines + [line])[-200:]
            print(f"[{self.name}] {line}", flush=True)  # Ray's per-actor log file
            m = LISTENING.search(line)
            if m and not got_url.is_set():
                self.url = m.group(1)
                got_url.set()

    def _healthy(self) -> bool:
        import httpx

        try:
            return httpx.get(f"{self.url}/health", timeout=1.0, trust_env=False).status_code in (
                200, 503)
        except httpx.HTTPError:
            time.sleep(0.2)
            return False

    def _watch(self) -> None:
        """Restart a crashed child (backoff, limit) from this long-lived thread — the child's
        PR_SET_PDEATHSIG fires when the thread that started it ends — else exit the actor."""
        import tenacity

        in_a_row = 0  # children started since the last one that stayed up stable_s
        while True:
            rc = self.proc.wait()
            if self._stopping:
                return
            if rc == 0:  # stopped on purpose (a drained worker): stays down, the actor idles
                print(f"[{self.name}] child exited with 0 (drained); not restarted", flush=True)
                return
            if time.monotonic() - self.started_at >= self.stable_s:
                in_a_row = 0
            left = self.child_restarts - in_a_row
            print(f"[{self.name}] child exited with {rc}; {max(left, 0)} restarts left here",
                  flush=True)
            if left <= 0:
                os._exit(1)  # past the limit: Ray restarts the actor (max_restarts)
            try:
                for attempt in tenacity.Retrying(
                        stop=tenacity.stop_after_attempt(left), wait=self._backoff,
                        reraise=True, retry=tenacity.retry_if_exception_type(RuntimeError)):
                    with attempt:
                        if self._stopping:
                            return
                        in_a_row += 1
                        self._launch()
            except RuntimeError:
                os._exit(1)

    def info(self) -> dict[str, Any]:
        """``{name, url, pid, node_id, restarted, child_starts, gpu_ids}`` of this
        incarnation (``child_starts`` > 1: the actor restarted its child)."""
        import ray

        return {"name": self.name, "url": self.url, "pid": self.proc.pid,
                "node_id": self.node_id, "restarted": self.restarted,
                "child_starts": self.child_starts,
                "gpu_ids": [str(g) for g in ray.get_gpu_ids()]}

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM the child, SIGKILL it after ``timeout`` s; its exit code."""
        self._stopping = True
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


class RankActor:
    """A rank of an instance that holds its accelerator(s) and reports where it landed."""

    def __init__(self, name: str, rank: int) -> None:
        self.name, self.rank = name, rank

    def info(self) -> dict[str, Any]:
        import ray

        ctx = ray.get_runtime_context()
        return {"name": self.name, "rank": self.rank, "node_id": ctx.get_node_id(),
                "gpu_ids": [str(g) for g in ray.get_gpu_ids()]}



__all__ = ["LISTENING", "PINNED_PORT_ENV", "ProcessActor", "RankActor"]
