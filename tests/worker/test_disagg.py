"""Prefill/decode disaggregation end to end: equal tokens, fallback, refused pairing, no leaks.

One prefill and one decode worker *process* (``python -m prefill.worker`` / ``decode.worker``)
with the real Mooncake Transfer Engine over tcp loopback, driven through the internal HTTP API
(k3serve/protocol.py) the router speaks: reserve on D → prefill on P (token #1) → stream from D.

* 20 prompts of mixed lengths (shorter than a block, exact blocks, shared prefixes, repeats):
  greedy tokens equal the monolithic offline engine's (``k3serve.LLM``) for every prompt;
* injected transfer failure (per-request hook) → the decode worker recomputes → same tokens,
  counted in ``k3serve:kv_transfer_fallbacks_total``; the recompute continues from the prefill
  worker's token #1 even where the decode worker would have sampled another one;
* a decode worker with another block size → the pairing is refused with a message naming it;
* 200 aborts at every stage → no page, slot, reservation or ticket left on either side.
"""

from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
import pytest
from worker_procs import (
    HEADERS,
    MAX_TOKENS,
    Proc,
    _first,
    _metric,
    _request,
    _sampling,
    stop_all,
)

B = 16


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    logs = tmp_path_factory.mktemp("disagg-logs")
    procs: dict[str, Proc] = {}
    try:  # a worker that fails to start must not leave the others running
        procs["P"] = Proc("prefill", "p0", B, logs)
        procs["D"] = Proc("decode", "d0", B, logs)
        procs["D32"] = Proc("decode", "d32", 2 * B, logs, pages=64)
        for p in procs.values():
            p.wait_ready()
        yield procs
    finally:
        stop_all(procs.values())  # at once: the drains overlap
        for p in procs.values():
            assert p.p.returncode is not None


def _prompts() -> list[list[int]]:
    """20 prompts: shorter than a block, exact blocks, shared prefixes, exact repeats."""
    rng = random.Random(4)
    ids = lambda n: [rng.randrange(32, 256) for _ in range(n)]
    shared = ids(40)
    wave1 = [ids(3), ids(9), ids(15), ids(16), ids(17), ids(31), ids(33), ids(64),
             shared + ids(7), ids(90)]
    wave2 = [shared + ids(12), shared + ids(30), shared[:32] + ids(5), list(wave1[7]),
             list(wave1[9]), list(wave1[3]), ids(1), ids(48), wave1[6] + ids(20), ids(130)]
    return wave1 + wave2


@pytest.fixture(scope="module")
def offline():
    """The monolithic offline engine (same model, block size)."""
    import torch

    from k3serve import LLM

    torch.set_num_threads(1)
    return LLM("k3-tiny", block_size=B, num_pages=512)


@pytest.fixture(scope="module")
def oracle(offline):
    """Greedy tokens of the monolithic offline engine for every prompt."""
    from k3serve import SamplingParams

    llm = offline
    prompts = _prompts()
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    return {tuple(p): o.token_ids for p, o in zip(prompts, outs)}


# ============================================================================ client helpers
def _usage(url: str) -> dict:
    r = httpx.get(url + "/internal/info", headers=HEADERS, timeout=10)
    assert r.status_code == 200, r.text
    return r.json()["usage"]


# ============================================================================ tests
def test_internal_api_requires_the_cluster_token(cluster):
    P, D = cluster["P"], cluster["D"]
    assert httpx.get(D.url + "/internal/info", timeout=5).status_code == 403
    assert httpx.post(P.url + "/internal/prefill", json={}, timeout=5).status_code == 403
    info = httpx.get(P.url + "/internal/info", headers=HEADERS, timeout=5).json()
    assert info["role"] == "prefill" and info["block_size"] == B and info["model"] == "k3-tiny"
    assert {"fingerprint", "capacity", "max_model_len", "worker_id"} <= set(info)
    bad = httpx.post(P.url + "/internal/prefill", headers=HEADERS, timeout=5,
                     json={"request_id": "x", "prompt_token_ids": "abc"})
    assert bad.status_code == 400 and "prompt_token_ids" in bad.json()["message"]


def _load(url: str) -> dict:
    """The load a worker reports with its cache events (``WorkerLoad``)."""
    r = httpx.get(url + "/internal/cache_events", params={"after": 1 << 40},
                  headers=HEADERS, timeout=10)
    assert r.status_code == 200, r.text
    return r.json()["load"]


