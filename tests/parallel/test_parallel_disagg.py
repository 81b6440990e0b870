"""Disaggregated tensor parallelism over Mooncake TE (issue 16, must-show 2).

Worker processes as the router starts them (``python -m prefill.worker --tp 2`` etc.; each
``--tp 2`` worker is rank 0 and starts rank 1 itself, gloo on CPU), driven through the internal
HTTP API (reserve on D → prefill on P → stream from D):

* TP-2 prefill → TP-2 decode: the greedy tokens equal the monolithic offline engine's, every
  transfer succeeded (no decode-side recompute hides a bad transfer);
* TP-2 prefill → TP-1 decode: refused at pairing, as the design says (``k3serve.parallel.layout``:
  no resharding) — 64 concurrent requests all answered 409 with a message naming ``tp``, both
  workers still up, and every slot, page, reservation and ticket free afterwards;
* ``/internal/info`` reports ``tp`` / ``ep``; ``/metrics`` exports the expert load counters;
  the router refuses to register a mismatched pair (``router.workers.check_parallel``).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from pathlib import Path

import httpx
import pytest
from worker_procs import HEADERS, stop_all
from worker_procs import Proc as _Proc

B = 16
MAX_TOKENS = 4


def Proc(role: str, name: str, tp: int, log_dir: Path) -> _Proc:
    """A worker process of a TP-``tp`` instance (the shared helper with this test's sizes)."""
    return _Proc(role, name, B, log_dir, pages=256,
                 extra=("--num-slots", "80", "--num-snapshots", "8", "--tp", str(tp)))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    logs = tmp_path_factory.mktemp("tp-disagg-logs")
    procs: dict[str, Proc] = {}
    try:
        procs["P2"] = Proc("prefill", "p-tp2", 2, logs)
        procs["D2"] = Proc("decode", "d-tp2", 2, logs)
        procs["D1"] = Proc("decode", "d-tp1", 1, logs)
        for p in procs.values():
            p.wait_ready()
        yield procs
    finally:
        stop_all(procs.values())  # at once: the drains overlap


def _prompts() -> list[list[int]]:
    """8 prompts: shorter than a block, exact blocks, across blocks."""
    rng = random.Random(16)
    return [[rng.randrange(32, 256) for _ in range(n)] for n in (3, 9, 16, 17, 31, 33, 40, 5)]


@pytest.fixture(scope="module")
def oracle():
    import torch

    from k3serve import LLM, SamplingParams

    torch.set_num_threads(1)
    llm = LLM("k3-tiny", block_size=B, num_pages=256)
    prompts = _prompts()
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    return [o.token_ids for o in outs]


def _sampling() -> dict:
    return {"temperature": 0.0, "max_tokens": MAX_TOKENS, "seed": 3}


async def _reserve(c: httpx.AsyncClient, D: Proc, rid: str, ids: list[int]) -> dict:
    r = await c.post(D.url + "/internal/reserve", json={
        "request_id": rid, "prompt_token_ids": ids, "sampling": _sampling(), "n": 1})
    assert r.status_code == 200, r.text
    return r.json()


async def _prefill(c: httpx.AsyncClient, P: Proc, rid: str, ids: list[int],
                   res: dict) -> httpx.Response:
    return await c.post(P.url + "/internal/prefill", json={
        "request_id": rid, "prompt_token_ids": ids, "sampling": _sampling(),
        "ticket": res["ticket"], "bootstrap_addr": res["bootstrap_addr"], "snapshot_at": [],
        "cache_salt": None})


async def _request(c: httpx.AsyncClient, P: Proc, D: Proc, rid: str, ids: list[int]) -> list:
    res = await _reserve(c, D, rid, ids)
    p = await _prefill(c, P, rid, ids, res)
    assert p.status_code == 200, p.text
    first = p.json()
    toks = [first["token_id"]]
    body = {"request_id": rid, "token_id": first["token_id"], "logprob": first["logprob"]}
    async with c.stream("POST", D.url + "/internal/stream", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data:") and line[5:].strip() != "[DONE]":
                ev = json.loads(line[5:])
                assert "error" not in ev, ev
                toks += ev["token_ids"]
    return toks


def _metric(url: str, name: str, **labels: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    want = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith((name + "{", name + " "))
               and all(w in line.split("}", 1)[0] for w in want))


def _info(url: str) -> dict:
    r = httpx.get(url + "/internal/info", headers=HEADERS, timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def _wait_idle(url: str, timeout: float = 30.0) -> dict:
    """Usage once nothing is held (or the last reading at the deadline)."""
    t_end = time.monotonic() + timeout
    while True:
        u = _info(url)["usage"]
        busy = (u["slots_used"], u["pages_used"], u.get("num_reserved"),
                u.get("open_tickets"), u.get("unreleased_tickets"),
                u.get("num_transfers_pending"), u["num_engine_requests"])
        if not any(busy) or time.monotonic() > t_end:
            return u
        time.sleep(0.2)


def _clean(u: dict) -> None:
    for k in ("slots_used", "pages_used", "num_reserved", "open_tickets", "unreleased_tickets",
              "num_transfers_pending", "num_engine_requests", "num_running"):
        assert (u.get(k) or 0) == 0, (k, u)


def test_info_reports_tp_and_expert_load_metrics(cluster):
    assert (_info(cluster["P2"].url)["tp"], _info(cluster["P2"].url)["ep"]) == (2, 1)
    assert _info(cluster["D1"].url)["tp"] == 1
    # the TP-2 transfer layout is the whole model's: the same as a TP-1 worker's but for tp
    assert _info(cluster["P2"].url)["kv_layout_hash"] != _info(cluster["D1"].url)["kv_layout_hash"]
    assert _info(cluster["P2"].url)["fingerprint"] == _info(cluster["D1"].url)["fingerprint"]


def test_tp2_prefill_to_tp2_decode_same_tokens_as_monolithic(cluster, oracle):
    P, D = cluster["P2"], cluster["D2"]
    ok_before = _metric(P.url, "k3serve:kv_transfers_total", outcome="success")

    async def main() -> list[list[int]]:
        async with httpx.AsyncClient(headers=HEADERS, timeout=120) as c:
            return await asyncio.gather(*[_request(c, P, D, f"tp2-{i}", ids)
                                          for i, ids in enumerate(_prompts())])

    got = asyncio.run(main())
    assert got == oracle
    # every cache went over the wire (a failed transfer would be recomputed and hide a bug)
    assert _metric(D.url, "k3serve:kv_transfer_fallbacks_total") == 0
    assert _metric(P.url, "k3serve:kv_transfers_total", outcome="success") - ok_before == 8
    routed = _metric(P.url, "k3serve:expert_routed_tokens_total")
    assert routed > 0  # rank 0's expert load counters, exported by the worker
    _clean(_wait_idle(P.url))
    _clean(_wait_idle(D.url))


def test_tp2_prefill_to_tp1_decode_refused_under_64_concurrent(cluster):
    P, D = cluster["P2"], cluster["D1"]
    rng = random.Random(7)
    prompts = [[rng.randrange(32, 256) for _ in range(rng.randrange(2, 40))] for _ in range(64)]

    async def one(c: httpx.AsyncClient, i: int, ids: list[int]) -> httpx.Response:
        res = await _reserve(c, D, f"mix-{i}", ids)
        return await _prefill(c, P, f"mix-{i}", ids, res)

    async def main() -> list[httpx.Response]:
        async with httpx.AsyncClient(headers=HEADERS, timeout=120,
                                     limits=httpx.Limits(max_connections=128)) as c:
            return await asyncio.gather(*[one(c, i, ids) for i, ids in enumerate(prompts)])

    answers = asyncio.run(main())
    for r in answers:
        assert r.status_code == 409, r.text
        body = r.json()
        assert body["error"] == "fingerprint_mismatch", body
        assert "extra.tp: local=2 remote=1" in body["message"], body
    assert P.p.poll() is None and D.p.poll() is None
    _clean(_wait_idle(P.url))
    _clean(_wait_idle(D.url))
    # and the TP-2 pair still serves afterwards
    async def again() -> list[int]:
        async with httpx.AsyncClient(headers=HEADERS, timeout=120) as c:
            return await _request(c, P, cluster["D2"], "after", prompts[0])

    assert len(asyncio.run(again())) == MAX_TOKENS


def test_router_refuses_a_mismatched_tp_pair():
    from k3serve.messages import Capacity, WorkerInfo
    from router.workers import Worker, check_parallel

    def info(role: str, tp: int) -> WorkerInfo:
        return WorkerInfo(role=role, model="k3-tiny", fingerprint="f", block_size=B,
                          capacity=Capacity(num_pages=8, num_slots=2, num_snapshots=0), tp=tp)

    p2 = Worker("http://p", info("prefill", 2))
    check_parallel("http://d", info("decode", 2), [p2])
    with pytest.raises(ValueError, match=r"tp: worker http://d \(decode\) has tp=1.*tp=2"):
        check_parallel("http://d", info("decode", 1), [p2])
