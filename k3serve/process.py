"""Process-level helpers shared by the launcher, the router and the workers.

* :func:`set_title` — the process title that ``ps`` shows (``k3serve serve``,
  ``k3serve router :8000``, ...); :func:`worker_title` a worker's
  (``k3serve prefill-worker :PORT``, ``k3serve decode-worker :PORT``,
  ``k3serve monolithic-worker :PORT``). setproctitle writes the title over the process's argv area;
  with ``SPT_NOENV`` set (the default here, unless the environment sets it) it leaves the
  environment block alone, so ``/proc/PID/environ`` stays readable and a long title is cut to
  the argv area's length.
* :func:`handled_signals` — route signals to a handler for the length of a ``with`` block
  (a server's run), then restore the previous handlers; nothing is re-raised afterwards.
* :class:`ParentWatch` — whether the launcher that started this process died (the kernel's
  parent-death signal found it reparented); :func:`die_with_parent` asks for that signal, and
  :func:`start_component` (a ``preexec_fn``) also starts the child with SIGINT ignored until
  it sets its own handler.
* :func:`exit_now` — end a process that has released what it holds without the interpreter's
  finalization (module teardown, the native destructors of torch and Mooncake: seconds of a
  stopping worker on a small machine); logging and stdio are flushed first.
* :func:`log_level`, :func:`device_name` — argparse types of the ``--log-level`` and
  ``--device`` flags the launcher, the router and the workers share; :func:`positive_int`,
  :func:`nonnegative_int`, :func:`positive_float`, :func:`nonnegative_float`,
  :func:`input_file` and :func:`output_file` — argparse types of counts, durations and files
  the commands and the benchmarks share; :func:`read_json_object` reads a JSON file a flag
  named, every failure one ``ValueError`` naming the flag and the file.
* :class:`CommandParser` — an ``argparse.ArgumentParser`` whose usage errors are one line;
  :func:`flag_message` spells the field an error names as the flag that set it, and
  :func:`writing` names the flag of a file that cannot be written.
* :class:`FlagParser` — an ``argparse.ArgumentParser`` that lists the actions of its arguments
  in ``flags``, so ``k3serve serve`` can pass the router's and the workers' own flags through
  without reading argparse's private fields.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import logging
import math
import os
import re
import signal
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from types import FrameType
from typing import Any, NoReturn

#: The launcher sets this in the environment of a worker whose role is not its module's:
#: ``monolithic`` for a decode worker that also prefills (``k3serve serve --monolithic N``).
TITLE_ROLE_ENV = "K3SERVE_TITLE_ROLE"


def worker_title(role: str, port: int) -> str:
    """``k3serve {role}-worker :{port}``, with ``role`` replaced by ``$K3SERVE_TITLE_ROLE``
    when the launcher set it (``k3serve monolithic-worker :PORT``)."""
    return f"k3serve {os.environ.get(TITLE_ROLE_ENV) or role}-worker :{port}"


def set_title(title: str) -> None:
    """Show ``title`` as this process's name in ``ps`` / ``top``."""
    os.environ.setdefault("SPT_NOENV", "1")
    from setproctitle import setproctitle

    setproctitle(title)


def exit_now(status: int = 0) -> NoReturn:
    """End this process with exit status ``status`` now: flush and close the logging handlers,
    flush stdout and stderr, then ``os._exit`` (no atexit handlers, no interpreter
    finalization). Call it only once the process has closed what others depend on (its
    sockets, its registrations, its exporters)."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(status)


def quit_before_serving(signum: int, frame: FrameType | None) -> None:
    """Handler of a stop signal that arrives before a component serves (while it builds its
    app or engine: nothing is open or held): exit 0 at once with :func:`exit_now`. A
    ``SystemExit`` raised from a handler could land in a weakref callback or a ``__del__``,
    which swallows it, and the process would go on starting."""
    exit_now(0)


def _load_libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return None


#: libc, loaded when this module is imported: a ``preexec_fn`` then only calls into it (a
#: ``dlopen`` in a forked child could wait forever on a loader lock another thread held).
#: ``None`` where there is no ``libc.so.6`` (not Linux).
LIBC = _load_libc()


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Linux: ask the kernel to send ``sig`` to this process when its parent dies (even by
    SIGKILL; ``prctl(PR_SET_PDEATHSIG)``). Elsewhere nothing."""
    if LIBC is not None:
        LIBC.prctl(1, int(sig))  # PR_SET_PDEATHSIG = 1


