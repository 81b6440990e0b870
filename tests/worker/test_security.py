"""Must-show 6 of issue 15: every internal endpoint — both worker roles' apps, the kvstore
bootstrap server's, the router's ``/internal/*`` — answers 401/403 without the cluster token or
with a wrong one, and runs nothing. The routes are ENUMERATED from the apps (``app.routes``), so
an endpoint added later is covered (or must be listed in the explicit public sets below).

The apps are built around objects without an engine (``__new__``) whose engine-facing parts are
spies: a request that got past the check would touch them, and the spy would record it. A
control with the right token proves each route is reached (the test can fail).
Also: secrets never appear in a config's ``repr`` (what a log line would print), and the
launcher warns about a worker address that is not private.
"""

from __future__ import annotations

import re

import pytest
from fastapi.testclient import TestClient

from decode.worker import DecodeWorker
from deploy.launcher import address_warning
from k3serve.protocol import CLUSTER_TOKEN_HEADER
from kvstore.bootstrap import PUBLIC_PATHS as KV_PUBLIC
from kvstore.bootstrap import KVBootstrapServer
from prefill.worker import PrefillWorker
from router.app import RouterConfig
from router.app import create_app as router_app
from worker.config import WorkerConfig, WorkerEnv
from worker.http import PUBLIC_PATHS as WORKER_PUBLIC
from worker.http import create_app

TOKEN = "security-test-token-0123456789"
API_KEY = "sk-security-test"
# everything else: /internal → cluster token, /v1 and ROUTER_KEYED → API key
ROUTER_PUBLIC = {"/health", "/livez", "/readyz"}
ROUTER_KEYED = {"/metrics", "/openapi.json"}
BAD = [
    {},
    {CLUSTER_TOKEN_HEADER: "wrong"},
    {CLUSTER_TOKEN_HEADER: TOKEN[:-1]},  # a prefix
    {CLUSTER_TOKEN_HEADER: TOKEN + "x"},  # longer
    {CLUSTER_TOKEN_HEADER: ""},
    {CLUSTER_TOKEN_HEADER: "\xe9".encode("latin-1")},  # not UTF-8
    {"Authorization": f"Bearer {TOKEN}"},  # the right value in the wrong header
]


class Spy:
    """Records every attribute read and call; calls raise (nothing may run)."""

    def __init__(self) -> None:
        self.touched: list[str] = []

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        self.touched.append(name)

        def call(*a, **k):
            self.touched.append(f"{name}()")
            raise RuntimeError(f"spy: {name} called")

        return call


def _routes(app) -> list[tuple[str, str]]:
    """``(method, path)`` of every route of ``app``, path parameters filled in."""
    out = []
    for r in app.routes:
        methods = getattr(r, "methods", None)
        assert methods, f"route without methods: {r!r}"  # a Mount would hide routes
        path = re.sub(r"\{[^}]+\}", "x", r.path)
        out += [(m, path) for m in sorted(methods) if m != "HEAD"]
    return out


def _worker(role: str):
    cls = {"prefill": PrefillWorker, "decode": DecodeWorker}[role]
    w = cls.__new__(cls)  # no engine
    w.config = WorkerConfig(role=role, cluster_token=TOKEN)
    w.worker_id, w.role = f"{role}-sec", role
    spy = Spy()
    w.loop = w.engine = w.store = w.metrics = spy
    return w, spy


def _bootstrap():
    srv = KVBootstrapServer.__new__(KVBootstrapServer)  # no engine, no ticket table
    srv.cluster_token = TOKEN
    spy = Spy()
    srv.pair, srv.on_status, srv.health = spy.pair, spy.on_status, spy.health
    spy.touched.clear()  # the reads above
    return srv.app(), spy


def _call(client: TestClient, method: str, path: str, headers: dict):
    return client.request(method, path, headers=headers, json={})


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_every_worker_route_needs_the_cluster_token(role):
    w, spy = _worker(role)
    app = create_app(w)
    routes = _routes(app)
    guarded = [(m, p) for m, p in routes if p not in WORKER_PUBLIC]
    # the enumeration sees the role's routes and the shared ones
    want = {"prefill": {"/internal/prefill"}, "decode": {"/internal/reserve",
                                                         "/internal/stream",
                                                         "/internal/generate",
                                                         "/internal/channel",
                                                         "/internal/attach"}}[role]
    assert want | {"/internal/abort", "/internal/info"} <= {p for _, p in guarded}
    assert {p for _, p in routes} - {p for _, p in guarded} == set(WORKER_PUBLIC)
    client = TestClient(app, raise_server_exceptions=False)  # no `with`: no engine thread
    for method, path in guarded:
        for h in BAD:
            r = _call(client, method, path, h)
            assert r.status_code in (401, 403), (method, path, h, r.status_code, r.text)
            assert r.json()["error"] == "forbidden"
        assert spy.touched == [], (method, path, spy.touched)  # nothing ran
    # control: with the token each route is reached (400 on the empty body, or the spy)
    for method, path in guarded:
        r = _call(client, method, path, {CLUSTER_TOKEN_HEADER: TOKEN})
        assert r.status_code not in (401, 403), (method, path, r.text)
    assert spy.touched  # the GET routes reached the engine-facing spy


