"""The router's contract as a fresh user and a worker see it, without any worker running:
every internal route declares named request/response models in the OpenAPI schema,
``GET /v1/models/{id}`` answers the served model (404 for another), a taken port ends the
router with one line on stderr and exit code 1, and ``import router.app`` loads no torch or
model code."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from k3serve.protocol import CLUSTER_TOKEN_HEADER
from router.app import RouterConfig, create_app

ROOT = Path(__file__).resolve().parents[2]
MODEL = "k3-tiny"


@pytest.fixture(scope="module")
def app():
    return create_app(RouterConfig(model=MODEL, api_key="sk-x", cluster_token="tok"))


def _is_named(schema: dict) -> bool:
    """A body schema that is a reference to a named component (a pydantic model)."""
    return set(schema) == {"$ref"} and schema["$ref"].startswith("#/components/schemas/")


def test_internal_routes_declare_named_request_and_response_models(app):
    spec = app.openapi()
    internal = {p: ops for p, ops in spec["paths"].items() if p.startswith("/internal/")}
    assert "/internal/register" in internal
    seen = 0
    for path, ops in internal.items():
        for method, op in ops.items():
            body = op.get("requestBody")
            if method in ("post", "put", "patch"):
                assert body is not None, f"{method} {path}: no request body model"
            if body is not None:
                schema = body["content"]["application/json"]["schema"]
                assert _is_named(schema), (path, schema)
                seen += 1
            for status, resp in op["responses"].items():
                if status == "422":  # FastAPI's own (answered 400 by the router)
                    continue
                schema = resp.get("content", {}).get("application/json", {}).get("schema")
                assert schema is not None and _is_named(schema), (path, status, resp)
                seen += 1
    assert seen >= 2
    names = spec["components"]["schemas"]
    assert {"RegisterRequest", "RegisterResponse"} <= set(names)


def test_register_body_is_validated_with_the_model_and_named_in_the_error(app):
    with TestClient(app) as c:
        h = {CLUSTER_TOKEN_HEADER: "tok"}
        r = c.post("/internal/register", json={"url": "ftp://x"}, headers=h)
        assert r.status_code == 400 and r.json()["error"]["param"] == "url", r.text
        r = c.post("/internal/register", json={}, headers=h)
        assert r.status_code == 400 and r.json()["error"]["param"] == "url", r.text
        r = c.post("/internal/register", content=b"{", headers=h)
        assert r.status_code == 400, r.text
        # the cluster token is checked before the body
        r = c.post("/internal/register", json={"url": "ftp://x"})
        assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden"


def test_models_by_id_is_the_card_or_an_openai_404(app):
    with TestClient(app) as c:
        auth = {"Authorization": "Bearer sk-x"}
        r = c.get(f"/v1/models/{MODEL}", headers=auth)
        assert r.status_code == 200, r.text
        card = r.json()
        assert card["id"] == MODEL and card["object"] == "model" and card["max_model_len"] > 0
        assert card == {**c.get("/v1/models", headers=auth).json()["data"][0],
                        "created": card["created"]}
        r = c.get("/v1/models/gpt-4", headers=auth)
        assert r.status_code == 404
        err = r.json()["error"]
        assert err["code"] == "model_not_found" and "gpt-4" in err["message"]
        assert set(err) == {"message", "type", "param", "code"}
        assert c.get(f"/v1/models/{MODEL}").status_code == 401


def test_health_body_is_the_router_health_model(app):
    from k3serve.messages import RouterHealth

    with TestClient(app) as c:
        r = c.get("/health", params={"detail": 1}, headers={"Authorization": "Bearer sk-x"})
        assert r.status_code == 503
        h = RouterHealth.model_validate(r.json())
        assert h.status == "unavailable" and h.workers == [] and h.model == MODEL


def test_a_taken_port_is_one_line_on_stderr_and_exit_1():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "router", "--host", "127.0.0.1",
                            "--port", str(port), "--model", MODEL], cwd=ROOT,
                           capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 1, (r.returncode, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert f"127.0.0.1:{port}" in lines[0] and "in use" in lines[0]
    assert "Traceback" not in r.stderr


def test_router_serves_on_the_port_it_bound():
    """The pre-bound socket is the one uvicorn serves on (poll until it answers)."""
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "router", "--host", "127.0.0.1",
                             "--port", str(port), "--model", MODEL], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, proc.stderr.read()
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "the router never answered"
                time.sleep(0.05)
        assert r.status_code == 503 and r.json()["status"] == "unavailable"
    finally:
        proc.terminate()
        proc.wait(10)


def test_import_router_app_loads_no_torch_engine_or_model():
    code = ("import json, sys; import router.app; "
            "print(json.dumps(sorted(m for m in sys.modules if m == 'torch' or "
            "m.startswith(('torch.', 'k3serve.engine', 'k3serve.model')))))")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == []
