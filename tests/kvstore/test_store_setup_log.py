"""A worker's store client starts without Mooncake's glog lines on stderr: what ``setup``
prints (an ``E``-level "Local segment descriptor not found" on every start) goes to the
``kvstore.mooncake`` logger at DEBUG, so ``--log-level debug`` shows it and the terminal does
not; at the default level no Mooncake line reaches stderr from start to close. Needs the Mooncake wheel's ``mooncake_master`` (skipped without it)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

CODE = """
import logging, sys, time
logging.basicConfig(level=logging.{level}, stream=sys.stdout, format="%(name)s %(levelname)s %(message)s")
from deploy.local import start_store_master
from kvstore.store.client import StoreConfig
from kvstore.store.client import KVStore, StoreState
proc, url = start_store_master()
try:
    st = KVStore(StoreConfig(url=url), "f" * 32).start()
    t_end = time.monotonic() + 30
    while st.state is StoreState.CONNECTING and time.monotonic() < t_end:
        time.sleep(0.05)
    print("state", st.state.value, flush=True)
    st.close()
finally:
    proc.kill()
    proc.wait()
"""


def _glog(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln[:1] in "IWEF" and ln[1:5].isdigit()]


@pytest.mark.parametrize("level", ["WARNING", "DEBUG"])
def test_store_setup_log_stays_off_stderr(level):
    pytest.importorskip("mooncake.store")
    from deploy.local import mooncake_master_path

    try:
        mooncake_master_path()
    except FileNotFoundError:
        pytest.skip("no mooncake_master")
    r = subprocess.run([sys.executable, "-c", CODE.format(level=level)], cwd=ROOT,
                       capture_output=True, text=True, timeout=90, check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "state up" in r.stdout, (r.stdout, r.stderr[-2000:])
    routed = [ln for ln in r.stdout.splitlines() if ln.startswith("kvstore.mooncake DEBUG")]
    if level == "DEBUG":  # routed to the logger, not lost; Mooncake's own INFO lines show
        assert any("Local segment descriptor not found" in ln for ln in routed), r.stdout
        assert not [ln for ln in _glog(r.stderr) if ln[0] in "EF"], r.stderr[-2000:]
    else:
        assert _glog(r.stderr) == [] and routed == [], (r.stdout, r.stderr[-2000:])