def test_every_bootstrap_route_needs_the_cluster_token():
    app, spy = _bootstrap()
    routes = _routes(app)
    guarded = [(m, p) for m, p in routes if p not in KV_PUBLIC]
    assert {p for _, p in guarded} == {"/kv/pair", "/kv/status"}, routes
    assert {p for _, p in routes} - {p for _, p in guarded} == set(KV_PUBLIC) == {"/kv/health"}
    client = TestClient(app, raise_server_exceptions=False)
    for method, path in guarded:
        for h in BAD:
            r = _call(client, method, path, h)
            assert r.status_code in (401, 403), (method, path, h, r.status_code, r.text)
            assert r.json()["error"] == "forbidden"
    assert spy.touched == []  # no pairing, no status applied
    from k3serve.messages import PairRequest, StatusMessage

    pair = PairRequest(ticket="t", sender="s", fingerprint={}).model_dump(mode="json")
    status = StatusMessage(ticket="t", sender="s", kind="aborted").model_dump(mode="json")
    for path, body in (("/kv/pair", pair), ("/kv/status", status)):
        r = client.post(path, json=body, headers={CLUSTER_TOKEN_HEADER: TOKEN})
        assert r.status_code == 500  # reached the handler: the spy raised
    assert spy.touched == ["pair()", "on_status()"]


def test_every_router_route_needs_the_token_or_the_api_key():
    app = router_app(RouterConfig(model="k3-tiny", api_key=API_KEY, cluster_token=TOKEN))
    routes = _routes(app)
    internal = [(m, p) for m, p in routes if p.startswith("/internal/")]
    public_api = [(m, p) for m, p in routes if p.startswith("/v1/")]
    assert {p for _, p in routes} - {p for _, p in internal + public_api} <= (
        ROUTER_PUBLIC | ROUTER_KEYED), (
        "a router route that is neither /internal (token) nor /v1 (API key) nor listed")
    public_api += [("GET", p) for p in sorted(ROUTER_KEYED)] + [("GET", "/health?detail=1")]
    assert {"/internal/register", "/internal/deregister"} <= {p for _, p in internal}
    with TestClient(app, raise_server_exceptions=False) as client:
        for method, path in internal:
            for h in BAD:
                r = client.request(method, path, headers=h, json={"url": "http://127.0.0.1:9"})
                assert r.status_code in (401, 403), (method, path, h, r.text)
        for method, path in public_api:
            for h in [{}, {"Authorization": "Bearer wrong"}, {CLUSTER_TOKEN_HEADER: TOKEN}]:
                r = client.request(method, path, headers=h, json={"model": "k3-tiny",
                                                                  "prompt": "x"})
                assert r.status_code == 401, (method, path, h, r.text)
        assert app.state.router.pool.workers == {}


def test_secrets_never_in_a_config_repr(monkeypatch):
    monkeypatch.setenv("K3SERVE_CLUSTER_TOKEN", TOKEN)
    for obj in (WorkerConfig(role="decode", cluster_token=TOKEN), WorkerEnv(),
                RouterConfig(api_key=API_KEY, cluster_token=TOKEN)):
        assert TOKEN not in repr(obj) and API_KEY not in repr(obj), type(obj)


@pytest.mark.parametrize("host,warned", [
    ("127.0.0.1", False), ("localhost", False), ("10.1.2.3", False), ("192.168.0.7", False),
    ("fd00::1", False), ("::1", False), ("8.8.8.8", True), ("0.0.0.0", True),
    ("2001:4860::8888", True)])
def test_the_launcher_warns_about_a_public_worker_address(host, warned):
    msg = address_warning(host, "worker")
    assert (msg is not None) == warned, msg
    if warned:
        assert "Deployment security" in msg
