"""The store's master under supervision (``start_stack(store=True, supervise=True)``):
``kill -9`` of ``mooncake_master`` → the supervisor starts it again on the same port (the
workers' ``--store-url`` stays valid), requests keep completing meanwhile and after, each
worker's store client is up again (``k3serve:store_up`` 1), and once the master is back the
workers log no more store errors (no line every few seconds for as long as it is gone)."""

from __future__ import annotations

import os
import re
import signal
import socket
import time

import httpx
import pytest

from deploy.launcher import start_stack

B = 16


def _accepts(url: str) -> bool:
    host, port = url.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=1):
            return True
    except OSError:
        return False


def _store_up(worker_url: str) -> float | None:
    text = httpx.get(worker_url + "/metrics", timeout=10).text
    m = re.search(r"^k3serve:store_up\{[^}]*\} (\S+)$", text, re.MULTILINE)
    return float(m.group(1)) if m else None


def _complete(url: str, i: int) -> httpx.Response:
    return httpx.post(url + "/v1/completions", timeout=120, json={
        "model": "k3-tiny", "prompt": f"store supervision {i} " * 6, "max_tokens": 4})


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    logs = tmp_path_factory.mktemp("store-sup-logs")
    mp = pytest.MonkeyPatch()
    mp.setenv("K3SERVE_STORE_SEGMENT_MB", "16")
    try:
        st = start_stack(model="k3-tiny", num_prefill=1, num_decode=1, block_size=B,
                         log_dir=str(logs), store=True, supervise=True, max_restarts=2)
    finally:
        mp.undo()
    st.log_dir = logs
    try:
        yield st
    finally:
        st.stop(timeout=30)
        assert not [p for p in st.procs if p.poll() is None]


def test_a_killed_store_master_comes_back_on_its_port_and_the_errors_stop(stack):
    i = next(k for k, s in enumerate(stack.specs) if s.kind == "store")
    spec, old = stack.specs[i], stack.procs[i]
    assert _complete(stack.url, 0).status_code == 200
    os.kill(old.pid, signal.SIGKILL)
    t_kill = time.monotonic()
    assert _complete(stack.url, 1).status_code == 200  # a miss, not an error
    while time.monotonic() - t_kill < 20:
        new = stack.procs[i]
        if new is not old and new.poll() is None and _accepts(spec.url):
            break
        time.sleep(0.2)
    else:
        raise AssertionError(f"mooncake_master not back within 20 s: {spec.events}")
    assert spec.restarts == 1 and spec.events[-1] == f"restart 1: {spec.url}", spec.events
    back_s = time.monotonic() - t_kill
    for k in range(2, 6):  # puts fail over to the restarted master; the clients re-mount
        assert _complete(stack.url, k).status_code == 200
    t_end = time.monotonic() + 30
    while time.monotonic() < t_end and not all(
            _store_up(u) == 1.0 for u in stack.worker_urls):
        _complete(stack.url, 99)
        time.sleep(0.5)
    assert all(_store_up(u) == 1.0 for u in stack.worker_urls)
    sizes = {n: os.path.getsize(stack.log_dir / f"{n}.log") for n in ("prefill-0", "decode-0")}
    time.sleep(6)  # longer than the Mooncake client's ping period (5 s)
    for n, size in sizes.items():
        with open(stack.log_dir / f"{n}.log", errors="replace") as f:
            f.seek(size)
            errors = [ln for ln in f if re.match(r"^E\d{4} ", ln) or " ERROR " in ln]
        assert errors == [], (n, errors[:5])
    assert back_s < 20


def _router_store(url: str, **params) -> dict:
    return httpx.get(url + "/health", params=params, timeout=10).json()["store"]


def test_the_router_s_health_shows_a_store_master_that_stays_down(stack):
    """The launcher gives the router the master's address (``--store-url``): ``/health``
    says ``up``; with the master killed and left down (no restart left) it says ``down`` and
    since when, while ``/health`` and ``/readyz`` stay 200 and requests are served without
    the store; started again, ``up``."""
    i = next(k for k, s in enumerate(stack.specs) if s.kind == "store")
    spec = stack.specs[i]
    st = _router_store(stack.url, detail=1)
    assert st["status"] == "up" and st["url"] == spec.url
    spec.restarts = stack.supervisor.max_restarts  # the supervisor leaves it down now
    os.kill(stack.procs[i].pid, signal.SIGKILL)
    t_kill = time.time()
    deadline = time.monotonic() + 10
    while (st := _router_store(stack.url))["status"] != "down":
        assert time.monotonic() < deadline, st
        time.sleep(0.1)
    assert st["since"] >= t_kill - 0.01 and "url" not in st
    assert httpx.get(stack.url + "/health", timeout=10).status_code == 200
    assert httpx.get(stack.url + "/readyz", timeout=10).status_code == 200
    for k in range(3):
        assert _complete(stack.url, 100 + k).status_code == 200
    time.sleep(1.5)
    later = _router_store(stack.url)
    assert later["status"] == "down" and later["since"] == st["since"] and later["for_s"] >= 1
    stack.procs[i] = spec.start()  # back on its port, as the supervisor would
    deadline = time.monotonic() + 20
    while (back := _router_store(stack.url))["status"] != "up":
        assert time.monotonic() < deadline, back
        time.sleep(0.1)
    assert back["since"] > st["since"]
    assert _complete(stack.url, 200).status_code == 200
