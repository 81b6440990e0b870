"""Stopping a live ``k3serve serve`` stack while it streams (scripts/shutdown_drain.py).

For each way to stop it — SIGTERM to the process group, SIGTERM to the launcher alone, and a
terminal's Ctrl-C (SIGINT to the group) — 8 streams of :data:`TOKENS` tokens all finish with
every token, well within the workers' drain timeout; the launcher exits 0; nothing it started
is left running; no traceback and no restart in the terminal output; ``ps`` names every
process by its role. The script runs the same check with 1,024 tokens per stream. A second
Ctrl-C stops everything at once, quietly. A Ctrl-C during startup (the launcher or its
components still importing) stops quietly too.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOKENS = 48
DRAIN_S = 60.0


def _script():
    spec = importlib.util.spec_from_file_location("shutdown_drain",
                                                  ROOT / "scripts" / "shutdown_drain.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("mode", ["group-term", "launcher-term", "group-int"])
def test_one_signal_drains_every_stream_and_stops_everything_cleanly(mode):
    r = _script().run_mode(mode, tokens=TOKENS, streams=8, drain_timeout=DRAIN_S, prefill=1)
    tail = "".join(r["output_tail"])
    assert r["stream_tokens"] == [TOKENS] * 8 and r["finish"] == ["length"], (r, tail)
    assert r["last_stream_end_s"] <= DRAIN_S, r
    assert r["launcher_exit"] == 0, tail
    assert r["left_running"] == [], r
    assert r["tracebacks"] == 0 and r["restarts"] == 0, tail
    # ours by their titles; the store's master (on by default) keeps its own command line
    assert [t for t in r["titles"] if t.startswith("k3serve")] == [
        "k3serve decode-worker", "k3serve forkserver", "k3serve prefill-worker", "k3serve router",
        "k3serve serve"], r["titles"]
    assert [t for t in r["titles"] if not t.startswith("k3serve")] == [
        t for t in r["titles"] if "mooncake_master" in t], r["titles"]
    assert r["ok"], r


def test_a_second_ctrl_c_stops_everything_at_once_without_a_traceback():
    """Ctrl-C twice, 0.3 s apart, with streams in flight: the router ends at once and the
    workers cut their streams, so every stream ends within seconds (some before their last
    token); the launcher exits 0, nothing is left, and no component prints a traceback or an
    error logged in its place (a forced uvicorn exit used to print the cancelled tasks')."""
    tokens = 512
    r = _script().run_mode("group-int-twice", tokens=tokens, streams=4, drain_timeout=DRAIN_S,
                           prefill=1)
    tail = "".join(r["output_tail"])
    assert r["last_stream_end_s"] <= 15.0, r
    assert min(r["stream_tokens"]) < tokens, r  # stopped, not drained
    assert r["launcher_exit"] == 0, tail
    assert r["left_running"] == [], r
    assert r["tracebacks"] == 0 and r["restarts"] == 0, tail
    assert r["ok"], r


def test_serve_gives_every_worker_a_drain_long_enough_for_normal_streams():
    """``k3serve serve`` without ``--drain-timeout`` passes its own default (180 s: a
    1,024-token stream at 6 tokens/s ends within it) to every worker, and waits that long
    plus the grace before killing; a given value is passed once, as given."""
    from deploy.serve import (
        DEFAULT_DRAIN_TIMEOUT_S,
        build_parser,
        drain_timeout,
        passthrough_args,
    )

    assert DEFAULT_DRAIN_TIMEOUT_S == 180.0 and 1024 / 6 <= DEFAULT_DRAIN_TIMEOUT_S
    args = build_parser().parse_args([])
    extra = passthrough_args(args)
    assert drain_timeout(args, extra) == 180.0
    assert extra["worker"] == ["--drain-timeout", "180.0"] and extra["router"] == []
    args = build_parser().parse_args(["--drain-timeout", "30"])
    extra = passthrough_args(args)
    assert drain_timeout(args, extra) == 30.0
    assert extra["worker"] == ["--drain-timeout", "30.0"]


def _group(pgid: int) -> list[str]:
    """Command lines of the live processes of process group ``pgid``."""
    import subprocess

    out = subprocess.run(["ps", "-eo", "pgid=,stat=,args="], capture_output=True, text=True,
                         check=True).stdout
    return [ln.split(None, 2)[2] for ln in out.splitlines()
            if ln.split()[0] == str(pgid) and not ln.split()[1].startswith("Z")]


#: ``python -m cli.main`` with SIGINT raising KeyboardInterrupt from the start, as when a shell
#: on a terminal starts it: a runner that started the suite in the background (a
#: non-interactive shell's ``&``) leaves SIGINT ignored, and the interpreter would keep it so
#: until the launcher sets its own handler.
CLI_MAIN = ("import runpy, signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
            "runpy.run_module('cli.main', run_name='__main__', alter_sys=True)")


def _imports_began(pid: int) -> bool:
    """Whether process ``pid`` (cli.main run as ``__main__``) is importing the launcher inside
    ``main()``: ``serve`` imports deploy.serve, whose HTTP client maps the ``_ssl`` extension,
    which neither the interpreter's start-up (``site``, the editable install's finder) nor
    cli.main's module-level imports load."""
    import _ssl

    marker = Path(getattr(_ssl, "__file__", "") or "_ssl").name
    try:
        return marker in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


@pytest.mark.parametrize("when", ["launcher-importing", "components-importing",
                                  "replicas-importing"])
def test_ctrl_c_during_startup_stops_quietly(when, tmp_path):
    """A terminal's Ctrl-C (SIGINT to the process group) while the launcher still imports, or
    while the components it started still import (workers; router replicas, which the router
    starts): one line, no traceback, exit status 130 or 0, and nothing of the group left
    running."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from deploy.local import free_port

    log = tmp_path / "serve.log"
    with log.open("w") as out:
        extra = ["--routers", "2"] if when == "replicas-importing" else []
        p = subprocess.Popen([sys.executable, "-c", CLI_MAIN, "serve", "--port",
                              str(free_port()), "--no-store", *extra], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                             start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        # the first worker / router replica has just started (its command line, or its title)
        started = {"components-importing": (".worker ",),
                   "replicas-importing": ("--replica-index", "router replica")}
        if when in started:
            while not any(m in c for c in _group(p.pid) for m in started[when]):
                assert p.poll() is None and time.monotonic() < deadline, log.read_text()
                time.sleep(0.02)
        else:  # past the interpreter's own start-up (a SIGINT in its ``site`` import is
            # CPython's fatal error, before any code of ours runs): the launcher's imports began
            while not _imports_began(p.pid):
                assert p.poll() is None and time.monotonic() < deadline, log.read_text()
                time.sleep(0.02)
        os.killpg(p.pid, signal.SIGINT)
        rc = p.wait(60)
        time.sleep(0.5)
        text = log.read_text()
        assert "Traceback" not in text and "Exception ignored" not in text, text
        if when in started:
            assert rc == 0 and text.splitlines()[-1] == "k3serve: stopped", text
        else:  # the launcher's own handler may or may not be set by then; interrupted, the
            # interpreter may end by SIGINT itself (what a shell reads as Ctrl-C, status 130)
            assert (rc, text.splitlines()[-1]) in ((130, "k3serve: interrupted"),
                                                   (-signal.SIGINT, "k3serve: interrupted"),
                                                   (0, "k3serve: stopped")), text
        assert _group(p.pid) == []
    finally:
        if _group(p.pid):
            os.killpg(p.pid, signal.SIGKILL)
