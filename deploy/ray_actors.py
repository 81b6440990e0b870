"""The Ray actors of :mod:`deploy.ray_backend`: :class:`ProcessActor` (one k3serve program as
a supervised child process: restarts, backoff, limit — see ray_backend's docstring) and
:class:`RankActor` (a placeholder rank that holds its accelerator)."""

from __future__ import annotations

import itertools
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


def argv_port(argv: list[str]) -> int:
    """The value of ``--port N`` in ``argv`` (a program on a fixed port), else 0."""
    for flag, value in itertools.pairwise(argv):
        if flag == "--port" and value.isdigit():
            return int(value)
    return 0


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
            this node's IP. With ``ready="health"`` the program's port is that free port or
            the ``--port N`` of ``argv``.
        env: variables added to the inherited environment (cluster token, API key).
        ready: ``"listening"`` — wait for the child's ``listening on URL`` line;
            ``"health"`` — wait until ``GET {url}/health`` answers (the router).
        ready_timeout: seconds.
        child_restarts: crashes in a row the actor restarts its child itself (see the module
            docstring); 0: the actor exits at the first one.
        backoff: tenacity wait between failed child starts (default exponential from 0.5 s,
            at most 30 s).
        stable_s: a child up this long has its crash count reset.
        peers: the :class:`RankActor` handles of ranks 1 … R−1 of this instance (the child is
            rank 0, run with ``--remote-ranks``): each time the child prints its rendezvous
            line, every peer starts its rank there (a fresh one: old ranks are killed); when a
            peer's rank exits or its actor dies, the child is killed, so the instance restarts
            whole on fresh ports.
        peer_poll_s: seconds between two looks at the peers.

    Raises:
        RuntimeError: the child exited or was not ready within ``ready_timeout`` (the actor's
            creation fails; Ray retries it while restarts remain).
    """

    def __init__(self, name: str, argv: list[str], env: dict[str, str], ready: str = "listening",
                 ready_timeout: float = 240.0, child_restarts: int = 3,
                 backoff: Callable[..., float] | None = None, stable_s: float = 60.0,
                 peers: list[Any] | None = None, peer_poll_s: float = 1.0) -> None:
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
        self._health_http = None  # the /health probes' httpx.Client, made at the first probe
        self.lines: list[str] = []
        self.peers = list(peers or ())
        self.peer_poll_s = peer_poll_s
        self._peer_gens: list[int] = []  # the rank generation each peer runs for this child
        self.instance_failures: list[str] = []  # why the actor killed its child
        self._launch()
        threading.Thread(target=self._watch, daemon=True).start()
        if self.peers:
            threading.Thread(target=self._watch_peers, daemon=True).start()

    def _launch(self) -> None:
        """Start the child and wait until it is ready.

        Raises:
            RuntimeError: it exited first, or was not ready within ``ready_timeout``.
        """
        argv, ready = self._argv, self._ready
        port = _free_port(self.host) if any("{port}" in a for a in argv) else argv_port(argv)
        argv = [a.replace("{port}", str(port)).replace("{host}", self.host) for a in argv]
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _PDEATHSIG_PRELUDE, *argv], env=self._env,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
        self.started_at = time.monotonic()
        self.url = f"http://{self.host}:{port}" if ready == "health" else ""
        got_url = threading.Event()
        self._peer_gens = []
        self._rendezvous: tuple[str, str] | None = None
        threading.Thread(target=self._pump, args=(self.proc, got_url), daemon=True).start()
        deadline = time.monotonic() + self._ready_timeout
        while time.monotonic() < deadline:
            if self.peers and self._rendezvous is not None and not self._peer_gens:
                self._start_peers(*self._rendezvous, deadline)
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
            if self.peers and self._rendezvous is None:
                from k3serve.parallel.rendezvous import parse_rendezvous

                self._rendezvous = parse_rendezvous(line)
            m = LISTENING.search(line)
            if m and not got_url.is_set():
                self.url = m.group(1)
                got_url.set()

    def _start_peers(self, addr: str, spec_json: str, deadline: float) -> None:
        """Every peer starts its rank against rank 0's store ``addr``.

        Raises:
            RuntimeError: a peer could not (its actor dead or restarting past ``deadline``);
                the child is killed.
        """
        import ray

        try:
            gens = ray.get([p.start.remote(addr, spec_json) for p in self.peers],
                           timeout=max(1.0, deadline - time.monotonic()))
        except Exception as e:
            self.proc.kill()
            raise RuntimeError(f"{self.name}: its ranks could not start: {e!r}") from e
        self._peer_gens = list(gens)

    def _watch_peers(self) -> None:
        """Kill the child (rank 0) when a peer's rank of this child's generation has exited
        or its actor is gone: the instance cannot continue a collective without it, and the
        crash path (``_watch``) restarts the instance whole."""
        import ray

        while not self._stopping:
            time.sleep(self.peer_poll_s)
            gens, proc = self._peer_gens, self.proc
            if not gens or proc.poll() is not None:
                continue
            why = ""
            try:
                polled = ray.get([p.poll.remote() for p in self.peers], timeout=30)
                for r, (want, (gen, rc)) in enumerate(zip(gens, polled, strict=True), 1):
                    if gen == want and rc:  # 0: rank 0 stopped it (a drained worker)
                        why = f"rank {r} exited with {rc}"
                        break
            except ray.exceptions.GetTimeoutError:
                continue
            except Exception as e:  # noqa: BLE001 - a dead rank actor
                why = f"a rank's actor failed: {type(e).__name__}"
            if why and proc is self.proc and proc.poll() is None and not self._stopping:
                self.instance_failures.append(why)
                print(f"[{self.name}] {why}: the instance restarts", flush=True)
                proc.kill()

    def _healthy(self) -> bool:
        import httpx

        if self._health_http is None:  # one client (and TLS context) per actor
            self._health_http = httpx.Client(timeout=1.0, trust_env=False)
        try:
            return self._health_http.get(f"{self.url}/health").status_code in (200, 503)
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
                "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
                "instance_failures": list(self.instance_failures)}

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM the child, SIGKILL it after ``timeout`` s; its exit code."""
        self._stopping = True
        if self.peers:
            import ray

            try:
                ray.get([p.stop.remote(timeout) for p in self.peers], timeout=timeout + 5)
            except Exception:  # noqa: BLE001, S110 - a gone rank actor has no child either
                pass
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


