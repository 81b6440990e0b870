"""``make dashboards`` (``python -m deploy.monitoring up``) removes its run folder (the config
copy, the targets, Prometheus' data) when it stops, and a router that does not answer is one
line, not a traceback; either way nothing is left in ``$TMPDIR``."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deploy.fake_stack import Stack

ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _up(tmp: Path, router_url: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "deploy.monitoring", "up", "--router-url", router_url,
         "--port", str(_free_port()), "--grafana-port", str(_free_port()), "--interval", "1"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "TMPDIR": str(tmp)})


def test_an_unreachable_router_is_one_line_and_leaves_no_folder(tmp_path):
    p = _up(tmp_path, "http://127.0.0.1:9")
    _, err = p.communicate(timeout=60)
    assert p.returncode == 1, err
    assert err.strip().splitlines() == [(
        "python -m deploy.monitoring: error: the router at http://127.0.0.1:9: "
        "[Errno 111] Connection refused")], err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(shutil.which("prometheus") is None, reason="no prometheus binary")
def test_dashboards_remove_their_run_folder_on_ctrl_c(tmp_path):
    s = Stack(num_prefill=1, num_decode=1, api_key=None)
    p = _up(tmp_path, s.url)
    try:
        line = p.stdout.readline()
        assert line.startswith("prometheus at "), line + p.stderr.read()
        runs = list(tmp_path.glob("k3serve-monitoring-*"))
        assert len(runs) == 1 and (runs[0] / "targets").is_dir()
        time.sleep(1.0)
        p.send_signal(signal.SIGINT)
        assert p.wait(30) == 0
        assert list(tmp_path.iterdir()) == []
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        s.close()
