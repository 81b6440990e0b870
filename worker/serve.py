"""``python -m {role}.worker``: parse the config, bind the port, build the worker, serve.

The port is bound before the engine is built, so a taken port ends at once with one line on
stderr (exit status 2), not a traceback after the model has loaded.
"""

from __future__ import annotations

import errno
import logging
import socket
import sys

from worker.base import BaseWorker
from worker.config import Role, WorkerConfig, parse_config

EXIT_PORT_IN_USE = 2


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


def serve(worker_cls: type[BaseWorker], role: Role, argv: list[str] | None = None) -> int:
    """Run a worker of ``worker_cls`` until SIGTERM; returns the exit status.

    Returns:
        0 after a clean shutdown; :data:`EXIT_PORT_IN_USE` when the port cannot be bound
        (one line on stderr).
    """
    import uvicorn

    from worker.http import create_app

    config: WorkerConfig = parse_config(role, argv)
    logging.basicConfig(level=config.log_level.upper(),
                        format=f"%(asctime)s {role} %(name)s %(levelname)s %(message)s")
    try:
        sock = bind(config.host, config.port)
    except PortInUseError as e:
        print(f"k3serve {role} worker: error: {e.strerror}", file=sys.stderr, flush=True)
        return EXIT_PORT_IN_USE
    config = config.bound_to(sock.getsockname()[1])
    worker = worker_cls(config)
    server = uvicorn.Server(uvicorn.Config(create_app(worker), log_level=config.log_level,
                                           access_log=False, timeout_graceful_shutdown=3))
    print(f"k3serve {role} worker {worker.worker_id} listening on {worker.url}", flush=True)
    server.run(sockets=[sock])
    return 0


__all__ = ["EXIT_PORT_IN_USE", "PortInUseError", "bind", "serve"]