class RankActor:
    """Rank ``rank`` ≥ 1 of an instance: holds its accelerator(s), reports where it landed, and
    runs the rank as a child process when rank 0 asks (:meth:`start`).

    Args:
        name: the instance (``decode-0``).
        rank: this rank.
        env: variables added to the inherited environment of the rank's process.
    """

    def __init__(self, name: str, rank: int, env: dict[str, str] | None = None) -> None:
        self.name, self.rank = name, rank
        self._env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"}
        self.proc: subprocess.Popen | None = None
        self.generation = 0
        self.lines: list[str] = []

    def start(self, store: str, spec_json: str) -> int:
        """Start (again) the rank against rank 0's store ``HOST:PORT``: the old process, if
        any, is killed first (it belonged to a failed instance). Returns the generation."""
        self.stop(timeout=0)
        self.generation += 1
        argv = ["-m", "k3serve.parallel.ranks", "--store", store, "--rank", str(self.rank),
                "--spec", spec_json]
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _PDEATHSIG_PRELUDE, *argv], env=self._env,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
        threading.Thread(target=self._pump, args=(self.proc,), daemon=True).start()
        return self.generation

    def _pump(self, proc: subprocess.Popen) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            self.lines = (self.lines + [line.rstrip("\n")])[-200:]
            print(f"[{self.name} rank {self.rank}] {line.rstrip()}", flush=True)

    def poll(self) -> tuple[int, int | None]:
        """``(generation, exit code or None while it runs)``; ``(0, None)`` before any start."""
        return self.generation, (self.proc.poll() if self.proc is not None else None)

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM the rank's process, SIGKILL it after ``timeout`` s (at once for 0)."""
        p = self.proc
        if p is None:
            return None
        if p.poll() is None:
            if timeout > 0:
                p.terminate()
                try:
                    p.wait(timeout)
                except subprocess.TimeoutExpired:
                    pass
            if p.poll() is None:
                p.kill()
                p.wait()
        return p.returncode

    def info(self) -> dict[str, Any]:
        import ray

        ctx = ray.get_runtime_context()
        return {"name": self.name, "rank": self.rank, "node_id": ctx.get_node_id(),
                "gpu_ids": [str(g) for g in ray.get_gpu_ids()], "generation": self.generation,
                "pid": self.proc.pid if self.proc is not None else None}


__all__ = ["LISTENING", "PINNED_PORT_ENV", "ProcessActor", "RankActor", "argv_port"]
