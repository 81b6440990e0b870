"""The store master's reachability on the router's ``/health`` (router/store_health.py),
against fake workers and a plain TCP listener standing in for the master's RPC port: up while
it accepts, down (with since when) once it is closed — ``/health`` and ``/readyz`` stay 200 and
requests are served — up again once it listens again; the address only with ``?detail=1``."""

from __future__ import annotations

import socket
import time

import httpx
import pytest

from deploy.fake_stack import Stack
from deploy.fake_workers import MODEL
from router.config import RouterConfig


def _listener(port: int = 0) -> socket.socket:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", port))
    s.listen(16)
    return s


def _store(s: Stack, **params) -> dict:
    return httpx.get(s.url + "/health", params=params, timeout=10).json()["store"]


def _wait_status(s: Stack, status: str, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while (st := _store(s))["status"] != status:
        assert time.monotonic() < deadline, st
        time.sleep(0.05)
    return st


def test_the_store_master_s_outage_shows_on_health_and_requests_keep_being_served():
    master = _listener()
    port = master.getsockname()[1]
    s = Stack(num_prefill=1, num_decode=1, api_key=None, store_url=f"127.0.0.1:{port}")
    try:
        st = _wait_status(s, "up")
        assert "url" not in st and st["since"] <= time.time()
        assert _store(s, detail=1)["url"] == f"127.0.0.1:{port}"
        master.close()
        t_down = time.time()
        st = _wait_status(s, "down", timeout=5)
        assert st["since"] >= t_down - 0.01 and st["for_s"] >= 0
        r = httpx.get(s.url + "/health", timeout=10)
        assert r.status_code == 200 and r.json()["status"] == "ok"
        assert httpx.get(s.url + "/readyz", timeout=10).status_code == 200
        for i in range(3):
            r = s.post("/v1/completions", {"model": MODEL, "prompt": f"no store {i}",
                                           "max_tokens": 4}, key=None)
            assert r.status_code == 200, r.text
        time.sleep(1.2)
        later = _store(s)
        assert later["status"] == "down" and later["since"] == st["since"]
        assert later["for_s"] >= 1.0
        master = _listener(port)
        back = _wait_status(s, "up", timeout=5)
        assert back["since"] > st["since"]
    finally:
        master.close()
        s.close()


def test_no_store_url_no_store_field_and_a_bad_one_is_refused():
    s = Stack(num_prefill=1, num_decode=1, api_key=None)
    try:
        assert "store" not in httpx.get(s.url + "/health", timeout=10).json()
    finally:
        s.close()
    with pytest.raises(ValueError, match="store_url"):
        RouterConfig(store_url="no-port")
