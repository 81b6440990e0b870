"""The router's doors, without workers: the keyed routes (401 without the API key), the open
probes (``/health``, ``/livez``, ``/readyz``), several API keys (flags and a keys file), and
tool parameter schemas checked against the JSON Schema metaschema (400 naming the tool)."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from router.app import create_app
from router.config import RouterConfig, build_parser, config_from_args

MODEL = "k3-tiny"


@pytest.fixture(scope="module")
def client():
    app = create_app(RouterConfig(model=MODEL, api_key="sk-a", api_keys=("sk-b",),
                                  cluster_token="tok"))
    with TestClient(app) as c:
        yield c


@pytest.mark.parametrize("path", ["/metrics", "/openapi.json", "/health?detail=1"])
def test_keyed_routes_answer_401_without_the_key(client, path):
    for headers in [{}, {"Authorization": "Bearer wrong"}, {"X-K3serve-Cluster-Token": "tok"}]:
        r = client.get(path, headers=headers)
        if path == "/health?detail=1" and "X-K3serve-Cluster-Token" in headers:
            # the workers check their registration with the cluster token, not an API key
            assert r.status_code in (200, 503) and r.json()["workers"] == [], r.text
            continue
        assert r.status_code == 401, (path, headers, r.text)
        assert r.json()["error"]["code"] == "invalid_api_key"
    r = client.get("/health?detail=1", headers={"X-K3serve-Cluster-Token": "wrong"})
    assert r.status_code == 401, r.text
    for key in ("sk-a", "sk-b"):
        r = client.get(path, headers={"Authorization": f"Bearer {key}"})
        assert r.status_code in (200, 503), (path, r.text)  # 503: /health with no worker
    r = client.get("/health?detail=1", headers={"Authorization": "Bearer sk-b"})
    assert r.json()["workers"] == []


def test_a_missing_key_and_a_wrong_key_get_their_own_401_message(client):
    missing = "No API key provided: send it as 'Authorization: Bearer KEY'."
    for headers, message in [
            ({}, missing), ({"Authorization": "Bearer "}, missing),
            ({"Authorization": "Basic sk-a"}, missing),
            ({"Authorization": "Bearer wrong"}, "Incorrect API key provided.")]:
        r = client.get("/v1/models", headers=headers)
        assert r.status_code == 401, (headers, r.text)
        assert r.json()["error"]["message"] == message, headers
        assert r.json()["error"]["code"] == "invalid_api_key"


def test_probes_stay_open_and_readiness_needs_workers(client):
    assert client.get("/livez").status_code == 200
    r = client.get("/readyz")
    assert r.status_code == 503 and r.json()["status"] == "unavailable"
    r = client.get("/health")
    assert r.status_code == 503 and "workers" not in r.json()
    assert client.get("/docs").status_code == 404 and client.get("/redoc").status_code == 404


def test_several_api_keys_from_flags_and_a_file(tmp_path):
    f = tmp_path / "keys"
    f.write_text("# team keys\nsk-c\n\nsk-a\n")
    args = build_parser().parse_args(["--api-key", "sk-a", "sk-b", "--api-key", "sk-x",
                                      "--api-key-file", str(f)])
    c = config_from_args(args)
    assert (c.api_key, c.api_keys) == ("sk-a", ("sk-b", "sk-x", "sk-c"))
    assert "sk-" not in repr(c)
    with pytest.raises(ValueError, match="api-key-file"):
        config_from_args(build_parser().parse_args(["--api-key-file", str(tmp_path / "no")]))
    with pytest.raises(ValueError, match="api_keys"):
        RouterConfig(api_keys=("sk-b",))


@pytest.mark.parametrize("tool_choice", [None, "auto", "required",
                                         {"type": "function", "function": {"name": "get_w"}}])
def test_an_invalid_tool_schema_is_400_naming_the_tool(client, tool_choice):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "weather?"}],
            "tools": [{"type": "function", "function": {"name": "ok_tool", "parameters": {
                "type": "object", "properties": {"a": {"type": "string"}}}}},
                {"type": "function", "function": {"name": "get_w", "parameters": {
                    "type": "object", "properties": {"city": {"type": "strin"}},
                    "required": "city"}}}]}
    if tool_choice is not None:
        body["tool_choice"] = tool_choice
    r = client.post("/v1/chat/completions", json=body,
                    headers={"Authorization": "Bearer sk-a"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "tools" and "get_w" in err["message"]
    assert "invalid JSON schema" in err["message"]


@pytest.mark.parametrize("meta", [[1], {"a": 1}, 5])
def test_a_non_string_schema_uri_is_400_not_a_server_error(client, meta):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2,
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {
                "$schema": meta, "type": "object"}}}]}
    r = client.post("/v1/chat/completions", json=body,
                    headers={"Authorization": "Bearer sk-a"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "tools" and "`f`" in err["message"] and "$schema" in err["message"]


def test_a_valid_tool_schema_passes_the_door(client):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "weather?"}],
            "tools": [{"type": "function", "function": {"name": "get_w", "parameters": {
                "$schema": "http://json-schema.org/draft-07/schema#", "type": "object",
                "properties": {"city": {"type": "string", "enum": ["Paris"]}},
                "required": ["city"], "additionalProperties": False}}}]}
    r = client.post("/v1/chat/completions", json=body,
                    headers={"Authorization": "Bearer sk-a"})
    assert r.status_code == 503, r.text  # past the door: no worker to serve it


def test_a_wrong_method_is_405_with_a_code_and_the_allowed_methods(client):
    r = client.get("/v1/completions", headers={"Authorization": "Bearer sk-a"})
    assert r.status_code == 405, r.text
    assert r.json()["error"]["code"] == "method_not_allowed"
    assert r.headers["allow"] == "POST"
    r = client.get("/v1/nothing-here")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
