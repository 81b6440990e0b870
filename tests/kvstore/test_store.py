"""The shared Mooncake Store below the workers, live: one ``mooncake_master`` on loopback, two
prefill workers and one decode worker (processes, real Transfer Engine + Store over tcp),
driven through the internal API as the router drives it (reserve → prefill → stream).

* first divergence: after a 200-token shared prefix the first diverging prompt reuses 192
  tokens (log-spaced snapshots, k3-tiny), same greedy tokens as an engine without caching;
* a prefix computed on prefill worker 1, a prompt sharing it forced onto worker 2 → hit from the
  store (``cached_source == "store"``, counted as ``source="store"``), same tokens;
* multi-turn under PD: turn 2 (turn 1 + answer + new text) on the OTHER prefill worker reuses
  the answer up to its last full block (the decode worker put its blocks + end snapshot);
* a small store → eviction, answers stay correct;
* master killed → requests complete as misses; restarted → hits from the store return.
"""

from __future__ import annotations

import asyncio
import random
import time

import httpx
import pytest

from worker_procs import HEADERS, _metric, _request, stop_all
from worker_procs import Proc as _Proc

B = 64
MAX_TOKENS = 4


def Proc(role: str, name: str, block_size: int, log_dir, extra: list[str]) -> _Proc:  # noqa: N802
    """A worker process (the shared helper) with this test's sizes and extra flags
    (``--store-url``)."""
    return _Proc(role, name, block_size, log_dir, pages=256,
                 extra=("--num-slots", "16", *extra))


@pytest.fixture(scope="module")
def stack(tmp_path_factory, monkeypatch_module):
    from deploy.local import start_store_master

    logs = tmp_path_factory.mktemp("store-logs")
    master, url = start_store_master(log_path=str(logs / "master.log"))
    # 3 clients × 16 MiB (the least Mooncake takes): ~100 k3-tiny snapshots — evicts in a test
    monkeypatch_module.setenv("K3SERVE_STORE_SEGMENT_MB", "16")
    monkeypatch_module.setenv("K3SERVE_STORE_RETRY_S", "0.5")
    procs: dict[str, _Proc] = {}
    masters = [master]  # test_master_killed_then_restarted appends the restarted one
    extra = ["--store-url", url]
    try:
        procs["P1"] = Proc("prefill", "p1", B, logs, extra=extra)
        procs["P2"] = Proc("prefill", "p2", B, logs, extra=extra)
        procs["D"] = Proc("decode", "d0", B, logs, extra=extra)
        for p in procs.values():
            p.wait_ready()
        yield {"procs": procs, "master": masters, "url": url, "logs": logs}
    finally:
        # the workers first, all at once, while their master still answers (a worker whose
        # master is gone spends its whole stop timeout unmounting: ~15 s each)
        stop_all(procs.values())
        for m in masters:
            if m.poll() is None:
                m.terminate()
                m.wait(10)


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


@pytest.fixture(scope="module")
def nocache():
    """Greedy tokens of an engine without prefix caching (the reference)."""
    import torch

    from k3serve import LLM, SamplingParams

    torch.set_num_threads(1)
    llm = LLM("k3-tiny", block_size=B, num_pages=256, enable_prefix_caching=False)

    def ref(ids: list[int], max_tokens: int = MAX_TOKENS) -> list[int]:
        return llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=max_tokens))[0] \
            .token_ids

    return ref


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(32, 256) for _ in range(n)]


def _run(P: _Proc, D: _Proc, rid: str, ids: list[int], max_tokens: int = MAX_TOKENS):
    async def go():
        async with httpx.AsyncClient(headers=HEADERS, timeout=120) as c:
            s = {"temperature": 0.0, "max_tokens": max_tokens, "seed": 1}
            return await _request(c, P, D, rid, ids, sampling=s)

    return asyncio.run(go())


def _wait_store_puts(url: str, at_least: float, timeout: float = 20.0) -> None:
    t_end = time.monotonic() + timeout
    while time.monotonic() < t_end:
        if _metric(url, "k3serve:store_operations_total", op="put") + _metric(
                url, "k3serve:store_operations_total", op="skipped") >= at_least:
            return
        time.sleep(0.1)
    raise AssertionError(f"{url}: fewer than {at_least} store puts")


def test_first_divergence_after_200_shared_tokens_hits_192(stack, nocache):
    P1, D = stack["procs"]["P1"], stack["procs"]["D"]
    rng = random.Random(1)
    shared = _ids(rng, 200)
    a, b = shared + _ids(rng, 100), shared + _ids(rng, 60)
    ta, fa = _run(P1, D, "div-a", a)
    tb, fb = _run(P1, D, "div-b", b)
    assert fa["num_cached_tokens"] == 0
    assert fb["num_cached_tokens"] == 192 and fb["cached_source"] == "local"
    assert ta == nocache(a) and tb == nocache(b)