def ignore_sigint() -> None:
    """SIGINT ignored by this process, set through libc (safe in a forked child before exec,
    from any thread). An ignored signal stays ignored across exec, and Python then installs no
    ``KeyboardInterrupt`` handler: a Ctrl-C that reaches the process while it imports does
    nothing there, and the handler it sets later takes over. Elsewhere than Linux nothing."""
    if LIBC is not None:  # SIG_IGN = (void (*)(int)) 1
        LIBC.signal(int(signal.SIGINT), ctypes.c_void_p(1))


def start_component() -> None:  # pragma: no cover - runs in the child before exec
    """``preexec_fn`` of a k3serve component (router, replica, worker): it dies with its
    parent (SIGTERM, :func:`die_with_parent`) and ignores SIGINT until it sets its own handler
    (:func:`ignore_sigint`; its parent, which gets the same Ctrl-C, stops it). Two libc calls,
    nothing a thread of the forking process could hold."""
    if sys.platform.startswith("linux"):
        die_with_parent()
        ignore_sigint()

class ParentWatch:
    """Whether the launcher that started this process is gone. ``k3serve serve`` asks the
    kernel to SIGTERM its children when it dies (``PR_SET_PDEATHSIG``, deploy/local.py), even
    by SIGKILL; such a signal finds the child reparented. The router and the workers then exit
    at once, quietly: the rest of the stack (the store's master included) went with the
    launcher, so there is nothing to drain for, and closing a store client would only log
    Mooncake's errors about the master that is gone. Made at the process's start; a process
    started without the death signal (by hand, by Ray) is never taken as orphaned."""

    def __init__(self) -> None:
        self.parent = os.getppid()
        self.death_signal = death_signal()

    def gone(self) -> bool:
        """True when the parent asked for was replaced (the launcher died)."""
        return self.death_signal != 0 and os.getppid() != self.parent


