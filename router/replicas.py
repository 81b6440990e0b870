"""Router replicas on one host: ``python -m router --replicas N`` (``k3serve serve
--routers N``) runs N router processes behind one address that share nothing but the workers.

* **One address.** The supervisor (this module's :func:`supervise`, the process started as
  the router) binds the listening socket once and every replica inherits it (``--fd``): the
  kernel hands each new connection to one replica. A replica that dies loses only the
  connections it had accepted (their streams fail visibly: the body ends without
  ``data: [DONE]``); the others keep serving, and the supervisor starts it again.
* **Own state.** Each replica builds its own :class:`router.pipeline.Router` at start: its
  own worker pool, cache-event pollers and :class:`router.index.GlobalIndex` (every replica
  pulls every worker's events itself, so their indexes agree up to one poll).
* **Registration fanned out** (:class:`Registry`): a worker registers with whichever replica
  its ``POST /internal/register`` reaches; that replica records the worker's URL in a folder
  shared by the replicas, and every replica registers every URL recorded there (within
  ``REGISTRY_POLL_S``; again when the record changes: a worker that registers again after a
  restart). A replica started again registers every recorded worker before it serves
  (:meth:`Registry.catch_up` in its app's startup; uvicorn accepts on the socket only after
  it), so it never answers 503 for want of workers the others know.
* **Load the workers report.** Placement reads the larger of a replica's own account and the
  load the workers report with their cache events (``CacheEvents.load``), so replicas that
  never talk to each other still see each other's requests (a poll late).
* **Metrics:** prometheus-client's multiprocess mode in a folder shared by the replicas:
  one scrape of ``/metrics`` (any replica) answers the sum over all of them
  (:class:`router.metrics.RouterMetrics`); a replica that exits is marked dead there, so the
  live gauges drop its share while its counters stay counted.

The replica of a response is named in its ``x-k3serve-replica`` header.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from k3serve.process import start_component

if TYPE_CHECKING:
    from router.registry import WorkerRegistry

log = logging.getLogger("k3serve.router")

#: Environment of a replica: the shared registry folder (set by the supervisor).
REGISTRY_ENV = "K3SERVE_ROUTER_REGISTRY"
#: prometheus-client's multiprocess folder (read by prometheus-client at import).
METRICS_ENV = "PROMETHEUS_MULTIPROC_DIR"
#: Seconds between two reads of the registry folder by a replica.
REGISTRY_POLL_S = 0.25
#: Response header naming the replica that served a request.
REPLICA_HEADER = "x-k3serve-replica"


class Registry:
    """The workers registered with any replica: one file per worker URL in a shared folder.

    Args:
        path: The folder (created if missing).
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self._seen: dict[str, int] = {}  # url -> the record's mtime this replica registered

    def _file(self, url: str) -> Path:
        return self.path / hashlib.sha1(url.encode()).hexdigest()[:20]

    def add(self, url: str) -> None:
        """Record ``url`` (registered with this replica just now; written atomically)."""
        f = self._file(url)
        tmp = f.with_name(f".{f.name}.{os.getpid()}")
        tmp.write_text(url)
        os.replace(tmp, f)
        self._seen[url] = f.stat().st_mtime_ns

    def entries(self) -> dict[str, int]:
        """Recorded URLs and their records' modification times (ns)."""
        out = {}
        for f in self.path.iterdir():
            if f.name.startswith("."):
                continue
            with contextlib.suppress(OSError):
                out[f.read_text().strip()] = f.stat().st_mtime_ns
        return out

    async def sync(self, pool: WorkerRegistry) -> int:
        """Register with ``pool`` every URL recorded since this replica last did (a worker
        that cannot be reached now is tried again next time). Returns how many registered."""
        n = 0
        for url, mtime in self.entries().items():
            if self._seen.get(url) == mtime:
                continue
            try:
                await pool.register(url)
            except Exception as e:  # noqa: BLE001 - unreachable or refused: retried next time
                log.info("replica: cannot register %s yet: %s", url, e)
                continue
            self._seen[url] = mtime
            n += 1
        return n

    async def catch_up(self, pool: WorkerRegistry, timeout_s: float = 10.0) -> int:
        """Register every recorded worker before this replica serves (its app's startup,
        before it accepts on the shared socket): :meth:`sync` until none is left to
        register or ``timeout_s`` seconds passed (a recorded worker that is gone must not
        keep the replica from serving the others). Returns how many registered."""
        deadline = time.monotonic() + timeout_s
        n = 0
        while True:
            with contextlib.suppress(OSError):
                n += await self.sync(pool)
            with contextlib.suppress(OSError):
                if all(self._seen.get(u) == m for u, m in self.entries().items()):
                    return n
            if time.monotonic() >= deadline:
                log.warning("replica: serving before every recorded worker registered")
                return n
            await asyncio.sleep(REGISTRY_POLL_S)

    async def watch(self, pool: WorkerRegistry, interval_s: float = REGISTRY_POLL_S) -> None:
        """:meth:`sync` every ``interval_s`` seconds until cancelled."""
        while True:
            with contextlib.suppress(OSError):
                await self.sync(pool)
            await asyncio.sleep(interval_s)


def supervise(argv: list[str], n: int, sock: socket.socket) -> int:
    """Run ``n`` replicas (``python -m router ARGV --replica-index i --fd FD``) on the
    listening ``sock`` until SIGTERM / SIGINT; start again a replica that exits.

    Args:
        argv: The router's flags without ``--replicas``.
        n: Number of replicas (≥ 1).
        sock: The bound, listening socket every replica serves.

    Returns:
        0 after a clean stop.
    """
    from prometheus_client.multiprocess import mark_process_dead

    base = Path(tempfile.mkdtemp(prefix="k3serve-router-"))
    metrics_dir, registry_dir = base / "metrics", base / "registry"
    metrics_dir.mkdir()
    registry_dir.mkdir()
    env = dict(os.environ)
    env[METRICS_ENV] = str(metrics_dir)
    env[REGISTRY_ENV] = str(registry_dir)
    fd = sock.fileno()

    def spawn(i: int) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-m", "router", *argv, "--replica-index", str(i),
             "--fd", str(fd)], env=env, pass_fds=(fd,),
            preexec_fn=start_component)  # noqa: PLW1509 - two libc calls, nothing a thread holds

    stopping = False

    def stop(signum, frame) -> None:
        nonlocal stopping
        stopping = True

    old = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
    procs = [spawn(i) for i in range(n)]
    restarts = [0.0] * n  # when replica i may be started again (monotonic s)
    try:
        while not stopping:
            for i, p in enumerate(procs):
                if p.poll() is None:
                    continue
                if p.returncode is not None and not restarts[i]:
                    mark_process_dead(p.pid, str(metrics_dir))
                    log.warning("router replica %d (pid %d) exited with %s; starting it again",
                                i, p.pid, p.returncode)
                    restarts[i] = time.monotonic() + 0.5
                elif time.monotonic() >= restarts[i]:
                    procs[i], restarts[i] = spawn(i), 0.0
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        deadline = time.monotonic() + 10
        for p in procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for s, h in old.items():
            signal.signal(s, h)
        shutil.rmtree(base, ignore_errors=True)
    return 0


__all__ = ["METRICS_ENV", "REGISTRY_ENV", "REGISTRY_POLL_S", "REPLICA_HEADER", "Registry",
           "supervise"]