def test_twenty_prompts_equal_the_monolithic_engine(cluster, oracle):
    P, D = cluster["P"], cluster["D"]
    prompts = _prompts()
    before = _load(P.url)

    async def run() -> list[tuple[list[int], dict]]:
        async with httpx.AsyncClient(headers=HEADERS, timeout=120) as c:
            w1 = await asyncio.gather(*(_request(c, P, D, f"eq-{i}", p)
                                        for i, p in enumerate(prompts[:10])))
            w2 = await asyncio.gather(*(_request(c, P, D, f"eq-{i + 10}", p)
                                        for i, p in enumerate(prompts[10:])))
            return w1 + w2

    got = asyncio.run(run())
    for p, (toks, _) in zip(prompts, got):
        assert toks == oracle[tuple(p)], f"prompt of {len(p)} tokens"
    # wave 2 reused wave 1's cache on the prefill worker: exact repeats hit ⌊(L−1)/B⌋·B
    for k in (13, 14, 15):
        L = len(prompts[k])
        assert got[k][1]["num_cached_tokens"] == (L - 1) // B * B, (k, L)
    assert got[10][1]["num_cached_tokens"] >= 32  # shared 40-token prefix: 2 blocks
    # the prefill counters (router replicas' pool-wide util / request rate): 20 admitted,
    # their uncached prompt tokens; a decode worker does not count them
    after = _load(P.url)
    assert after["prefills"] - before["prefills"] == 20
    assert after["prefill_tokens"] - before["prefill_tokens"] == sum(
        len(p) - g[1]["num_cached_tokens"] for p, g in zip(prompts, got))
    assert _load(D.url)["prefills"] is None
    assert _metric(P.url, "k3serve:kv_transfer_bytes_total") > 0
    assert _metric(P.url, "k3serve:prefix_cache_hits_total") > 0
    # the in-stack transfer rate's figures: bytes of successful transfers, and their seconds
    # from the last layer ready to the last write confirmed
    wb = _metric(P.url, "k3serve:kv_transfer_write_bytes_total")
    assert 0 < wb <= _metric(P.url, "k3serve:kv_transfer_bytes_total")
    assert _metric(P.url, "k3serve:kv_transfer_write_seconds_total") >= 0


def test_injected_transfer_failure_falls_back_to_the_same_tokens(cluster, oracle):
    P, D = cluster["P"], cluster["D"]
    prompts = _prompts()
    picks = [0, 7, 9]  # 3 tokens, 4 blocks, 90 tokens
    before = _metric(D.url, "k3serve:kv_transfer_fallbacks_total")
    failed_before = _metric(P.url, "k3serve:kv_transfers_total", outcome="failed")

    async def run():
        async with httpx.AsyncClient(headers=HEADERS, timeout=120) as c:
            return await asyncio.gather(*(
                _request(c, P, D, f"fail-{i}", prompts[i], debug_fail_transfer_n=10)
                for i in picks))

    for i, (toks, _) in zip(picks, asyncio.run(run())):
        assert toks == oracle[tuple(prompts[i])]
    assert _metric(D.url, "k3serve:kv_transfer_fallbacks_total") == before + len(picks)
    # the sender counts its failed transfers (on its own engine tick: allow it a moment)
    t_end = time.monotonic() + 10
    while (_metric(P.url, "k3serve:kv_transfers_total", outcome="failed")
           < failed_before + len(picks)) and time.monotonic() < t_end:
        time.sleep(0.05)
    failed = _metric(P.url, "k3serve:kv_transfers_total", outcome="failed")
    assert failed == failed_before + len(picks), (failed_before, failed)


def test_fallback_continues_from_the_prefill_workers_token(cluster, offline):
    """After a failed transfer the decode worker recomputed the prompt and sampled its own
    token #1, trusting (seed, position) sampling to reproduce the prefill worker's — which the
    client already has; a near-tie or a missing seed made them differ. It now continues from
    the prefill worker's token #1 (passed when the stream is opened). Forced here: the decode
    worker's params carry another seed, so its own token #1 differs from the prefill's."""
    from k3serve import SamplingParams

    P, D = cluster["P"], cluster["D"]
    rng = random.Random(99)
    ids = [rng.randrange(32, 256) for _ in range(37)]  # cached nowhere yet
    d_sp = {"temperature": 1.0, "max_tokens": MAX_TOKENS, "seed": 21, "ignore_eos": True}
    own = offline.generate([ids], SamplingParams(**d_sp))[0].token_ids  # D's own choice
    p_seed = next(s for s in range(22, 200) if offline.generate(
        [ids], SamplingParams(**{**d_sp, "seed": s, "max_tokens": 1}))[0].token_ids[0] != own[0])
    p_sp = {**d_sp, "seed": p_seed}
    before = _metric(D.url, "k3serve:kv_transfer_fallbacks_total")

    async def run():
        async with httpx.AsyncClient(headers=HEADERS, timeout=120) as c:
            return await _request(c, P, D, "fb-exact", ids, sampling=d_sp, prefill_sampling=p_sp,
                                  debug_fail_transfer_n=10)

    toks, first = asyncio.run(run())
    t1 = first["token_id"]
    assert t1 != own[0] and toks[0] == t1
    eng = offline.engine
    eng.add_request("fb-oracle", ids, SamplingParams(**d_sp), output_token_ids=[t1])
    expect = None
    while expect is None:
        expect = next((o.token_ids for o in eng.step() if o.finished), None)
    assert toks == expect  # t1, then D's continuation of t1 (positions L+1..)
    assert _metric(D.url, "k3serve:kv_transfer_fallbacks_total") == before + 1


