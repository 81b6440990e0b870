"""``k3serve serve``'s children die with it, even when the launcher itself is SIGKILLed; a taken
port ends the launcher and a worker with one line on stderr, not a traceback."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deploy.local import free_port
from tests.parallel.ray_cluster import alive
from tests.worker_procs import components

ROOT = Path(__file__).resolve().parents[2]


def _taken_port():
    """A listening socket on 127.0.0.1 (its port is taken while it is open)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    return s


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *cmd], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, check=False)


def test_a_taken_router_port_is_one_line():
    with _taken_port() as s:
        port = s.getsockname()[1]
        r = _run(["-m", "cli", "serve", "--port", str(port), "--prefill", "1",
                  "--decode", "1"])
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert r.stderr.strip() == (f"k3serve serve: error: port {port} on 127.0.0.1 is already "
                                f"in use; choose another with --port"), r.stderr
    assert "serving" not in r.stdout


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_taken_worker_port_is_one_line(role):
    with _taken_port() as s:
        port = s.getsockname()[1]
        r = _run(["-m", f"{role}.worker", "--port", str(port)])
    from worker.serve import EXIT_PORT_IN_USE

    assert r.returncode == EXIT_PORT_IN_USE == 3, (r.stdout, r.stderr)
    assert r.stderr.strip() == (f"k3serve {role} worker: error: 127.0.0.1:{port} is already "
                                f"in use"), r.stderr
    assert "listening" not in r.stdout


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
def test_children_exit_when_the_launcher_is_killed(tmp_path):
    port = free_port()
    log = open(tmp_path / "serve.log", "w")  # noqa: SIM115
    env = dict(os.environ, K3SERVE_API_KEY="secret-key-not-on-the-command-line")
    p = subprocess.Popen(
        [sys.executable, "-m", "cli", "serve", "--prefill", "1", "--decode", "1",
         "--port", str(port), "--block-size", "16", "--no-store"],
        stdout=log, stderr=subprocess.STDOUT, env=env,
    )
    kids: list[int] = []
    try:
        deadline = time.monotonic() + 180
        while "serving" not in (tmp_path / "serve.log").read_text():
            assert p.poll() is None, (tmp_path / "serve.log").read_text()[-2000:]
            assert time.monotonic() < deadline, "stack did not start"
            time.sleep(0.5)
        kids = components(p.pid)
        assert len(kids) == 3  # router + 1 prefill + 1 decode
        for k in kids:  # the API key travels in the environment, not on the command line
            assert b"secret-key" not in Path(f"/proc/{k}/cmdline").read_bytes()
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
        deadline = time.monotonic() + 30
        while any(alive(k) for k in kids) and time.monotonic() < deadline:
            time.sleep(0.3)
        assert not [k for k in kids if alive(k)], "children outlived a SIGKILLed launcher"
    finally:
        if p.poll() is None:
            p.kill()
        for k in kids:
            if alive(k):
                os.kill(k, signal.SIGKILL)
        log.close()


def test_serve_passes_router_and_worker_flags_through():
    """``k3serve serve`` takes the router's and the workers' own flags (a vLLM user expects
    ``--max-num-seqs`` there) and passes only those given; ``--log-level`` reaches both."""
    from deploy.serve import build_parser, passthrough_args, serve

    p = build_parser()
    assert passthrough_args(p.parse_args([])) == {"router": [], "worker": []}
    got = passthrough_args(p.parse_args(["--max-queued", "5", "--num-pages", "64",
                                         "--no-cuda-graphs", "--log-level", "info"]))
    assert got == {"router": ["--max-queued", "5", "--log-level", "info"],
                   "worker": ["--num-pages", "64", "--log-level", "info", "--no-cuda-graphs"]}
    # a name both have with different meanings: the workers' is --worker-NAME (a new user's
    # --max-queued 3 capped the router's admission AND every worker's queue)
    got = passthrough_args(p.parse_args(["--max-queued", "5", "--worker-max-queued", "7"]))
    assert got == {"router": ["--max-queued", "5"], "worker": ["--max-queued", "7"]}
    with pytest.raises(SystemExit):  # a typed flag keeps its type check
        p.parse_args(["--num-pages", "many"])
    with pytest.raises(ValueError, match="--max-queued"):  # Ray takes them from --config
        serve(p.parse_args(["--ray", "--config", "x.yaml", "--max-queued", "5"]))


