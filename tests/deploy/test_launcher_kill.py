"""kill -9 of ``k3serve serve`` (with the shared store): its children get SIGTERM from the
kernel (``PR_SET_PDEATHSIG``, deploy/local.py); the workers see that their launcher is gone
(``worker.serve.ParentWatch``) and exit at once without closing their store clients, so
nothing is printed after the kill (no Mooncake errors about the master that went with the
launcher, no traceback) and no process of the stack is left."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.worker_procs import session_left

ROOT = Path(__file__).resolve().parents[2]


def test_kill_9_of_the_launcher_leaves_nothing_and_prints_nothing():
    from deploy.local import mooncake_master_path

    try:
        mooncake_master_path()
    except FileNotFoundError as e:
        pytest.skip(f"no store to lose: {e}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    p = subprocess.Popen([sys.executable, "-m", "cli", "serve", "--port", str(port),
                          "--prefill", "1", "--decode", "1", "--device", "cpu", "--store"],
                         cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)
    lines: list[str] = []
    killed_at: list[int] = []
    reader = threading.Thread(target=lambda: lines.extend(p.stdout), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 180
        while not any("k3serve: serving" in ln for ln in lines):
            assert p.poll() is None and time.monotonic() < deadline, "".join(lines)
            time.sleep(0.2)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json={
            "model": "k3-tiny", "prompt": "before the kill", "max_tokens": 4}, timeout=60)
        assert r.status_code == 200, r.text
        assert len(session_left(p.pid)) >= 5  # launcher, store master, router, 2 workers
        time.sleep(1.0)  # the store's background calls are running
        killed_at.append(len(lines))
        os.kill(p.pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while session_left(p.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert session_left(p.pid) == []
        reader.join(10)
        after = lines[killed_at[0]:]
        assert after == [], "".join(after)
    finally:
        for d in session_left(p.pid):
            os.kill(int(d), signal.SIGKILL)
        p.wait(10)
