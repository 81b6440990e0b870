"""``ignore_eos`` (vLLM's extension, what ``k3serve bench`` sends): the router passes it to the
workers and generates past EOS to exactly ``max_tokens``; without it EOS ends the answer.

The served k3-tiny never samples EOS (it was trained on files separated by ``<|bos|>`` only),
so the live stack cannot show the difference: fake workers (deploy/fake_workers.py) whose toy
model emits EOS as token #3 stand in for it, behind the real router over HTTP. The engine's
own handling of ``ignore_eos`` is tests/engine/test_sampler.py's.
"""

from __future__ import annotations

import httpx
import pytest

from deploy.fake_workers import TOKENIZER, ServerThread, start_worker
from k3serve.protocol import CLUSTER_TOKEN_HEADER
from router.app import RouterConfig, create_app
from router.config import ROUTER_HTTP, ROUTER_LOOP

TOKEN = "cluster-secret"


@pytest.fixture(scope="module")
def stack():
    app = create_app(RouterConfig(model="k3-tiny", cluster_token=TOKEN, poll_interval_s=0.02))
    srv = ServerThread(app, http=ROUTER_HTTP, loop=ROUTER_LOOP).start()  # the router's server, as served
    workers = []
    try:
        workers = [start_worker("prefill", TOKEN), start_worker("decode", TOKEN)]
        for st, _ in workers:
            st.eos_at = 3
            r = httpx.post(srv.url + "/internal/register", json={"url": st.url},
                           headers={CLUSTER_TOKEN_HEADER: TOKEN})
            assert r.status_code == 200, r.text
        yield srv.url, workers[0][0]
    finally:
        for _, w in workers:
            w.stop()
        srv.stop()


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_ignore_eos_generates_exactly_max_tokens(stack, stream):
    url, prefill = stack
    body = {"model": "k3-tiny", "prompt": "count", "max_tokens": 7, "temperature": 0.0,
            "stream": stream, **({"stream_options": {"include_usage": True}} if stream else {})}

    def complete(extra: dict) -> tuple[int, str]:
        r = httpx.post(url + "/v1/completions", json={**body, **extra}, timeout=30)
        assert r.status_code == 200, r.text
        if not stream:
            d = r.json()
            return d["usage"]["completion_tokens"], d["choices"][0]["finish_reason"]
        import json

        chunks = [json.loads(x[5:]) for x in r.text.splitlines()
                  if x.startswith("data:") and x[5:].strip() != "[DONE]"]
        fin = [c["choices"][0].get("finish_reason") for c in chunks if c.get("choices")]
        return chunks[-1]["usage"]["completion_tokens"], [f for f in fin if f][-1]

    assert complete({}) == (3, "stop")  # EOS (token #3) ends the answer, counted
    n0 = len(prefill.prefills)
    assert complete({"ignore_eos": True}) == (7, "length")
    sent = prefill.prefills[n0]["sampling"]
    assert sent["ignore_eos"] is True
    assert TOKENIZER.eos_token_id not in sent["stop_token_ids"]
    assert prefill.prefills[0]["sampling"]["ignore_eos"] is False


def test_ignore_eos_must_be_a_bool(stack):
    url, _ = stack
    r = httpx.post(url + "/v1/completions", json={"model": "k3-tiny", "prompt": "x",
                                                  "max_tokens": 2, "ignore_eos": "yes"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "ignore_eos", r.text