def test_a_worker_whose_port_was_taken_before_it_bound_starts_on_another(tmp_path):
    """The launcher picks a worker's port, then the worker binds it: a connection or another
    process may take it in between (seen in CI: the stack failed with exit status 2). The
    launcher starts that worker again on a fresh port instead of failing the stack; a worker
    that fails for another reason still fails it, naming the worker and its log."""
    from deploy.launcher import StartupError, start_stack
    from deploy.local import LocalBackend

    taken = _taken_port()
    taken_port = taken.getsockname()[1]

    class FirstPortTaken(LocalBackend):
        calls = 0

        def free_port(self, host):
            self.calls += 1
            return taken_port if self.calls == 2 else super().free_port(host)

    launch = FirstPortTaken(log_dir=str(tmp_path))
    try:
        st = start_stack(num_prefill=1, num_decode=1, block_size=16, launch=launch,
                         ready_timeout=120)
    finally:
        taken.close()
    try:
        spec = st.specs[1]
        assert spec.name == "prefill-0" and spec.events and "port taken" in spec.events[0]
        assert st.worker_urls[0].rsplit(":", 1)[1] == spec.args[spec.args.index("--port") + 1]
        assert "is already in use" in (tmp_path / "prefill-0.log").read_text()
    finally:
        st.stop()
    # either worker may be seen dead first: both got the bad flag
    bad = (r"(?s)(prefill|decode)-0 \(code 2\).*end of its log"
           r".*unrecognized arguments: --no-such-flag")
    with pytest.raises(StartupError, match=bad):
        start_stack(num_prefill=1, num_decode=1, block_size=16, ready_timeout=60,
                    launch=FirstPortTaken(log_dir=str(tmp_path / "bad")),
                    extra_worker_args=["--no-such-flag"])


PROBE = """import os, signal, sys, time
print("ignored" if signal.getsignal(signal.SIGINT) is signal.SIG_IGN else "default", flush=True)
while not os.path.exists(sys.argv[1]):  # "importing": no handler of its own yet
    time.sleep(0.02)
signal.signal(signal.SIGINT, lambda *a: (print("handled", flush=True), sys.exit(0)))
print("ready", flush=True)
time.sleep(30)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl / libc signal: Linux")
def test_a_component_ignores_sigint_until_it_sets_its_own_handler(tmp_path):
    """A Ctrl-C that reaches a component while it still imports does nothing there (the
    launcher, which gets it too, stops what has started); once the component has set its own
    handler, SIGINT reaches that handler."""
    from deploy.local import LocalBackend

    (tmp_path / "probe_sigint.py").write_text(PROBE)
    go = tmp_path / "go"
    logs = tmp_path / "logs"
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    p = LocalBackend(log_dir=str(logs)).spawn("probe", "probe_sigint", [str(go)], env)
    log = logs / "probe.log"

    def lines() -> list[str]:
        return log.read_text().split() if log.exists() else []

    try:
        deadline = time.monotonic() + 30
        while "ignored" not in lines() and "default" not in lines():
            assert p.poll() is None and time.monotonic() < deadline, lines()
            time.sleep(0.05)
        assert lines() == ["ignored"]
        p.send_signal(signal.SIGINT)  # before its handler: ignored
        time.sleep(0.5)
        assert p.poll() is None
        go.touch()
        while "ready" not in lines():
            assert p.poll() is None and time.monotonic() < deadline, lines()
            time.sleep(0.05)
        p.send_signal(signal.SIGINT)  # its own handler now
        assert p.wait(10) == 0
        assert lines() == ["ignored", "ready", "handled"]
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
