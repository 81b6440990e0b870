"""``python -m router``: parse the flags, bind the port, serve the router until stopped.

Flags: :func:`router.config.build_parser`; the app: :func:`router.app.create_app`;
``--replicas N`` > 1: N replica processes on one port (:mod:`router.replicas`).

Stopping (:class:`StoppingServer`): the first SIGTERM or SIGINT stops accepting connections
and lets the open ones finish (streams run to their end while the workers drain); more
SIGTERMs are ignored (a signal to the whole process group and the launcher's own both arrive),
a second SIGINT ends the process at once (:func:`k3serve.process.exit_now`: open connections
are cut, nothing is flushed). The process exits 0, without a traceback. Its title is
``k3serve router :PORT`` (setproctitle).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import signal
import socket
import sys
from collections.abc import Callable
from types import FrameType

import uvicorn

from k3serve import tracing
from k3serve.process import (
    ParentWatch,
    exit_now,
    handled_signals,
    quit_before_serving,
    set_title,
)
from router.app import create_app
from router.config import (
    ROUTER_HTTP,
    ROUTER_LOOP,
    build_parser,
    config_from_args,
    listen,
    tune_gc,
)
from router.memory import fix_mmap_threshold
from router.replicas import supervise

#: signals that stop the router gracefully: ``kill`` / a launcher, and a terminal's Ctrl-C
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
log = logging.getLogger("k3serve.router")


class StoppingServer(uvicorn.Server):
    """uvicorn's server with the stop rules of the module docstring; unlike uvicorn's own
    ``capture_signals`` it does not re-raise the handled signal after the run (which ends the
    process with -15, or a KeyboardInterrupt traceback). ``on_stop`` runs at the first signal
    (the router's pool then logs its workers' expected exits at INFO)."""

    on_stop: Callable[[], None] | None = None
    parent: ParentWatch | None = None  # the launcher; gone: exit at once, quietly

    def capture_signals(self) -> contextlib.AbstractContextManager[None]:
        return handled_signals(self.handle_exit, STOP_SIGNALS)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.parent is not None and self.parent.gone():  # the launcher died (ParentWatch)
            log.info("%s: the launcher (pid %d) is gone; exiting now",
                     signal.Signals(sig).name, self.parent.parent)
            exit_now(0)
        if not self.should_exit:
            self.should_exit = True
            if self.on_stop is not None:
                self.on_stop()
        elif sig == signal.SIGINT:  # a second Ctrl-C: stop at once (exit_now: no traceback)
            log.warning("SIGINT again: stopping now (open streams are cut)")
            exit_now(0)
        else:
            log.info("%s while stopping: ignored (open streams finish first)",
                     signal.Signals(sig).name)


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
    parent = ParentWatch()
    for sig in STOP_SIGNALS:
        signal.signal(sig, quit_before_serving)
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.replicas < 1:
        print("k3serve router: --replicas: must be >= 1", file=sys.stderr)
        return 2
    try:
        config = config_from_args(args)
    except ValueError as e:
        print(f"k3serve router: {e}", file=sys.stderr)
        return 2
    if args.fd is not None:  # a replica: the supervisor's socket
        sock = socket.socket(fileno=args.fd)
        set_title(f"k3serve router replica {args.replica_index} :{sock.getsockname()[1]}")
    else:
        try:
            sock = listen(args.host, args.port)
        except OSError as e:
            why = ("address already in use" if e.errno == errno.EADDRINUSE
                   else e.strerror or str(e))
            print(f"k3serve router: cannot listen on {args.host}:{args.port}: {why}",
                  file=sys.stderr)
            return 1
        set_title(f"k3serve router :{sock.getsockname()[1]}")
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
    app = create_app(config)
    server = StoppingServer(uvicorn.Config(
        app, log_level=args.log_level, http=ROUTER_HTTP, loop=ROUTER_LOOP,
        access_log=not isinstance(level, int) or level <= logging.INFO))
    server.on_stop, server.parent = app.state.router.pool.begin_stop, parent
    tracing.configure("k3serve-router", config.otlp_traces_endpoint)
    tune_gc()
    fix_mmap_threshold()
    try:
        server.run(sockets=[sock])
    finally:
        tracing.shutdown()  # flushes the spans not yet exported
        sock.close()
        for sig in STOP_SIGNALS:  # the process is ending: a late signal changes nothing
            signal.signal(sig, signal.SIG_IGN)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
