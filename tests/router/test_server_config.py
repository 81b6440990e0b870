"""The servers' uvicorn settings: the router on httptools and uvloop (where installed), the
workers' servers on h11 and asyncio's loop (router/config.py, router/__main__.py,
worker/serve.py)."""

from __future__ import annotations

import importlib.util

import uvicorn

import router.__main__ as rm
import router.config as rc


def _served_config(monkeypatch) -> uvicorn.Config:
    """The ``uvicorn.Config`` that ``python -m router`` serves with (nothing served)."""
    seen = {}

    class Server:
        def __init__(self, config: uvicorn.Config) -> None:
            seen["config"] = config

        def run(self, sockets=None) -> None:
            seen["sockets"] = sockets

    monkeypatch.setattr(rm, "StoppingServer", Server)  # router/__main__.py's uvicorn.Server
    monkeypatch.setattr(rm, "tune_gc", lambda: None)  # not this test process's collector
    assert rm.main(["--host", "127.0.0.1", "--port", "0", "--model", "k3-tiny"]) == 0
    assert seen["sockets"]
    return seen["config"]


def test_router_serves_on_httptools_and_uvloop(monkeypatch):
    cfg = _served_config(monkeypatch)
    assert cfg.http == rc.ROUTER_HTTP == "httptools"
    loop = cfg.get_loop_factory()()
    try:
        if importlib.util.find_spec("uvloop") is None:  # e.g. Windows: asyncio's loop
            assert type(loop).__module__.startswith("asyncio")
        else:
            import uvloop

            assert isinstance(loop, uvloop.Loop)
    finally:
        loop.close()


def test_workers_servers_stay_on_h11_and_asyncio():
    """worker/serve.py and the kvstore's bootstrap server pin both (uvloop and httptools
    are installed for the router: uvicorn's ``auto`` would pick them)."""
    import inspect

    import kvstore.bootstrap
    import worker.serve

    for mod in (worker.serve, kvstore.bootstrap):
        src = inspect.getsource(mod)
        assert 'http="h11"' in src and 'loop="asyncio"' in src, mod.__name__
    from deploy.fake_workers import ServerThread

    params = inspect.signature(ServerThread).parameters
    assert params["http"].default == "h11" and params["loop"].default == "asyncio"
