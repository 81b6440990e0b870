"""deploy/forkserver.py: a forked component starts as ``python -m MODULE ARGS`` would — its
own argv, working directory, exact environment, log file and exit status — ignores SIGINT until
it sets a handler, dies with the server, and the server dies with its launcher. The component is
tests/deploy/forkserver_child.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deploy import forkserver
from deploy.forkserver import ForkServer, server_key
from tests.parallel.ray_cluster import alive

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="the fork server runs on Linux only")

ROOT = Path(__file__).resolve().parents[2]
CHILD = "tests.deploy.forkserver_child"


def _wait_for(path: Path, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never written"
        time.sleep(0.05)
    return json.loads(path.read_text())


@pytest.fixture(scope="module")
def server():
    s = ForkServer(dict(os.environ))
    yield s
    s.close()


def test_a_child_starts_as_python_m_would(server, tmp_path):
    env = {**os.environ, "K3_FS_ONLY_HERE": "yes"}
    env.pop("HOME", None)
    log = tmp_path / "child.log"
    log.write_text("earlier run\n")
    p = server.spawn(CHILD, [str(tmp_path / "a.json"), "3"], env, cwd=str(ROOT), log=str(log))
    assert p.wait(30) == 3 and p.poll() == 3 and p.returncode == 3
    seen = json.loads((tmp_path / "a.json").read_text())
    assert seen["argv"][1:] == [str(tmp_path / "a.json"), "3"]
    assert seen["argv"][0].endswith("forkserver_child.py") and seen["main"] == "__main__"
    assert seen["cwd"] == str(ROOT) and seen["path0"] == str(ROOT)
    # exactly the environment asked for (SPT_NOENV: set by k3serve.process.set_title)
    def titled(e: dict) -> dict:
        return {k: v for k, v in e.items() if k != "SPT_NOENV"}

    assert titled(seen["env"]) == titled(env)
    assert seen["ppid"] == server.pid and seen["pid"] == p.pid
    assert seen["sigint_ignored"] and seen["sigterm_default"]
    assert seen["death_signal"] == signal.SIGTERM
    assert log.read_text() == f"earlier run\nchild {p.pid} started\n"  # appended
    assert p.args == [sys.executable, "-m", CHILD, str(tmp_path / "a.json"), "3"]


def test_signals_wait_and_numpy_draws(server, tmp_path):
    kids = [server.spawn(CHILD, [str(tmp_path / f"{i}.json"), "--wait"], dict(os.environ),
                         cwd=str(ROOT)) for i in range(2)]
    draws = {_wait_for(tmp_path / f"{i}.json")["draw"] for i in range(2)}
    assert len(draws) == 2  # numpy reseeded in each child
    with pytest.raises(subprocess.TimeoutExpired):
        kids[0].wait(0.2)
    assert kids[0].poll() is None
    kids[0].terminate()
    kids[1].kill()
    assert kids[0].wait(10) == -signal.SIGTERM and kids[1].wait(10) == -signal.SIGKILL
    kids[1].kill()  # reaped: nothing is sent


def test_bad_requests_are_errors_not_children(server, tmp_path):
    other = {**os.environ, "PYTHONHASHSEED": "123"}
    assert server_key(other) != server.key
    with pytest.raises(ValueError, match="env"):
        server.spawn(CHILD, [str(tmp_path / "x.json")], other)
    with pytest.raises(OSError, match="could not start"):
        server.spawn(CHILD, [], dict(os.environ), log=str(tmp_path / "no" / "such" / "dir.log"))
    # a module that does not exist fails like `python -m`: status 1, the error on stderr
    log = tmp_path / "missing.log"
    p = server.spawn("no_such_module_k3", [], dict(os.environ), cwd=str(ROOT), log=str(log))
    assert p.wait(30) == 1 and "No module named" in log.read_text()


def test_shared_servers_are_per_start_time_environment():
    env = {**os.environ, "PYTHONHASHSEED": "7"}
    a = ForkServer.shared(env)
    try:
        assert ForkServer.shared(dict(env, K3SERVE_OTHER="x")) is a  # not a start-time var
        assert ForkServer.shared(dict(os.environ)) is not a
    finally:
        a.close()
    assert ForkServer.shared(env) is not a  # a closed server is replaced
    ForkServer.shared(env).close()


def test_closing_the_server_ends_its_children(tmp_path):
    s = ForkServer(dict(os.environ))
    p = s.spawn(CHILD, [str(tmp_path / "c.json"), "--wait"], dict(os.environ), cwd=str(ROOT))
    _wait_for(tmp_path / "c.json")
    s.close()
    assert p.wait(10) == -signal.SIGTERM  # as the reader reports it, and the kernel did
    deadline = time.monotonic() + 10
    while alive(p.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(p.pid) and not alive(s.pid)


LAUNCHER = """
import json, os, sys, time
from deploy.forkserver import ForkServer
s = ForkServer(dict(os.environ))
p = s.spawn({child!r}, [sys.argv[1], "--wait"], dict(os.environ))
print(json.dumps({{"server": s.pid, "child": p.pid}}), flush=True)
time.sleep(600)
"""


def test_a_killed_launcher_leaves_neither_server_nor_children(tmp_path):
    """SIGKILL of the process that started the server: the server sees the end of its socket
    and exits, and its children get their death signal."""
    out = tmp_path / "k.json"
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER.format(child=CHILD), str(out)],
                                cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        pids = json.loads(launcher.stdout.readline())
        _wait_for(out)
        assert alive(pids["server"]) and alive(pids["child"])
        launcher.kill()
        launcher.wait()
        deadline = time.monotonic() + 10
        while (alive(pids["server"]) or alive(pids["child"])) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(pids["server"]) and not alive(pids["child"])
    finally:
        if launcher.poll() is None:
            launcher.kill()


def test_disabled_by_the_environment():
    assert forkserver.enabled({}) == sys.platform.startswith("linux")
    assert not forkserver.enabled({forkserver.ENABLE_ENV: "0"})


def test_concurrent_spawns_and_a_missing_working_directory(server, tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    def one(i: int) -> int:
        p = server.spawn(CHILD, [str(tmp_path / f"t{i}.json"), str(i)], dict(os.environ),
                         cwd=str(ROOT))
        return p.wait(60)

    with ThreadPoolExecutor(6) as ex:
        assert list(ex.map(one, range(6))) == list(range(6))
    with pytest.raises(OSError, match="cwd"):
        server.spawn(CHILD, [str(tmp_path / "n.json")], dict(os.environ),
                     cwd=str(tmp_path / "gone"))


def test_a_child_gets_sigterm_when_the_server_dies(tmp_path):
    """A forked component's parent is the server and its parent-death signal SIGTERM: a
    server killed alone takes its children with it (k3serve.process.ParentWatch then reads
    the parent as gone)."""
    s = ForkServer(dict(os.environ))
    p = s.spawn(CHILD, [str(tmp_path / "w.json"), "--wait"], dict(os.environ), cwd=str(ROOT))
    seen = _wait_for(tmp_path / "w.json")
    assert seen["ppid"] == s.pid and seen["death_signal"] == signal.SIGTERM
    os.kill(s.pid, signal.SIGKILL)  # the server alone: its children get SIGTERM
    assert p.wait(10) == -signal.SIGTERM
    deadline = time.monotonic() + 10
    while alive(p.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(p.pid)
