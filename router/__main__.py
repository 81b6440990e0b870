"""``python -m router``: parse the flags, bind the port, serve the router until stopped.

Flags: :func:`router.config.build_parser`; the app: :func:`router.app.create_app`;
``--replicas N`` > 1: N replica processes on one port (:mod:`router.replicas`).
"""

from __future__ import annotations

import errno
import logging
import socket
import sys

import uvicorn

from router.app import create_app
from router.config import (
    ROUTER_HTTP,
    ROUTER_LOOP,
    build_parser,
    config_from_args,
    listen,
    tune_gc,
)
from router.replicas import supervise


def without_replicas(argv: list[str]) -> list[str]:
    """``argv`` less its ``--replicas N`` / ``--replicas=N``."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--replicas":
            skip = True
        elif not a.startswith("--replicas="):
            out.append(a)
    return out


def main(argv: list[str] | None = None) -> int:
    """``python -m router``: parse flags, bind the port, serve until stopped
    (``--replicas N`` > 1: N replica processes on that port, :mod:`router.replicas`).

    Returns:
        0 after a clean stop; 1 when the port cannot be bound (one line on stderr, no
        traceback).
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.replicas < 1:
        print("k3serve router: --replicas: must be >= 1", file=sys.stderr)
        return 2
    config = config_from_args(args)
    if args.fd is not None:  # a replica: the supervisor's socket
        sock = socket.socket(fileno=args.fd)
    else:
        try:
            sock = listen(args.host, args.port)
        except OSError as e:
            why = ("address already in use" if e.errno == errno.EADDRINUSE
                   else e.strerror or str(e))
            print(f"k3serve router: cannot listen on {args.host}:{args.port}: {why}",
                  file=sys.stderr)
            return 1
        if args.replicas > 1:
            try:
                return supervise(without_replicas(argv), args.replicas, sock)
            finally:
                sock.close()
    # access lines are INFO records: above INFO none would be written, so none is made
    level = logging.getLevelName(args.log_level.upper())
    # httptools (C request parser, chunked body writes without h11's state machine): ~10 % of
    # the router's CPU per request and per relayed chunk (benchmarks/router_relay.py); the
    # workers' servers stay on h11
    server = uvicorn.Server(uvicorn.Config(
        create_app(config), log_level=args.log_level, http=ROUTER_HTTP, loop=ROUTER_LOOP,
        access_log=not isinstance(level, int) or level <= logging.INFO))
    tune_gc()
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
