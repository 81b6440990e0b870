"""A component stand-in for tests/deploy/test_forkserver.py: ``python -m
tests.deploy.forkserver_child OUT [CODE] [--wait]`` writes what it sees of its start (argv,
working directory, environment, SIGINT's handler, a numpy draw, its parent-death signal) to the
JSON file OUT, prints one line, then exits with status CODE (default 0) — or, with ``--wait``,
blocks until a signal ends it."""

from __future__ import annotations

import json
import os
import signal
import sys


def main() -> None:
    from k3serve.process import death_signal

    out, *rest = sys.argv[1:]
    wait = "--wait" in rest
    rest = [a for a in rest if a != "--wait"]
    import numpy as np

    seen = {"argv": sys.argv, "cwd": os.getcwd(), "env": dict(os.environ), "pid": os.getpid(),
            "ppid": os.getppid(), "sigint_ignored": signal.getsignal(signal.SIGINT) is signal.SIG_IGN,
            "sigterm_default": signal.getsignal(signal.SIGTERM) is signal.SIG_DFL,
            "death_signal": death_signal(), "draw": int(np.random.randint(0, 2**31)),
            "path0": sys.path[0], "main": __name__}
    with open(out + ".tmp", "w") as f:
        json.dump(seen, f)
    os.replace(out + ".tmp", out)
    print(f"child {os.getpid()} started", flush=True)
    if wait:
        signal.pause()
    sys.exit(int(rest[0]) if rest else 0)


if __name__ == "__main__":
    main()
