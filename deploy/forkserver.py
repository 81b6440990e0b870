"""Start components as forks of a process that has already imported their dependencies.

A worker spends about 1.9 of the 2.0 CPU-seconds of its start on a CPU importing torch, numpy,
FastAPI, pydantic and uvicorn. The local backend (deploy/local.py) therefore starts one
**fork server** per launcher — ``python -m deploy.forkserver FD``, titled ``k3serve forkserver``
— which imports :data:`PRELOAD` once and then forks one child per component. A child becomes
``python -m MODULE ARGS``: its environment replaced by the one asked for, its working directory
and ``sys.argv`` set, stdout and stderr on its log file (or the launcher's), then
:func:`runpy.run_module` runs ``MODULE`` as ``__main__`` and the child exits the way that
interpreter would (``SystemExit``'s status, 1 after a traceback).

What a child keeps of a fresh ``python -m``:

* It ignores SIGINT until it sets its own handler and gets SIGTERM when its parent dies
  (``PR_SET_PDEATHSIG``), as :func:`k3serve.process.start_component` arranges for a
  ``subprocess.Popen`` child. The server ignores SIGINT and SIGTERM (a terminal's Ctrl-C and a
  SIGTERM to the process group are for the launcher and the components, which drain) and exits
  when the launcher does: end of file on its socket, whose other end only the launcher holds.
  A SIGKILLed launcher therefore still leaves nothing behind.
* Start-time interpreter settings come from the environment the server started with. A server
  serves only spawns whose :func:`server_key` (the ``PYTHON*`` variables, the thread-pool and
  library-loading variables torch and numpy read when imported) equals its own; another key
  gets a server of its own.
* ``ps`` shows ``k3serve MODULE (starting)`` until the component sets its title
  (:func:`k3serve.process.set_title`); ``/proc/PID/environ`` shows the environment the server
  started with (setproctitle leaves it alone).
* numpy's global generator is reseeded from the OS (Python's ``random`` reseeds itself on
  fork); torch's default generator starts from its fixed seed, as in a fresh process. Unless
  ``PYTHONHASHSEED`` is set, every component shares the server's string-hash secret.
* stdin is ``/dev/null``; a working directory that does not exist, or a log file that cannot
  be opened, makes the spawn raise ``OSError`` and no process is started.

The wire: JSON lines over a Unix socket pair. The launcher sends ``{"op": "spawn", "id",
"module", "args", "env", "cwd", "log"}`` and ``{"op": "signal", "pid", "sig"}``; the server
sends ``{"op": "ready"}`` once its imports are done, ``{"op": "started", "id", "pid"}``
or ``{"op": "failed", "id", "error"}`` per spawn, and ``{"op": "exited", "pid", "code"}``
(:func:`os.waitstatus_to_exitcode`: negative for a signal) when it reaps a child. Signals go
through the server, which sends them only to children it has not reaped: a pid the kernel
reused is never signalled.

Setting ``K3SERVE_FORKSERVER=0`` makes the local backend start each component with
``subprocess.Popen`` instead (nothing preloaded).
"""

from __future__ import annotations

import contextlib
import json
import os
import runpy
import select
import selectors
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Mapping
from typing import Any

from k3serve.process import die_with_parent, ignore_sigint, set_title

#: Modules the server imports before its first fork: what the router and the workers import
#: at start that costs the most CPU (``python -X importtime``). Missing ones are skipped.
PRELOAD = ("torch", "numpy", "fastapi", "pydantic", "starlette", "uvicorn", "httpx",
           "sse_starlette", "prometheus_client", "setproctitle", "yaml")

#: Environment variables read when the interpreter starts or when :data:`PRELOAD` is imported,
#: by prefix: spawns whose values differ need a server of their own (:func:`server_key`).
START_ENV_PREFIXES = ("PYTHON", "OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_", "NUMPY_", "NPY_",
                      "TORCH", "PYTORCH_", "LD_", "MALLOC_", "GLIBC_TUNABLES", "LC_", "LANG",
                      "PROMETHEUS_MULTIPROC_DIR")

#: ``K3SERVE_FORKSERVER=0``: the local backend starts components with ``subprocess.Popen``.
ENABLE_ENV = "K3SERVE_FORKSERVER"

#: Seconds the launcher waits for a server's imports (``ready``) and for a spawn's answer.
READY_TIMEOUT_S = 120.0
SPAWN_TIMEOUT_S = 30.0