def test_prefix_from_worker_1_hits_from_the_store_on_worker_2(stack, nocache):
    P1, P2, D = (stack["procs"][k] for k in ("P1", "P2", "D"))
    rng = random.Random(2)
    base = _ids(rng, 300)
    t1, _f1 = _run(P1, D, "x-1", base)
    _wait_store_puts(P1.url, 8)  # 4 blocks + snapshots at 64, 128, 192, 256
    q = base[:270] + _ids(rng, 30)
    before = _metric(P2.url, "k3serve:prefix_cache_hits_total", source="store")
    t2, f2 = _run(P2, D, "x-2", q)
    assert f2["num_cached_tokens"] == 256 and f2["cached_source"] == "store"
    assert _metric(P2.url, "k3serve:prefix_cache_hits_total", source="store") - before == 256
    assert t1 == nocache(base) and t2 == nocache(q)
    assert _metric(P2.url, "k3serve:store_bytes_total", direction="get") > 0


def test_turn_2_under_disaggregation_reuses_the_answer(stack, nocache):
    P1, P2, D = (stack["procs"][k] for k in ("P1", "P2", "D"))
    rng = random.Random(3)
    turn1 = _ids(rng, 100)
    toks1, _ = _run(P1, D, "turn-1", turn1, max_tokens=40)
    assert toks1 == nocache(turn1, 40)
    turn2 = turn1 + toks1 + _ids(rng, 20)
    # the decode worker put the answer's blocks and its end-of-answer snapshot
    want = (len(turn1) + len(toks1) - 1) // B * B
    assert want > (len(turn1) - 1) // B * B  # deeper than anything a prefill worker computed
    t_end = time.monotonic() + 20
    while True:
        toks2, f2 = _run(P2, D, f"turn-2-{time.monotonic_ns()}", turn2)
        if f2["num_cached_tokens"] == want or time.monotonic() > t_end:
            break
        time.sleep(0.3)  # the decode worker's puts are asynchronous
    assert f2["num_cached_tokens"] == want and f2["cached_source"] == "store"
    assert toks2 == nocache(turn2)


def test_small_store_evicts_and_answers_stay_correct(stack, nocache):
    P1, P2, D = (stack["procs"][k] for k in ("P1", "P2", "D"))
    rng = random.Random(4)
    prompts = [_ids(rng, 330) for _ in range(24)]  # 5 snapshots each: > the 48 MiB pool
    for i, p in enumerate(prompts):
        toks, _ = _run(P1, D, f"ev-{i}", p)
        assert toks == nocache(p)
    time.sleep(1.0)
    for i in (0, 23):
        q = prompts[i][:300] + _ids(rng, 10)
        toks, f = _run(P2, D, f"ev-q{i}", q)
        assert toks == nocache(q)
        assert f["num_cached_tokens"] in (0, 64, 128, 192, 256)
    failed = sum(_metric(u.url, "k3serve:store_operations_total", op="failed")
                 for u in (P1, P2, D))
    text = (stack["logs"] / "master.log").read_text(errors="replace")
    assert failed > 0 or "evict" in text.lower(), "the store never filled"


def test_master_killed_then_restarted(stack, nocache):
    from deploy.local import start_store_master

    P1, P2, D = (stack["procs"][k] for k in ("P1", "P2", "D"))
    rng = random.Random(5)
    m = stack["master"][0]
    m.kill()
    m.wait()
    a = _ids(rng, 200)
    ta, _fa = _run(P1, D, "dead-a", a)
    q = a[:150] + _ids(rng, 20)
    tq, fq = _run(P2, D, "dead-q", q)  # P2 holds nothing of it; the store is gone
    assert fq["num_cached_tokens"] == 0 and ta == nocache(a) and tq == nocache(q)
    port = int(stack["url"].rsplit(":", 1)[1])
    m2, _ = start_store_master(port=port, log_path=str(stack["logs"] / "master2.log"))
    stack["master"].append(m2)  # the fixture stops it after the workers
    b = _ids(rng, 200)
    t_end = time.monotonic() + 40
    k = 0
    while True:  # the clients notice the master (probe), re-mount, puts resume
        k += 1
        b = _ids(rng, 200)
        _run(P1, D, f"back-b{k}", b)
        time.sleep(0.5)
        qb = b[:150] + _ids(rng, 20)
        tb, fb = _run(P2, D, f"back-q{k}", qb)
        if fb["cached_source"] == "store" or time.monotonic() > t_end:
            break
    assert fb["cached_source"] == "store" and fb["num_cached_tokens"] == 128
    assert tb == nocache(qb)
