"""Supervision of a local stack (:mod:`deploy.launcher`): a component that crashes is started
again; the stack never goes down because one worker did.

:class:`Supervisor` watches every component of a :class:`~deploy.launcher.Stack` from a daemon
thread. A component whose process exits with a non-zero status (a crash, ``kill -9``) is
restarted with the same command line — a worker on a **fresh HTTP port** (its kvstore bootstrap
server and Mooncake transfer engine pick fresh ports too: nothing pins them, the pinned
``K3SERVE_KV_BOOTSTRAP_PORT`` is dropped on restart), so peers never talk to the dead endpoint;
the worker registers under its old ``--worker-id`` and the router replaces the old entry
(``router.workers.WorkerPool.register``). The router is restarted on its own port (clients keep
their URL) and the workers register with it again by themselves.

Backoff and limit (tenacity): a start that fails (the process exits before it is healthy, or it
is not healthy within ``ready_timeout``) is retried after an exponential wait
(``wait_exponential``); each component gets at most ``max_restarts`` restarts in its lifetime.
A worker past its limit stays down (the others keep serving); a router past its limit ends the
stack (:attr:`Supervisor.fatal`). A component that exits with status 0 was stopped on purpose
(a drained worker, SIGTERM) and is not restarted.

The store's master (``k3serve serve --store``) is restarted on its own port whatever its exit
status (the workers' ``--store-url`` stays valid; their store clients reconnect by themselves);
it is ready once its RPC port accepts a connection. Nothing is restarted once the stack is
stopping (``stack.stopping``, set before any component is signalled).
"""

from __future__ import annotations

import functools
import logging
import socket
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx
import tenacity

log = logging.getLogger("k3serve.deploy")

#: Environment pins a restarted worker must not keep (it would reuse its old ports).
PINNED_PORT_ENV = ("K3SERVE_KV_BOOTSTRAP_PORT",)


@dataclass
class Spec:
    """How to (re)start one component.

    Attributes:
        name: ``router``, ``prefill-0``, ...
        module: ``python -m`` module.
        args: its flags (a worker's ``--port`` is replaced on restart).
        env: its environment.
        kind: ``router`` | ``worker`` | ``store``.
        url_index: a worker's index in ``Stack.worker_urls``.
        restarts: restarts so far.
        url: the store master's ``host:port`` (its readiness: the port accepts).
        start: how to start it when not through the launch backend (the store's master):
            a function returning the new process.
    """

    name: str
    module: str
    args: list[str]
    env: dict[str, str]
    kind: str
    url_index: int = -1
    restarts: int = 0
    events: list[str] = field(default_factory=list)
    url: str = ""
    start: Callable[[], Any] | None = None


def _accepts(address: str, timeout: float = 1.0) -> bool:
    """True when ``host:port`` accepts a TCP connection now."""
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            return True
    except OSError:
        return False


class RestartFailed(RuntimeError):
    """One restart attempt failed (the process exited or was not healthy in time)."""


def _swap_port(args: list[str], port: int) -> list[str]:
    out = list(args)
    i = out.index("--port")
    out[i + 1] = str(port)
    return out


def move_to_fresh_port(spec: Spec, launch: Any) -> str:
    """Give worker ``spec`` a fresh ``--port`` from ``launch`` (a launch backend); returns its
    new URL (``http://{launch.internal_host}:{port}``)."""
    host = launch.internal_host
    port = launch.free_port(host)
    spec.args = _swap_port(spec.args, port)
    return f"http://{host}:{port}"