def enabled(env: Mapping[str, str] | None = None) -> bool:
    """Whether components are started through a fork server: on Linux, unless
    ``K3SERVE_FORKSERVER=0`` (in ``env``, default ``os.environ``)."""
    env = os.environ if env is None else env
    return sys.platform.startswith("linux") and env.get(ENABLE_ENV, "1") != "0"


def server_key(env: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """The part of ``env`` a server must have started with to serve it: the variables of
    :data:`START_ENV_PREFIXES`, sorted."""
    return tuple(sorted((k, v) for k, v in env.items() if k.startswith(START_ENV_PREFIXES)))


# --------------------------------------------------------------------------- launcher side
class ForkedProcess:
    """A component forked by a :class:`ForkServer`, with the part of ``subprocess.Popen``'s
    interface the launcher and the supervisor use: ``pid``, ``args`` (the equivalent
    ``[python, "-m", module, *args]``), ``returncode``, ``poll``, ``wait``, ``send_signal``,
    ``terminate``, ``kill``."""

    def __init__(self, server: ForkServer, pid: int) -> None:
        self.pid = pid
        self.args: list[str] = []
        self.returncode: int | None = None
        self._server = server
        self._done = threading.Event()

    def mark_exited(self, code: int) -> None:
        """Record the exit status the server reported (:meth:`ForkServer._reader`)."""
        self.returncode = code
        self._done.set()

    def poll(self) -> int | None:
        """The exit status once the server reaped the child (negative: killed by that
        signal), else ``None``."""
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Block until the child exits; its exit status.

        Raises:
            subprocess.TimeoutExpired: still running after ``timeout`` seconds.
        """
        if not self._done.wait(timeout):
            raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        """Send ``sig`` to the child unless it has exited."""
        if self.returncode is None:
            self._server.signal(self.pid, sig)

    def terminate(self) -> None:
        """SIGTERM."""
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL."""
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """The launcher's handle on one fork server process (``python -m deploy.forkserver``).

    Args:
        env: the server's environment (that of the first component it starts; later spawns
            must have the same :func:`server_key`).

    Raises:
        OSError: the server could not start or did not finish its imports in
            :data:`READY_TIMEOUT_S` seconds.
    """

    def __init__(self, env: Mapping[str, str]) -> None:
        self.key = server_key(env)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "deploy.forkserver", str(theirs.fileno())],
                pass_fds=(theirs.fileno(),), env=dict(env), stdin=subprocess.DEVNULL,
                preexec_fn=ignore_sigint)  # noqa: PLW1509 - one libc call
        finally:
            theirs.close()
        self._sock = ours
        self._lines = ours.makefile("rb")
        self._send_lock = threading.Lock()
        self._cond = threading.Condition()
        self._answers: dict[int, dict[str, Any]] = {}
        self._children: dict[int, ForkedProcess] = {}
        self._abandoned: set[int] = set()  # spawns whose caller timed out
        self._next_id = 0
        self.alive = True
        ours.settimeout(READY_TIMEOUT_S)
        try:
            ready = self._read()
        except OSError:  # socket.timeout
            ready = None
        ours.settimeout(None)
        if ready is None or ready.get("op") != "ready":
            self.close()
            raise OSError(f"k3serve fork server did not start (exit status {self.proc.poll()})")
        self.pid = self.proc.pid
        threading.Thread(target=self._reader, name="forkserver-reader", daemon=True).start()

    @classmethod
    def shared(cls, env: Mapping[str, str]) -> ForkServer:
        """This process's server for ``env``'s :func:`server_key`, started on first use and
        again after it died."""
        key = server_key(env)
        with _SHARED_LOCK:
            server = _SHARED.get(key)
            if server is None or not server.alive:
                server = _SHARED[key] = cls(env)
            return server

    def _read(self) -> dict[str, Any] | None:
        line = self._lines.readline()
        return json.loads(line) if line else None

    def _send(self, msg: dict[str, Any]) -> None:
        data = json.dumps(msg).encode() + b"\n"
        with self._send_lock:
            self._sock.sendall(data)

    def _reader(self) -> None:
        """Route the server's messages: spawn answers to their callers, exits to their
        :class:`ForkedProcess`. At end of file (the server died) every child it had is
        taken as ended by SIGTERM, the death signal it got."""
        try:
            while (msg := self._read()) is not None:
                with self._cond:
                    if msg["op"] == "exited":
                        child = self._children.pop(msg["pid"], None)
                        if child is not None:
                            child.mark_exited(int(msg["code"]))
                        continue
                    if msg["op"] == "started":
                        msg["child"] = self._children[msg["pid"]] = ForkedProcess(
                            self, msg["pid"])
                    if msg["id"] in self._abandoned:  # its caller gave up waiting
                        self._abandoned.discard(msg["id"])
                        if msg["op"] == "started":
                            msg["child"].kill()
                        continue
                    self._answers[msg["id"]] = msg
                    self._cond.notify_all()
        except (OSError, ValueError, KeyError, TypeError):
            pass
        finally:
            with self._cond:
                self.alive = False
                for child in self._children.values():
                    child.mark_exited(-signal.SIGTERM)
                self._children.clear()
                self._cond.notify_all()

    def spawn(self, module: str, args: list[str], env: Mapping[str, str],
              cwd: str | None = None, log: str | None = None) -> ForkedProcess:
        """Fork ``python -m {module} {args}`` with exactly ``env`` as its environment, in
        ``cwd`` (default: this process's working directory), stdout and stderr appended to
        ``log`` (``None``: the launcher's).

        Raises:
            ValueError: ``env``'s :func:`server_key` is not this server's.
            OSError: the server is gone, did not answer in :data:`SPAWN_TIMEOUT_S` seconds, or
                could not open ``log`` or fork.
        """
        if server_key(env) != self.key:
            raise ValueError("env: its start-time variables differ from this fork server's")
        with self._cond:
            self._next_id += 1
            rid = self._next_id
        try:
            self._send({"op": "spawn", "id": rid, "module": module, "args": list(args),
                        "env": dict(env), "cwd": cwd or os.getcwd(), "log": log})
        except OSError as e:
            raise OSError(f"k3serve fork server is gone: {e}") from e
        with self._cond:
            if not self._cond.wait_for(lambda: rid in self._answers or not self.alive,
                                       SPAWN_TIMEOUT_S):
                self._abandoned.add(rid)  # killed if it starts after all
                raise OSError(f"k3serve fork server: no answer to starting {module}")
            answer = self._answers.pop(rid, None)
            if answer is None:
                raise OSError(f"k3serve fork server died while starting {module}")
            if answer["op"] == "failed":
                raise OSError(f"k3serve fork server could not start {module}: "
                              f"{answer['error']}")
            child = answer["child"]
            child.args = [sys.executable, "-m", module, *args]
            return child

    def signal(self, pid: int, sig: int) -> None:
        """Ask the server to send ``sig`` to its child ``pid`` (nothing once it was reaped or
        the server is gone)."""
        with contextlib.suppress(OSError):
            self._send({"op": "signal", "pid": pid, "sig": int(sig)})

    def close(self, timeout: float = 5.0) -> None:
        """Close the socket: the server exits, and children still running get SIGTERM."""
        with self._cond:
            self.alive = False
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._lines.close()
        self._sock.close()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


