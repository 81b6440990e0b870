"""``python -m {role}.worker``: parse the config, bind the port, build the worker, serve.

The port is bound before the engine is built, so a taken port ends at once with one line on
stderr (exit status 2), not a traceback after the model has loaded.

SIGTERM or SIGINT (Ctrl-C) drains (:class:`DrainingServer`): the worker stops admitting
(``reserve`` / ``prefill`` / ``generate`` answer 503 ``draining``, ``/health`` 503
``draining``), stops re-registering and deregisters from the router (which stops placing there
at once), waits until every request it holds has finished (at most ``--drain-timeout``
seconds), then exits with status 0. More SIGTERMs while draining are ignored (a signal sent to
the whole process group and the launcher's own reach a worker both); a second SIGINT ends the
drain at once (open streams get at most 3 s). A signal before the app has started ends the
process quietly with status 0. No signal ends in a traceback.

The process title is ``k3serve {role}-worker :PORT`` (setproctitle; ``monolithic-worker`` for
a decode worker started by ``k3serve serve --monolithic N``), so ``ps`` names the role.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import signal
import socket
import sys
import time
from types import FrameType
from typing import Any

from k3serve import tracing
from k3serve.process import (
    TITLE_ROLE_ENV,
    ParentWatch,
    exit_now,
    handled_signals,
    quit_before_serving,
    set_title,
    worker_title,
)
from worker.base import BaseWorker
from worker.config import Role, WorkerConfig, parse_config

#: exit status when the HTTP port cannot be bound — not argparse's 2 (a usage error), so a
#: launcher can tell a taken port (start again elsewhere) from a bad command line
EXIT_PORT_IN_USE = 3
#: signals that start a drain: ``kill`` / a launcher, and a terminal's Ctrl-C
DRAIN_SIGNALS = (signal.SIGTERM, signal.SIGINT)
log = logging.getLogger("k3serve.worker")


class PortInUseError(OSError):
    """The address to listen on is taken (or cannot be bound); the message says which."""


def bind(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``(host, port)`` (port 0: any free port), not yet listening.

    Raises:
        PortInUseError: the port is taken, or the address cannot be bound (message names it).
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        why = "is already in use" if e.errno == errno.EADDRINUSE else f"cannot be bound: {e}"
        raise PortInUseError(e.errno, f"{host}:{port} {why}") from None
    return sock


def _server_cls() -> type:
    import uvicorn

    class DrainingServer(uvicorn.Server):
        """uvicorn's server whose first SIGTERM / SIGINT drains the worker before shutting
        down, and which never re-raises a handled signal after the run (uvicorn's own
        ``capture_signals`` does, which ends the process with -15 or a KeyboardInterrupt
        traceback)."""

        def __init__(self, config: Any, worker: BaseWorker, app: Any,
                     parent: ParentWatch) -> None:
            super().__init__(config)
            self.worker, self.app, self.parent = worker, app, parent
            self.drain_task: asyncio.Task | None = None

        def capture_signals(self) -> contextlib.AbstractContextManager[None]:
            return handled_signals(self.handle_exit, DRAIN_SIGNALS)

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            if self.parent.gone():  # the launcher died: the stack is going (ParentWatch)
                log.info("%s: the launcher (pid %d) is gone; exiting now",
                         signal.Signals(sig).name, self.parent.parent)
                exit_now(0)
            loop = self.worker.aloop
            if loop is None:  # the app has not started: nothing to drain
                self.should_exit = True
                return
            if not self.worker.draining:
                self.worker.begin_drain()  # admissions stop now, before the loop runs again
                loop.call_soon_threadsafe(self._start_drain, signal.Signals(sig).name)
                return
            if sig == signal.SIGINT and not self.should_exit:
                log.warning("SIGINT while draining: stopping now")
                loop.call_soon_threadsafe(self._stop_now)
                return
            log.info("%s while draining: ignored (the drain ends within --drain-timeout)",
                     signal.Signals(sig).name)

        def _start_drain(self, signame: str) -> None:
            self.drain_task = asyncio.ensure_future(self._drain(signame))

        def _stop_now(self) -> None:
            if self.drain_task is not None:
                self.drain_task.cancel()
            self.worker.end_streams()
            self.should_exit = True

        async def _drain(self, signame: str) -> None:
            from worker.http import stop_registration
            from worker.registration import deregister

            w, cfg = self.worker, self.worker.config
            log.info("%s: draining (no new admissions; up to %.0f s)", signame,
                        cfg.drain_timeout_s)
            await stop_registration(self.app)
            if cfg.router_url:
                await deregister(cfg.router_url, w.url, cfg.cluster_token)
            deadline = time.monotonic() + cfg.drain_timeout_s
            left = -1
            while time.monotonic() < deadline:
                try:
                    left = await w.loop.call(w.num_tracked, timeout=5)
                except Exception as e:  # noqa: BLE001 - the engine thread is gone
                    log.warning("drain: engine not answering (%r); stopping", e)
                    break
                if left == 0:
                    break
                await asyncio.sleep(0.05)
            if left:
                log.warning("drain: %d requests still held after %.0f s; stopping",
                            left, cfg.drain_timeout_s)
            else:
                log.info("drain: done; stopping")
            w.end_streams()
            self.should_exit = True

    return DrainingServer


def serve(worker_cls: type[BaseWorker], role: Role, argv: list[str] | None = None) -> int:
    """Run a worker of ``worker_cls`` until SIGTERM / SIGINT (a drain, see the module
    docstring); returns the exit status.

    Returns:
        :data:`EXIT_PORT_IN_USE` when the port cannot be bound (one line on stderr). After a
        clean shutdown or a drain the process ends with status 0 right after the worker has
        closed (:func:`k3serve.process.exit_now`: no interpreter finalization).
    """
    import uvicorn

    from worker.http import create_app

    parent = ParentWatch()
    for sig in DRAIN_SIGNALS:
        signal.signal(sig, quit_before_serving)
    config: WorkerConfig = parse_config(role, argv)
    logging.basicConfig(level=config.log_level.upper(),
                        format=f"%(asctime)s {role} %(name)s %(levelname)s %(message)s")
    try:
        sock = bind(config.host, config.port)
    except PortInUseError as e:
        print(f"k3serve {role} worker: error: {e.strerror}", file=sys.stderr, flush=True)
        return EXIT_PORT_IN_USE
    config = config.bound_to(sock.getsockname()[1])
    set_title(worker_title(role, config.port))
    tracing.configure(f"k3serve-{role}", config.otlp_traces_endpoint)
    if not config.cluster_token:
        log.warning("no cluster token (K3SERVE_CLUSTER_TOKEN): every internal endpoint of this "
                    "worker and its kvstore is open to anyone who can reach it")
    worker = worker_cls(config)
    app = create_app(worker)
    # h11 and asyncio's own loop for the worker (the router picks httptools and uvloop,
    # router/config.py)
    server = _server_cls()(uvicorn.Config(app, log_level=config.log_level, access_log=False,
                                          timeout_graceful_shutdown=3, http="h11",
                                          loop="asyncio"), worker, app, parent)
    shown = os.environ.get(TITLE_ROLE_ENV) or role  # monolithic workers run decode.worker
    print(f"k3serve {shown} worker {worker.worker_id} listening on {worker.url}", flush=True)
    try:
        server.run(sockets=[sock])
    finally:
        tracing.shutdown()  # flushes the spans not yet exported
    for sig in DRAIN_SIGNALS:  # the process is ending: a late signal changes nothing
        signal.signal(sig, signal.SIG_IGN)
    exit_now(0)


__all__ = ["DRAIN_SIGNALS", "EXIT_PORT_IN_USE", "PortInUseError", "bind", "serve"]
