"""``make test``: the whole suite in its three phases (``tests/conftest.py`` lists the files of
the ``serial`` and ``stacks`` phases and why they are apart).

* ``serial`` — tests that bound a latency or a fault's handling time — then ``stacks`` —
  worker processes, fake and live stacks, Ray clusters, process groups — each on two
  pytest-xdist workers, one file per worker at a time. These two never overlap. The
  ``serial`` files spend their time waiting (fake workers' token delays, stopped workers,
  timeouts; about half of one core for the whole phase), so two of them side by side keep
  their measurements.
* Beside them, from the start, the in-process tests on two workers under ``SCHED_IDLE`` (nice
  19 where that is refused; tests/conftest.py sets it in each of the phase's pytest processes,
  and the processes their tests start inherit it): the kernel gives them the
  CPU time the other phases leave idle (the ``serial`` tests are mostly waiting on fake
  workers' token delays and timeouts, the ``stacks`` tests on process start-ups), so the
  suite's wall time comes close to its CPU time over the cores. An in-process test may wait
  a long time for a core while the other phases keep both busy, so a file whose servers and
  clients talk under timeouts (in one process or several) is a ``stacks`` file.

The in-process phase prints as it runs; the other two write to files printed after it (in
phase order). Every phase runs; the exit status is the first failing phase's, else 0 (a phase
that selects no test fails a full run, and passes one narrowed by extra arguments). Each
phase has a process group of its own: Ctrl-C, SIGTERM or SIGHUP to the runner is forwarded
to every phase, and what still runs two minutes later is killed.

``--sequential`` runs the phases one after another in the foreground (in-process, stacks,
serial). Arguments after ``--`` go to every pytest run (not ``-m``: the phases select by
marker); files or test ids among them replace the ``tests`` folder.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMON = ["-q", "-ra", "--durations=15"]
IN_PROCESS = ["-n", "2", "-m", "not serial and not stacks"]
STACKS = ["-n", "2", "--dist", "loadfile", "-m", "stacks"]
SERIAL = ["-n", "2", "--dist", "loadfile", "-m", "serial"]
#: set for the in-process phase: tests/conftest.py puts each of its pytest processes under
#: ``SCHED_IDLE``, and the processes its tests start inherit it, so nothing of that phase
#: takes CPU time the serial and stacks phases could use
IDLE_ENV = "K3SERVE_TEST_SCHED_IDLE"
#: seconds the phases get to stop after the runner forwards an interrupt, then SIGKILL
STOP_GRACE_S = 120.0


class Phases:
    """The pytest processes of a run. Each phase runs in a process group of its own (in this
    session: the scheduler's per-session group stays one), and the runner forwards SIGINT,
    SIGTERM or SIGHUP to every phase started (:meth:`interrupt`, its signal handler): after
    an interrupt no phase starts, and the groups still running after :data:`STOP_GRACE_S`
    get SIGKILL."""

    def __init__(self) -> None:
        self._lock = threading.RLock()  # the handler runs in the main thread, maybe inside
        self._procs: list[subprocess.Popen] = []
        self._signalled: set[int] = set()
        self.stopping: int | None = None

    def run(self, name: str, args: list[str], extra: list[str], log: Path | None = None,
            env: dict[str, str] | None = None) -> int:
        """Run one phase to its end; its exit status (128 + N if signal N ended it or
        interrupted the run before it started, 1 if it could not start)."""
        t0 = time.monotonic()
        out = open(log, "wb") if log is not None else None  # noqa: SIM115 - closed below
        try:
            with self._lock:
                if self.stopping is not None:
                    return 128 + self.stopping
                p = subprocess.Popen(_pytest(args, extra), cwd=ROOT, stdout=out,
                                     stderr=subprocess.STDOUT if out else None,
                                     env={**os.environ, **(env or {})}, process_group=0)
                self._procs.append(p)
                if self.stopping is not None:  # the handler ran while this one started
                    self._forward(p, self.stopping)
            code = p.wait()
        except OSError as e:
            msg = f"the {name} phase did not start: {e!r}\n"
            if out is not None:
                out.write(msg.encode())
            else:
                sys.stderr.write(msg)
            return 1
        finally:
            if out is not None:
                out.write(f"({name} phase: {time.monotonic() - t0:.0f} s wall)\n".encode())
                out.close()
        return 128 - code if code < 0 else code

    def _forward(self, p: subprocess.Popen, signum: int) -> None:
        if p.pid not in self._signalled and p.poll() is None:
            self._signalled.add(p.pid)
            try:
                os.killpg(p.pid, signum)
            except ProcessLookupError:
                pass

    def interrupt(self, signum: int, _frame: object = None) -> None:
        """Signal handler: forward the first interrupt to every phase's process group, start
        no more phases, SIGKILL what still runs :data:`STOP_GRACE_S` later."""
        with self._lock:
            if self.stopping is not None:
                return
            self.stopping = signum
            print(f"\n{signal.Signals(signum).name}: stopping every phase (up to "
                  f"{STOP_GRACE_S:.0f} s) ...", file=sys.stderr, flush=True)
            for p in self._procs:
                self._forward(p, signum)
        killer = threading.Timer(STOP_GRACE_S, self._kill_all)
        killer.daemon = True
        killer.start()

    def _kill_all(self) -> None:
        with self._lock:
            for p in self._procs:
                if p.poll() is None:
                    try:
                        os.killpg(p.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass


#: pytest's (and pytest-xdist's) short options that take a value: in a cluster such as
#: ``-qkname`` the rest of the cluster is that value
SHORT_WITH_VALUE = frozenset("kmcrpnWo")


def _pytest(args: list[str], extra: list[str]) -> list[str]:
    """The pytest command of a phase: its options, then ``extra``; the whole ``tests`` folder
    unless ``extra`` names files or test ids of its own."""
    paths = [] if any(_names_a_path(a) for a in extra) else ["tests"]
    return [sys.executable, "-m", "pytest", *COMMON, *args, *extra, *paths]


def _names_a_path(arg: str) -> bool:
    """Whether ``arg`` is a file, folder or test id (``FILE::NAME``) under the repository."""
    return not arg.startswith("-") and (ROOT / arg.split("::")[0]).exists()


def _selects_markers(arg: str) -> bool:
    """Whether ``arg`` is pytest's ``-m`` (alone, with its value, or inside a cluster of short
    options such as ``-qm``)."""
    if not arg.startswith("-") or arg.startswith("--"):
        return False
    for ch in arg[1:]:
        if ch == "m":
            return True
        if ch in SHORT_WITH_VALUE:  # the rest of the cluster is this option's value
            return False
    return False


def _status(codes: dict[str, int], order: tuple[str, ...], narrowed: bool) -> int:
    """The first failing phase's status, else 0; a phase that selected no test (pytest's 5)
    passes only when extra arguments narrowed the run."""
    for name in order:
        code = codes.get(name, 1)
        if code != 0 and not (narrowed and code == 5):
            return code
    return 0


def _sequential(phases: Phases, extra: list[str]) -> int:
    codes = {}
    for name, args in (("in-process", IN_PROCESS), ("stacks", STACKS), ("serial", SERIAL)):
        codes[name] = phases.run(name, args, extra)
    return _status(codes, ("in-process", "stacks", "serial"), bool(extra))


def _overlapped(phases: Phases, extra: list[str], tmp: Path) -> int:
    logs = {name: tmp / f"{name}.log" for name in ("serial", "stacks")}
    codes: dict[str, int] = {}

    def chain() -> None:
        # the serial phase first: it is the lightest on CPU, so the in-process tests get the
        # most of the machine while they start; then the stacks phase
        for name, args in (("serial", SERIAL), ("stacks", STACKS)):
            codes[name] = phases.run(name, args, extra, log=logs[name])

    background = threading.Thread(target=chain, name="phases")
    background.start()
    codes["in-process"] = phases.run("in-process", IN_PROCESS, extra, env={IDLE_ENV: "1"})
    if background.is_alive():
        print("\nwaiting for the serial and stacks phases "
              "(their output follows when they end) ...", flush=True)
    background.join()
    for name in ("serial", "stacks"):
        if logs[name].exists():
            print(f"\n{'=' * 30} {name} phase {'=' * 30}", flush=True)
            sys.stdout.buffer.write(logs[name].read_bytes())
            sys.stdout.flush()
    return _status(codes, ("in-process", "serial", "stacks"), bool(extra))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sequential", action="store_true",
                    help="run the phases one after another in the foreground")
    ap.add_argument("pytest_args", nargs="*", help="after --: passed to every pytest run")
    args = ap.parse_args(argv)
    if any(_selects_markers(a) for a in args.pytest_args):
        ap.error("-m: each phase selects its tests by marker; pass -k or other options")
    phases = Phases()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, phases.interrupt)
    with tempfile.TemporaryDirectory(prefix="k3serve-suite-") as tmp:
        if args.sequential:
            rc = _sequential(phases, args.pytest_args)
        else:
            rc = _overlapped(phases, args.pytest_args, Path(tmp))
    return 128 + phases.stopping if phases.stopping is not None else rc

if __name__ == "__main__":
    sys.exit(main())