class Supervisor:
    """Restart crashed components of ``stack`` (see the module docstring).

    Args:
        stack: the running stack (``stack.specs[i]`` describes ``stack.procs[i]``).
        launch: the backend that started it (spawns the replacements).
        max_restarts: restarts allowed per component (lifetime).
        wait: tenacity wait strategy between failed start attempts (default exponential,
            0.5 s doubling, at most 30 s).
        ready_timeout: seconds a restarted component has to answer ``/health`` 200.
        poll_s: seconds between checks.
        say: where restart messages go (default: stderr).
    """

    def __init__(self, stack: Any, launch: Any, max_restarts: int = 5,
                 wait: tenacity.wait.wait_base | None = None, ready_timeout: float = 180.0,
                 poll_s: float = 0.5, say: Callable[[str], None] | None = None) -> None:
        self.stack, self.launch = stack, launch
        self.max_restarts = max_restarts
        self.wait = wait if wait is not None else tenacity.wait_exponential(
            multiplier=0.5, min=0.5, max=30)
        self.ready_timeout, self.poll_s = ready_timeout, poll_s
        self.say = say or (lambda m: print(f"k3serve: {m}", file=sys.stderr, flush=True))
        self.fatal: str | None = None
        self._busy: set[int] = set()  # indices being restarted
        self._given_up: set[int] = set()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        # Replacements are spawned from ONE long-lived thread: PR_SET_PDEATHSIG fires when the
        # thread that forked the child exits, not only the process — a child this process
        # forks itself (the store's master; every component with K3SERVE_FORKSERVER=0, or the
        # fork server when it has to start again) from a short-lived restart thread would get
        # SIGTERM as soon as that thread ends.
        self._spawner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="spawner")

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> Supervisor:
        self._thread = threading.Thread(target=self._run, name="supervisor", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop watching (idempotent); restarts in progress give up at their next step."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def close(self) -> None:
        """:meth:`stop`, and end the spawner thread (children it started get SIGTERM: call it
        once they are stopped)."""
        self.stop()
        self._spawner.shutdown(wait=False)

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.check()
            except Exception:  # the watcher must not die
                log.exception("supervisor check failed")

    # ------------------------------------------------------------------ one check
    def check(self) -> None:
        """Start a restart thread for every component that crashed since the last check
        (none once the stack is stopping)."""
        for i, spec in enumerate(self.stack.specs):
            with self._lock:
                if self.stack.stopping or self._stop.is_set():
                    return
                if i in self._busy or i in self._given_up:
                    continue
                rc = self.stack.procs[i].poll()
                if rc is None:
                    continue
                if rc == 0 and spec.kind != "store":
                    self._given_up.add(i)
                    self.say(f"{spec.name} exited with status {rc}; not restarted"
                             + (" (stopped on purpose)" if rc == 0 else ""))
                    continue
                if spec.restarts >= self.max_restarts:
                    self._given_up.add(i)
                    self._give_up(spec, f"exited with status {rc} after {spec.restarts} "
                                        f"restarts (limit {self.max_restarts})")
                    continue
                self._busy.add(i)
            self.say(f"{spec.name} died (status {rc}); restarting")
            threading.Thread(target=self._restart, args=(i, rc), name=f"restart {spec.name}",
                             daemon=True).start()

    def _give_up(self, spec: Spec, why: str) -> None:
        msg = f"{spec.name} {why}; left down"
        if spec.kind == "router":
            self.fatal = f"the router {why}"
        self.say(msg)

    def _restart(self, i: int, rc: int) -> None:
        spec = self.stack.specs[i]
        left = self.max_restarts - spec.restarts
        try:
            for attempt in tenacity.Retrying(
                    stop=tenacity.stop_after_attempt(left), wait=self.wait, reraise=True,
                    retry=tenacity.retry_if_exception_type(RestartFailed),
                    sleep=self._stop.wait,  # a stop ends the backoff at once
                    before_sleep=lambda rs: self.say(
                        f"{spec.name}: restart failed ({rs.outcome.exception()}); next try in "
                        f"{rs.next_action.sleep:.1f} s")):
                with attempt:
                    if self._stop.is_set() or self.stack.stopping:
                        return
                    self._start_one(i)
        except RestartFailed as e:
            with self._lock:
                self._given_up.add(i)
            self._give_up(spec, f"could not be restarted: {e}")
        finally:
            with self._lock:
                self._busy.discard(i)

    def _start_one(self, i: int) -> None:
        """Spawn component ``i`` again and wait until its ``/health`` answers 200.

        Raises:
            RestartFailed: it exited first, or was not healthy within ``ready_timeout``.
        """
        spec = self.stack.specs[i]
        env = dict(spec.env)
        url = self.stack.url
        if spec.kind == "worker":
            for k in PINNED_PORT_ENV:
                env.pop(k, None)
            url = move_to_fresh_port(spec, self.launch)
        elif spec.kind == "store":
            url = spec.url
        spec.restarts += 1
        start = spec.start if spec.start is not None else functools.partial(
            self.launch.spawn, spec.name, spec.module, spec.args, env)
        proc = self._spawner.submit(start).result()
        with self._lock:
            self.stack.procs[i] = proc
            if spec.kind == "worker":
                self.stack.worker_urls[spec.url_index] = url
        spec.events.append(f"restart {spec.restarts}: {url}")
        deadline = time.monotonic() + self.ready_timeout
        with httpx.Client(timeout=2.0, trust_env=False) as c:
            while time.monotonic() < deadline:
                if self._stop.is_set() or self.stack.stopping:
                    return
                rc = proc.poll()
                if rc is not None:
                    raise RestartFailed(f"exited with status {rc} while starting")
                try:  # a router answers 503 until its workers have registered again
                    ok = (200, 503) if spec.kind == "router" else (200,)
                    if (_accepts(url) if spec.kind == "store"
                            else c.get(url + "/health").status_code in ok):
                        self.say(f"{spec.name} restarted ({url}, restart {spec.restarts} of "
                                 f"{self.max_restarts})")
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(0.3)
        proc.kill()
        raise RestartFailed(f"not healthy after {self.ready_timeout:.0f} s")


__all__ = ["PINNED_PORT_ENV", "RestartFailed", "Spec", "Supervisor"]
