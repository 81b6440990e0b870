"""``make test``: the whole suite in its three phases (``tests/conftest.py`` lists the files of
the ``serial`` and ``stacks`` phases and why they are apart).

* ``serial`` — tests that bound a latency or a fault's handling time — then ``stacks`` —
  worker processes, fake and live stacks, Ray clusters, process groups — each on two
  pytest-xdist workers, one file per worker at a time. These two never overlap. The
  ``serial`` files spend their time waiting (fake workers' token delays, stopped workers,
  timeouts; about half of one core for the whole phase), so two of them side by side keep
  their measurements.
* Beside them, from the start, the in-process tests on two workers under ``SCHED_IDLE`` (nice
  19 where that is refused): the kernel gives them the CPU time the other phases leave idle
  (the ``serial`` tests are mostly waiting on fake workers' token delays and timeouts, the
  ``stacks`` tests on process start-ups), so the suite's wall time comes close to its CPU
  time over the cores. An in-process test may wait a long time for a core while the other
  phases keep both busy; tests whose servers and clients talk under timeouts are therefore
  ``stacks`` tests.

The in-process phase prints as it runs; the other two write to files printed after it (in
phase order). Every phase runs; the exit status is the first failing phase's, else 0. A Ctrl-C
reaches every pytest process (one process group) and this waits for them to stop.

``--sequential`` runs the phases one after another in the foreground (in-process, stacks,
serial). Arguments after ``--`` go to every pytest run.
"""

from __future__ import annotations

import argparse
import os
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


def _low_priority() -> None:
    """In the forked child: the ``SCHED_IDLE`` policy, else nice 19."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        os.nice(19)


def _pytest(args: list[str], extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "pytest", *COMMON, *args, *extra, "tests"]


def _sequential(extra: list[str]) -> int:
    rc = 0
    for args in (IN_PROCESS, STACKS, SERIAL):
        code = subprocess.call(_pytest(args, extra), cwd=ROOT)
        rc = rc or code
    return rc


def _overlapped(extra: list[str]) -> int:
    with tempfile.TemporaryDirectory(prefix="k3serve-suite-") as tmp:
        logs = {name: Path(tmp) / f"{name}.log" for name in ("serial", "stacks")}
        codes: dict[str, int] = {}
        current: list[subprocess.Popen] = []
        stopping = threading.Event()

        def chain() -> None:
            # the serial phase first: it is the lightest on CPU, so the in-process tests get
            # the most of the machine while they start; then the stacks phase
            for name, args in (("serial", SERIAL), ("stacks", STACKS)):
                if stopping.is_set():
                    return
                t0 = time.monotonic()
                with open(logs[name], "wb") as log:
                    p = subprocess.Popen(_pytest(args, extra), cwd=ROOT, stdout=log,
                                         stderr=subprocess.STDOUT)
                    current.append(p)
                    codes[name] = p.wait()
                with open(logs[name], "ab") as log:
                    log.write(f"({name} phase: {time.monotonic() - t0:.0f} s wall)\n".encode())

        # started before the thread: a preexec_fn runs in the forked child, safe only while
        # this process has one thread
        in_process = subprocess.Popen(_pytest(IN_PROCESS, extra), cwd=ROOT,
                                      preexec_fn=_low_priority)  # noqa: PLW1509
        background = threading.Thread(target=chain, name="phases")
        background.start()
        try:
            codes["in-process"] = in_process.wait()
            if background.is_alive():
                print("\nwaiting for the stacks and serial phases "
                      "(their output follows when they end) ...", flush=True)
            background.join()
        except KeyboardInterrupt:
            # the terminal's SIGINT reached every pytest of the group; let them stop
            stopping.set()
            for p in [in_process, *current]:
                try:
                    p.wait(60)
                except subprocess.TimeoutExpired:
                    p.kill()
            background.join(60)
            return 130
        for name in ("serial", "stacks"):
            print(f"\n{'=' * 30} {name} phase {'=' * 30}", flush=True)
            sys.stdout.buffer.write(logs[name].read_bytes())
            sys.stdout.flush()
        return next((codes[n] for n in ("in-process", "serial", "stacks")
                     if codes.get(n, 1) != 0), 0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sequential", action="store_true",
                    help="run the phases one after another in the foreground")
    ap.add_argument("pytest_args", nargs="*", help="after --: passed to every pytest run")
    args = ap.parse_args(argv)
    return (_sequential if args.sequential else _overlapped)(args.pytest_args)


if __name__ == "__main__":
    sys.exit(main())
