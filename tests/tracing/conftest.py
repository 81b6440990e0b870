"""The OTLP receiver process of the tracing tests (otlp_receiver.py) and its spans file."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


@pytest.fixture()
def receiver(tmp_path):
    """(endpoint URL, spans file) of a receiver process, stopped afterwards."""
    port_file, out = tmp_path / "port", tmp_path / "spans.jsonl"
    proc = subprocess.Popen([sys.executable, str(HERE / "otlp_receiver.py"), str(port_file),
                             str(out)])
    try:
        deadline = time.monotonic() + 20
        while not port_file.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "receiver did not start"
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port_file.read_text()}", out
    finally:
        proc.kill()
        proc.wait()
