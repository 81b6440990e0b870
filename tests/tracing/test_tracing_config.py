"""``--otlp-traces-endpoint`` and ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` on the router, the
workers and ``k3serve serve``."""

from __future__ import annotations

import pytest

from k3serve.tracing import ENDPOINT_ENV
from router.config import build_parser, config_from_args
from worker.config import WorkerEnv, parse_config

URL = "http://127.0.0.1:4318/v1/traces"


def test_router_flag_then_environment_then_off(monkeypatch):
    monkeypatch.delenv(ENDPOINT_ENV, raising=False)
    assert config_from_args(build_parser().parse_args([])).otlp_traces_endpoint is None
    monkeypatch.setenv(ENDPOINT_ENV, URL)
    assert config_from_args(build_parser().parse_args([])).otlp_traces_endpoint == URL
    args = build_parser().parse_args(["--otlp-traces-endpoint", "http://h:1"])
    assert config_from_args(args).otlp_traces_endpoint == "http://h:1"


def test_worker_flag_then_environment_then_off(monkeypatch):
    monkeypatch.delenv(ENDPOINT_ENV, raising=False)
    cpu = ["--device", "cpu"]
    assert parse_config("decode", cpu, env=WorkerEnv()).otlp_traces_endpoint is None
    monkeypatch.setenv(ENDPOINT_ENV, URL)
    assert parse_config("prefill", cpu, env=WorkerEnv()).otlp_traces_endpoint == URL
    flag = [*cpu, "--otlp-traces-endpoint", "http://h:1"]
    assert parse_config("decode", flag, env=WorkerEnv()).otlp_traces_endpoint == "http://h:1"


def test_serve_gives_one_flag_to_router_and_workers():
    from deploy.serve import build_parser as serve_parser
    from deploy.serve import passthrough_args

    args = serve_parser().parse_args(["--otlp-traces-endpoint", URL])
    assert passthrough_args(args) == {"router": ["--otlp-traces-endpoint", URL],
                                      "worker": ["--otlp-traces-endpoint", URL]}


def test_check_endpoint_normalizes_or_refuses():
    from k3serve.tracing import check_endpoint

    assert check_endpoint(None) is None and check_endpoint("") is None
    assert check_endpoint("http://127.0.0.1:4318") == "http://127.0.0.1:4318/v1/traces"
    assert check_endpoint("http://127.0.0.1:4318/") == "http://127.0.0.1:4318/v1/traces"
    assert check_endpoint("https://otel.example/v1/traces") == "https://otel.example/v1/traces"
    assert check_endpoint("HTTP://127.0.0.1:4318") == "HTTP://127.0.0.1:4318/v1/traces"
    for bad in ("127.0.0.1:4318", "localhost:4318", "http://", "grpc://h:4317", "http:///",
                "http://:4318", "http://x:abc", "http://x?y=1", "http://x#f", "http://x ",
                "http://x:99999"):
        with pytest.raises(ValueError, match="expected an http\\(s\\) URL"):
            check_endpoint(bad)
