"""A live router with fake workers registered (:mod:`deploy.fake_workers`), in-process:
what the router's tests and the router benchmarks run against."""

from __future__ import annotations

import functools
import ssl
import time
from typing import Any

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from deploy.fake_workers import API_KEY, MODEL, TOKEN, ServerThread, start_worker
from k3serve.protocol import CLUSTER_TOKEN_HEADER
from router.app import RouterConfig, create_app
from router.config import ROUTER_HTTP, ROUTER_LOOP


@functools.cache
def _tls() -> ssl.SSLContext:
    """httpx's default verifying context, built once (each new one loads the CA bundle, ~18 ms
    of CPU): the ``verify=`` of this module's one-call requests."""
    return httpx.create_ssl_context()


class Stack:
    """A live router (``ServerThread``) with fake prefill and decode workers registered.

    Args:
        num_prefill / num_decode: Fake workers to start (``start_worker``).
        api_key: The router's API key (``None``: open).
        worker: :class:`FakeState` fields set on every fake worker before it registers (e.g.
            ``{"max_model_len": 256}``: what its ``/internal/info`` reports).
        **config: Further :class:`RouterConfig` fields (``poll_interval_s`` is 0.02 and
            ``policy`` ``cache_aware`` unless given).
    """

    def __init__(self, num_prefill: int = 2, num_decode: int = 1, api_key: str | None = API_KEY,
                 worker: dict[str, Any] | None = None, **config: Any) -> None:
        config.setdefault("poll_interval_s", 0.02)
        config.setdefault("policy", "cache_aware")
        self.app = create_app(RouterConfig(model=MODEL, api_key=api_key, cluster_token=TOKEN,
                                           **config))
        self.router = self.app.state.router
        self.auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # served as router/__main__.py serves it
        self.srv = ServerThread(self.app, http=ROUTER_HTTP, loop=ROUTER_LOOP).start()
        self.url = self.srv.url
        self.prefill: list = []
        self.decode: list = []
        try:  # stop what was started when a later start or registration fails
            for _ in range(num_prefill):
                self.prefill.append(start_worker("prefill", TOKEN))
            for _ in range(num_decode):
                self.decode.append(start_worker("decode", TOKEN))
            for st, _ in self.prefill + self.decode:
                for k, v in (worker or {}).items():
                    setattr(st, k, v)
                # a 503 (the router could not read the worker's info within its poll timeout,
                # which a test may set far below a loaded machine's latency) is tried again for
                # up to 10 s, as a real worker's registration does (worker/registration.py)
                deadline = time.monotonic() + 10.0
                while True:
                    r = httpx.post(self.url + "/internal/register", json={"url": st.url},
                                   headers={CLUSTER_TOKEN_HEADER: TOKEN}, verify=_tls())
                    if r.status_code != 503 or time.monotonic() > deadline:
                        break
                    time.sleep(0.1)
                if r.status_code != 200:
                    raise RuntimeError(f"registering {st.url}: HTTP {r.status_code}: {r.text}")
        except BaseException:
            self.close()
            raise
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key=api_key or "none",
                                    max_retries=0)

    def post(self, path: str, body=None, key: str | None = API_KEY, **kw) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.post(self.url + path, json=body, headers=headers, timeout=30,
                          **{"verify": _tls(), **kw})

    def health(self) -> dict:
        return httpx.get(self.url + "/health", params={"detail": 1}, headers=self.auth,
                         verify=_tls()).json()

    def wait_indexed(self, snapshots: int = 1, timeout: float = 10.0) -> None:
        """Wait until the router's index holds ``snapshots`` prefill snapshots in total."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = sum(w["snapshots"] for w in self.health()["workers"] if w["role"] == "prefill")
            if got >= snapshots:
                return
            time.sleep(0.02)
        raise AssertionError("router index never caught up with the workers' events")

    def metrics(self) -> dict[str, float]:
        out = {}
        for fam in text_string_to_metric_families(httpx.get(self.url + "/metrics",
                                                                  headers=self.auth,
                                                                  verify=_tls()).text):
            for s in fam.samples:
                lab = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{lab}}}"] = s.value
        return out

    def close(self) -> None:
        for _, srv in self.prefill + self.decode:
            srv.stop()
        self.srv.stop()