def test_the_workers_text_is_the_offline_text(cluster, offline):
    """The workers detokenize and decide the stops, once, as offline: P's token #1 text and
    D's stream text (what the router relays as is) make the offline output text with a stop
    string cut where offline cuts it, the finish is offline's, and D's per-token texts (sent
    with logprobs) add up to its text."""
    from k3serve import SamplingParams

    P, D = cluster["P"], cluster["D"]
    ids = list(range(60, 101))
    base = {"temperature": 0.0, "max_tokens": 24, "seed": 5, "ignore_eos": True}
    full = offline.generate([ids], SamplingParams(**base))[0].text
    stop = next(full[i:i + 2] for i in range(4, len(full) - 1) if "\ufffd" not in full[i:i + 2])
    sp = {**base, "stop": [stop], "logprobs": 0}
    want = offline.generate([ids], SamplingParams(**sp))[0]
    assert want.finish_reason == "stop"

    async def run() -> tuple[dict, list[dict]]:
        async with httpx.AsyncClient(headers=HEADERS, timeout=120) as c:
            first = await _first(c, P, D, "text-1", ids, sp)
            body = {"request_id": "text-1", "token_id": first["token_id"],
                    "logprob": first["logprob"]}
            evs = []
            async with c.stream("POST", D.url + "/internal/stream", json=body) as s:
                async for line in s.aiter_lines():
                    if line.startswith("data:") and line[5:].strip() != "[DONE]":
                        evs.append(json.loads(line[5:]))
            return first, evs

    first, evs = asyncio.run(run())
    assert first["finish_reason"] is None
    assert first["text"] + "".join(e["text"] for e in evs) == want.text
    assert [first["token_id"], *(t for e in evs for t in e["token_ids"])] == want.token_ids
    assert evs[-1]["finish_reason"] == "stop"
    for e in evs:
        if e["token_ids"]:
            assert len(e["texts"]) == len(e["token_ids"]) and "".join(e["texts"]) == e["text"]


def test_a_stream_whose_token_1_differs_from_the_transfer_s_ends_with_an_error(cluster):
    """Token #1 has one source, the prefill worker's answer (what the client got); the
    transfer's copy lets D start early. A stream request whose token #1 differs from the
    transferred one D already continued from ends with an error event (the router then
    migrates with the client's tokens) instead of a warning and a continuation of another
    token."""
    P, D = cluster["P"], cluster["D"]
    rid, ids = "t1-mismatch", list(range(100, 137))
    sampling = {"temperature": 0.0, "max_tokens": 400, "seed": 3, "ignore_eos": True}

    async def run() -> list[dict]:
        async with httpx.AsyncClient(headers=HEADERS, timeout=120) as c:
            first = await _first(c, P, D, rid, ids, sampling)
            phase = None
            for _ in range(400):  # until D admitted the transferred cache
                r = await c.get(D.url + "/internal/requests", params={"request_id": rid})
                phase = r.json()["requests"].get(rid, {}).get("phase")
                if phase != "transfer":
                    break
                await asyncio.sleep(0.025)
            assert phase == "running", phase
            body = {"request_id": rid, "token_id": (first["token_id"] + 1) % 256,
                    "logprob": None}
            evs = []
            async with c.stream("POST", D.url + "/internal/stream", json=body) as s:
                assert s.status_code == 200
                async for line in s.aiter_lines():
                    if line.startswith("data:") and line[5:].strip() != "[DONE]":
                        evs.append(json.loads(line[5:]))
            return evs

    evs = asyncio.run(run())
    assert "differs from the transferred" in evs[-1]["error"], evs[-1]
    assert evs[-1]["finish_reason"] == "abort"