def death_signal() -> int:
    """This process's parent-death signal (``prctl(PR_GET_PDEATHSIG)``; 0: none, or not
    Linux)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        sig = ctypes.c_int(0)
        if libc.prctl(2, ctypes.byref(sig)) != 0:  # PR_GET_PDEATHSIG = 2
            return 0
    except (OSError, AttributeError):
        return 0
    return sig.value


#: the ``--log-level`` values of the router and the workers (uvicorn's and Python logging's
#: common names, lower case)
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


def log_level(value: str) -> str:
    """``--log-level``'s argparse type: ``value`` lower-cased, one of :data:`LOG_LEVELS`.

    Raises:
        argparse.ArgumentTypeError: another name (argparse prints it as one usage line).
    """
    level = value.strip().lower()
    if level not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(
            f"must be one of {', '.join(LOG_LEVELS)} (got {value!r})")
    return level


def device_name(value: str) -> str:
    """``--device``'s argparse type: ``cpu``, ``cuda`` or ``cuda:N`` (N ≥ 0).

    Raises:
        argparse.ArgumentTypeError: anything else (argparse prints it as one usage line).
    """
    dev = value.strip().lower()
    kind, sep, index = dev.partition(":")
    if dev == "cpu" or (kind == "cuda" and (not sep or index.isdigit())):
        return dev
    raise argparse.ArgumentTypeError(f"must be cpu, cuda or cuda:N (got {value!r})")


def positive_int(value: str) -> int:
    """argparse type of a count: an integer ≥ 1.

    Raises:
        argparse.ArgumentTypeError: anything else (argparse names the flag).
    """
    return _int_at_least(value, 1)


def nonnegative_int(value: str) -> int:
    """argparse type of a count that may be 0: an integer ≥ 0.

    Raises:
        argparse.ArgumentTypeError: anything else (argparse names the flag).
    """
    return _int_at_least(value, 0)


def _int_at_least(value: str, lo: int) -> int:
    try:
        n = int(value)
    except ValueError:
        n = None
    if n is None or n < lo:
        raise argparse.ArgumentTypeError(f"must be an integer ≥ {lo}, got {value!r}")
    return n


def positive_float(value: str) -> float:
    """argparse type of a duration, rate or scale: a finite number > 0 (not nan, not inf).

    Raises:
        argparse.ArgumentTypeError: anything else (argparse names the flag).
    """
    return _finite_float(value, positive=True)


def nonnegative_float(value: str) -> float:
    """argparse type of a duration that may be 0: a finite number ≥ 0.

    Raises:
        argparse.ArgumentTypeError: anything else (argparse names the flag).
    """
    return _finite_float(value, positive=False)


def _finite_float(value: str, *, positive: bool) -> float:
    try:
        x = float(value)
    except ValueError:
        x = math.nan
    if not (math.isfinite(x) and (x > 0 if positive else x >= 0)):
        bound = "> 0" if positive else "≥ 0"
        raise argparse.ArgumentTypeError(f"must be a finite number {bound}, got {value!r}")
    return x


def input_file(value: str) -> str:
    """argparse type of a file the command reads: ``value`` when it opens for reading.

    Raises:
        argparse.ArgumentTypeError: ``cannot read PATH (reason)``, e.g. no such file, a folder.
    """
    try:
        with open(value, "rb"):
            pass
    except OSError as e:
        raise argparse.ArgumentTypeError(f"cannot read {value} ({e.strerror or e})") from None
    return value


def read_json_object(path: str, field: str) -> dict[str, Any]:
    """The JSON object in the file ``path``, which ``field`` (a flag or a config field) named.

    Raises:
        ValueError: ``FIELD: ...`` naming ``path``: the file cannot be read, is not JSON, or
            holds something other than an object.
    """
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except OSError as e:
        raise ValueError(f"{field}: cannot read {path} ({e.strerror or e})") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise ValueError(f"{field}: {path} is not valid JSON ({e})") from None
    if not isinstance(doc, dict):
        raise ValueError(f"{field}: {path} is not a JSON object")  # noqa: TRY004 (bad input)
    return doc


def output_file(value: str) -> str:
    """argparse type of a file the command writes at its end: ``value`` when its folder
    exists and is writable, so that a typo is refused before the run rather than after it.

    Raises:
        argparse.ArgumentTypeError: ``cannot write PATH (reason)``.
    """
    folder = os.path.dirname(value) or "."
    if not os.path.isdir(folder):
        reason = "Not a directory" if os.path.exists(folder) else "No such file or directory"
    elif os.path.isdir(value):
        reason = "Is a directory"
    elif not os.access(folder, os.W_OK | os.X_OK):
        reason = "Permission denied"
    else:
        return value
    raise argparse.ArgumentTypeError(f"cannot write {value} ({reason})")


class CommandParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose usage errors are one line on stderr,
    ``PROG: error: MESSAGE (PROG --help lists the flags)``, exit status 2 (argparse's own
    prints the whole usage first)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} ({self.prog} --help lists the flags)\n")


def flag_message(message: str, args: argparse.Namespace) -> str:
    """``message`` with the field it starts with spelled as the command-line flag of ``args``
    that set it: ``rate: must be > 0`` becomes ``--rate: must be > 0`` and
    ``SamplingParams.max_tokens: ...`` becomes ``--max-tokens: ...`` when ``args`` has a
    ``rate`` / ``max_tokens``; a message whose field is no flag of ``args`` is returned as is.
    The flags are taken to be spelled ``--`` + the attribute with ``-`` for ``_``."""
    m = re.match(r"(?:[A-Za-z]\w*\.)?([a-z][a-z0-9_-]*): ", message)
    if m and m.group(1).replace("-", "_") in vars(args):
        return "--" + m.group(1).replace("_", "-") + message[m.end(1):]
    return message


@contextlib.contextmanager
def writing(flag: str, path: str | os.PathLike[str]) -> Iterator[None]:
    """An ``OSError`` inside the block (writing ``path``, which ``flag`` named) becomes
    ``ValueError("FLAG: cannot write PATH (reason)")``."""
    try:
        yield
    except OSError as e:
        raise ValueError(f"{flag}: cannot write {path} ({e.strerror or e})") from None


class FlagParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose ``flags`` lists every action ``add_argument`` created, in
    order (``-h`` included)."""

    def add_argument(self, *args, **kwargs) -> argparse.Action:  # type: ignore[override]
        action = super().add_argument(*args, **kwargs)
        if "flags" not in self.__dict__:  # ArgumentParser.__init__ adds -h before ours runs
            self.flags: list[argparse.Action] = []
        self.flags.append(action)
        return action


@contextlib.contextmanager
def handled_signals(handler: Callable[[int, FrameType | None], None],
                    signals: Iterable[signal.Signals]) -> Iterator[None]:
    """Install ``handler`` for ``signals`` while the block runs and restore the old handlers
    after it. Off the main thread (where Python cannot set handlers) it changes nothing.
    Unlike uvicorn's ``Server.capture_signals`` it does not re-raise a handled signal at the
    end (which ends a process with -15, or with a KeyboardInterrupt traceback)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {s: signal.signal(s, handler) for s in signals}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)