#: This process's servers by :func:`server_key` (:meth:`ForkServer.shared`).
_SHARED: dict[tuple[tuple[str, str], ...], ForkServer] = {}
_SHARED_LOCK = threading.Lock()


# --------------------------------------------------------------------------- server side
def _serve(sock: socket.socket) -> tuple[dict[str, Any], int | None] | None:
    """The server's loop. Returns ``(request, log_fd)`` in a forked child, ``None`` in the
    server once the launcher closed its end."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes select() through wake_w
    sel = selectors.DefaultSelector()
    sel.register(sock, selectors.EVENT_READ)
    sel.register(wake_r, selectors.EVENT_READ)
    live: set[int] = set()
    me = os.getpid()

    def send(msg: dict[str, Any]) -> None:
        with contextlib.suppress(OSError):
            sock.sendall(json.dumps(msg).encode() + b"\n")

    send({"op": "ready"})
    buf = b""
    while True:
        for key, _ in sel.select():
            if key.fileobj is wake_r:
                with contextlib.suppress(BlockingIOError):
                    os.read(wake_r, 4096)
                while live:
                    try:
                        pid, status = os.waitpid(-1, os.WNOHANG)
                    except ChildProcessError:
                        break
                    if pid == 0:
                        break
                    if pid in live:
                        live.discard(pid)
                        send({"op": "exited", "pid": pid,
                              "code": os.waitstatus_to_exitcode(status)})
                continue
            try:
                data = sock.recv(1 << 16)
            except OSError:  # ECONNRESET: the launcher is gone as well
                data = b""
            if not data:  # the launcher is gone
                return None
            buf += data
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                msg = json.loads(line)
                if msg["op"] == "signal":
                    if msg["pid"] in live:
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(msg["pid"], msg["sig"])
                    continue
                log_fd = None
                if not os.path.isdir(msg["cwd"]):
                    send({"op": "failed", "id": msg["id"],
                          "error": f"cwd: no such directory: {msg['cwd']}"})
                    continue
                try:
                    if msg["log"]:
                        log_fd = os.open(msg["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND,
                                         0o644)
                    for stream in (sys.stdout, sys.stderr):
                        if stream is not None:
                            stream.flush()
                    pid = os.fork()
                except OSError as e:
                    if log_fd is not None:
                        os.close(log_fd)
                    send({"op": "failed", "id": msg["id"], "error": str(e)})
                    continue
                if pid == 0:  # the child: drop the server's state
                    signal.set_wakeup_fd(-1)
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    signal.signal(signal.SIGTERM, signal.SIG_DFL)
                    sel.close()
                    sock.close()
                    os.close(wake_r)
                    os.close(wake_w)
                    _die_with(me)
                    return msg, log_fd
                if log_fd is not None:
                    os.close(log_fd)
                live.add(pid)
                send({"op": "started", "id": msg["id"], "pid": pid})


def _die_with(server_pid: int) -> None:
    """SIGTERM to this child when the server dies; exit at once if it already has."""
    die_with_parent(signal.SIGTERM)
    if os.getppid() != server_pid:
        os._exit(0)


def _become(msg: dict[str, Any], log_fd: int | None) -> None:
    """Turn this forked child into ``python -m {module} {args}`` and run it."""
    if log_fd is not None:
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        os.close(log_fd)
    env = msg["env"]
    os.environ.clear()
    os.environ.update(env)
    os.chdir(msg["cwd"])
    if not sys.flags.safe_path:  # ``python -m``'s first entry: its working directory
        sys.path[0] = msg["cwd"]
    sys.dont_write_bytecode = bool(env.get("PYTHONDONTWRITEBYTECODE"))
    if env.get("PYTHONUNBUFFERED") and sys.stdout is not None:
        sys.stdout.reconfigure(line_buffering=True, write_through=True)
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    set_title(f"k3serve {msg['module']} (starting)")
    sys.argv = [msg["module"], *msg["args"]]
    runpy.run_module(msg["module"], run_name="__main__", alter_sys=True)


def _exit_at_eof(sock: socket.socket, stop_r: int) -> None:
    """While the server imports: exit at once if the launcher closes its end first (the
    launcher stopped or died during its own start-up); return when ``stop_r`` is readable or
    a request is waiting."""
    ready, _, _ = select.select([sock, stop_r], [], [])
    if sock in ready:
        try:
            gone = not sock.recv(1, socket.MSG_PEEK)
        except OSError:
            gone = True
        if gone:
            os._exit(0)


def main(argv: list[str] | None = None) -> None:
    """``python -m deploy.forkserver FD``: import :data:`PRELOAD`, then serve the launcher on
    the socket ``FD``; in each forked child, run the component asked for. The server exits
    (``os._exit``: nothing to finalize) as soon as the launcher is gone, so its children get
    their death signal at once."""
    argv = sys.argv[1:] if argv is None else argv
    sock = socket.socket(fileno=int(argv[0]))
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    stop_r, stop_w = os.pipe()
    watch = threading.Thread(target=_exit_at_eof, args=(sock, stop_r), daemon=True)
    watch.start()
    for name in PRELOAD:
        with contextlib.suppress(ImportError):
            __import__(name)
    set_title("k3serve forkserver")
    os.write(stop_w, b"x")
    watch.join()  # no thread but this one when the server forks
    os.close(stop_r)
    os.close(stop_w)
    child = _serve(sock)
    if child is None:
        for stream in (sys.stdout, sys.stderr):
            if stream is not None:
                stream.flush()
        os._exit(0)
    _become(*child)


if __name__ == "__main__":
    main()