def test_mismatched_fingerprint_is_refused_at_pairing(cluster):
    P, D32 = cluster["P"], cluster["D32"]
    ids = list(range(40, 80))
    with httpx.Client(headers=HEADERS, timeout=60) as c:
        res = c.post(D32.url + "/internal/reserve", json={
            "request_id": "fp-1", "prompt_token_ids": ids, "sampling": _sampling()}).json()
        p = c.post(P.url + "/internal/prefill", json={
            "request_id": "fp-1", "prompt_token_ids": ids, "sampling": _sampling(),
            "ticket": res["ticket"], "bootstrap_addr": res["bootstrap_addr"]})
        assert p.status_code == 409, p.text
        body = p.json()
        assert body["error"] == "fingerprint_mismatch"
        assert "layout fingerprint mismatch" in body["message"]
        assert "block_size: local=16 remote=32" in body["message"]
        c.post(D32.url + "/internal/abort", json={"request_id": "fp-1"})
    _wait_clean(P.url, D32.url)


def _wait_clean(p_url: str, d_url: str, timeout: float = 30.0) -> tuple[dict, dict]:
    t_end = time.monotonic() + timeout
    while True:
        up, ud = _usage(p_url), _usage(d_url)
        clean = (
            up["slots_used"] == up["pages_used"] == up["num_engine_requests"] == 0
            and up["num_reserved"] == 0
            and ud["slots_used"] == ud["pages_used"] == ud["num_engine_requests"] == 0
            and ud["num_reserved"] == ud["open_tickets"] == ud["unreleased_tickets"] == 0
            and ud["num_transfers_pending"] == 0
        )
        if clean:
            return up, ud
        assert time.monotonic() < t_end, (up, ud)
        time.sleep(0.2)


def test_200_aborts_leave_no_reserved_page_or_slot(cluster):
    """Aborts at every stage: before the prefill, racing the pairing, during / after the
    transfer (decode side), and on the prefill side mid-flight."""
    P, D = cluster["P"], cluster["D"]
    rng = random.Random(11)

    async def one(c: httpx.AsyncClient, i: int) -> str:
        rid = f"ab-{i}"
        n = rng.choice((100, 200, 300) if i % 4 == 1 else (5, 20, 40, 70))
        ids = [rng.randrange(32, 256) for _ in range(n)]
        res = (await c.post(D.url + "/internal/reserve", json={
            "request_id": rid, "prompt_token_ids": ids, "sampling": _sampling()})).json()
        body = {"request_id": rid, "prompt_token_ids": ids, "sampling": _sampling(),
                "ticket": res["ticket"], "bootstrap_addr": res["bootstrap_addr"]}
        abort_d = lambda: c.post(D.url + "/internal/abort", json={"request_id": rid})
        stage = i % 4
        if stage == 0:  # before any prefill
            await abort_d()
            return "early"
        if stage == 1:  # the sender paired (layer-by-layer writes may be landing): abort D
            pre = asyncio.create_task(c.post(P.url + "/internal/prefill", json=body))
            state = None
            while not pre.done():
                q = (await c.get(D.url + "/internal/requests", params={"request_id": rid}))
                # no ticket_state: D holds no ticket for it any more (the transfer ended)
                state = q.json()["requests"][rid].get("ticket_state")
                if state in ("WAITING_FOR_INPUT", "TRANSFERRING"):
                    break
                await asyncio.sleep(0.005)
            await abort_d()
            st = (await pre).status_code
            assert st in (200, 409), st
            return f"mid-{state}-{st}"
        if stage == 2:  # token #1 is out; the transfer may still be running
            pre = await c.post(P.url + "/internal/prefill", json=body)
            assert pre.status_code in (200, 409), pre.text
            await abort_d()
            return "after"
        # prefill side aborts mid-flight (the router cancelling), then the decode side
        pre = asyncio.create_task(c.post(P.url + "/internal/prefill", json=body))
        await asyncio.sleep(rng.random() * 0.05)  # a random abort point, not a wait
        await c.post(P.url + "/internal/abort", json={"request_id": rid})
        await abort_d()
        st = (await pre).status_code
        assert st in (200, 409), st
        return f"p-abort-{st}"

    async def run() -> list[str]:
        async with httpx.AsyncClient(headers=HEADERS, timeout=60) as c:
            out: list[str] = []
            for k in range(0, 200, 25):
                out += await asyncio.gather(*(one(c, i) for i in range(k, k + 25)))
            return out

    kinds = asyncio.run(run())
    assert len(kinds) == 200
    paired = sum(k.startswith(("mid-WAITING", "mid-TRANSFERRING")) for k in kinds)
    assert paired >= 25, kinds  # most stage-1 aborts hit a paired ticket mid-transfer
    print(sorted(__import__("collections").Counter(kinds).items()))
    _wait_clean(P.url, D.url)
    # the cluster still works afterwards
    toks, _ = asyncio.run(_one_more(P, D))
    assert 1 <= len(toks) <= MAX_TOKENS


async def _one_more(P: Proc, D: Proc):
    async with httpx.AsyncClient(headers=HEADERS, timeout=60) as c:
        return await _request(c, P, D, "after-aborts", list(range(50, 90)))
