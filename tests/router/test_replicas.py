"""Router replicas (issue 19): ``python -m router --replicas N`` behind one address.

With the fake workers (deploy/fake_workers.py) and the committed traces, one request at a
time: 4 replicas keep the hit rate within 2 points and the prefill load balance (computed
tokens, max / mean) within 0.05 of one router on the committed Mooncake slice (issue 19's
bounds; 5 points / 0.15 on the conversation trace) — cost ties break by rendezvous hashing of
the prompt's content, so replicas with the same view of the workers choose the same worker —
``cached_tokens`` and the aggregated metrics exact (one scrape of the address = the sum over
the replicas: prometheus-client's multiprocess mode); SIGKILL of one replica mid-load: its clients' streams fail visibly (no ``[DONE]``), every other stream
completes with the oracle's text, new requests are served, the supervisor starts the replica
again and the running gauge returns to 0. Units: the tie-break, the registry fan-out, the
load figures placement reads, the launcher and Ray config plumbing.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from cli.bench.workload import trace_load
from deploy.fake_workers import TOKENIZER, free_port, start_worker, toy_generate
from k3serve.messages import Capacity, WorkerInfo, WorkerLoad
from k3serve.protocol import CLUSTER_TOKEN_HEADER
from k3serve.sampling import SamplingParams
from router.policies.load import RecentLoad
from router.replicas import REPLICA_HEADER, Registry
from router.sse import SSEReader
from router.workers import Worker

TOKEN = "replica-secret"
MODEL = "k3-tiny"
ROOT = Path(__file__).resolve().parents[2]
#: The committed Mooncake slice (little reuse in its first rows: its snapshot ceiling there is
#: 2 %) and the committed conversation trace (ceiling 47 % over the same number of rows).
TRACES = (ROOT / "tests" / "data" / "trace_3000_3399.jsonl",
          ROOT / "tests" / "data" / "conversation_trace.jsonl")
ROWS = 48  # rows replayed per trace and router
POLL_S = 0.02  # the routers' cache-event poll interval
#: pause before each replayed request: every replica has pulled the workers' events and load
#: since the last answer (2.5 polls), so each places on the same view one router has
GAP_S = 0.05


def _fresh() -> httpx.Limits:
    """Client limits that open a new connection per request (no keep-alive): the kernel hands
    each to one replica. One client per stack or replay: a client builds its TLS context at
    creation (~20 ms idle, 0.2 s on a crowded box), a cost the test paid per request before."""
    return httpx.Limits(max_keepalive_connections=0)


class ReplicaStack:
    """Fresh fake workers (2 prefill + 1 decode, in this process) and a router of ``n``
    replicas in its own process (``n = 1``: the plain router, one process)."""

    def __init__(self, n: int) -> None:
        self.workers = [start_worker("prefill", TOKEN), start_worker("prefill", TOKEN),
                        start_worker("decode", TOKEN)]
        for st, _ in self.workers:  # room for the slice's prefixes (16 k tokens each), and
            st.num_pages = 1024  # prefills that take time (50 µs / token): real queues,
            st.prefill_s_per_token = 5e-5  # which the workers report to every replica
            st.restart()
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.http = httpx.Client(timeout=10, limits=_fresh())
        env = {**os.environ, "K3SERVE_CLUSTER_TOKEN": TOKEN}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "router", "--port", str(self.port), "--model", MODEL,
             "--poll-interval", str(POLL_S), "--replicas", str(n),
             # the fakes' rate (50 µs / token): what is left of a reported queue is aged by it
             "--prefill-rate", str(round(1 / self.workers[0][0].prefill_s_per_token))],
            env=env, cwd=ROOT)
        try:
            self._register(n)
        except BaseException:
            self.close()
            raise

    def _register(self, n: int) -> None:
        deadline = time.monotonic() + 120  # a bound for a crowded box, not a target
        while True:
            try:
                self.http.get(self.url + "/health", timeout=2)
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline, "router did not start"
                time.sleep(0.05)
        for st, _ in self.workers:  # each reaches one replica; the registry fans it out
            r = self.http.post(self.url + "/internal/register", json={"url": st.url},
                               headers={CLUSTER_TOKEN_HEADER: TOKEN})
            assert r.status_code == 200, r.text
        while n > 1 and len(self.replica_pids()) < n:
            assert time.monotonic() < deadline, "replicas did not start"
            time.sleep(0.05)
        ok = 0  # fresh connections reach the replicas: all must see every worker (a replica
        while ok < 4 * n:  # reads the registry every 0.25 s once it runs)
            h = self.http.get(self.url + "/health").json()
            ok = ok + 1 if h["num_workers_healthy"] == 3 else 0
            assert time.monotonic() < deadline, f"a replica does not see every worker: {h}"
            time.sleep(0.02)

    @property
    def prefill(self):
        return [st for st, _ in self.workers[:2]]

    @property
    def decode(self):
        return self.workers[2][0]

    def replica_pids(self) -> dict[int, int]:
        """Replica index → pid of the live replicas."""
        out = {}
        for c in psutil.Process(self.proc.pid).children():
            try:  # a killed replica not reaped yet is a zombie: not live
                argv = " ".join(c.cmdline())
            except (psutil.ZombieProcess, psutil.NoSuchProcess):
                continue
            # its process title (``k3serve router replica I :PORT``), or its argv before that
            m = re.search(r"(?:--replica-index|router replica) (\d+)", argv)
            if m:
                out[int(m.group(1))] = c.pid
        return out

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for fam in text_string_to_metric_families(self.http.get(self.url + "/metrics").text):
            for s in fam.samples:
                out[s.name] = out.get(s.name, 0.0) + s.value
        return out

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.http.close()
        for _, srv in self.workers:
            srv.stop()


def replay(stack: ReplicaStack, trace: Path) -> dict:
    """The first ``ROWS`` rows of ``trace`` through ``stack``, one request at a time in
    arrival order, each on a new connection (token-id prompts, one trace block = one 16-token
    block, 1 token each): hit rate, computed-token balance over the prefill workers
    (max / mean), Σ prompt / cached tokens, the replicas that answered.

    One at a time: a router's choice then depends on the workers' state, not on which of
    several concurrent requests it happened to place first (at concurrency 4 one router
    alone moved by 8 points between runs: README). Each after ``GAP_S``: every replica then
    has the workers' report since the last answer — without it a replica that had not pulled
    yet (up to a poll and its lag on a crowded box) placed as if the last request had not
    been sent (it missed the last request in 18 of 48 decisions at a 0.05 s poll), which
    moved the slice's balance by up to 0.052 (README)."""
    work = trace_load(trace, limit=ROWS, length_scale=16 / 512, vocab_size=256,
                      max_model_len=4096)
    before = [len(st.prefills) for st in stack.prefill]

    async def run() -> list[dict]:
        out = []
        async with httpx.AsyncClient(timeout=60, limits=_fresh()) as c:
            for req in work.requests:
                await asyncio.sleep(GAP_S)
                r = await c.post(stack.url + "/v1/completions", json={
                    "model": MODEL, "prompt": req.prompt, "max_tokens": 1, "temperature": 0})
                assert r.status_code == 200, r.text
                out.append({"usage": r.json()["usage"],
                            "replica": r.headers.get(REPLICA_HEADER)})
        return out

    res = asyncio.run(run())
    prompt = sum(r["usage"]["prompt_tokens"] for r in res)
    cached = sum(r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in res)
    load = [sum(len(p["prompt_token_ids"]) - p["_cached"] for p in st.prefills[b:])
            for st, b in zip(stack.prefill, before, strict=True)]
    return {"hit": cached / prompt, "balance": max(load) / (sum(load) / len(load)),
            "prompt": prompt, "cached": cached, "replicas": {r["replica"] for r in res},
            "n": len(res)}


@pytest.fixture(scope="module")
def single() -> list[dict]:
    """One router's figures on both traces (fresh workers; its stack is stopped before the
    replicas' starts, so the two never share the box's cores)."""
    s = ReplicaStack(1)
    try:
        return [replay(s, t) for t in TRACES]
    finally:
        s.close()


@pytest.fixture(scope="module")
def four():
    s = ReplicaStack(4)
    yield s
    s.close()


def test_four_replicas_keep_hit_rate_balance_and_exact_metrics(single, four):
    got = [replay(four, t) for t in TRACES]
    print("one router:", single, "\n4 replicas:", got)
    # Issue 19's bounds (2 points / 0.05) on the committed Mooncake slice, as the issue
    # states them; on the conversations (hot prefixes) 5 points / 0.15: there one placement
    # that flips moves the two workers' balance by 0.05-0.09, and one router alone spans
    # 41.0-43.5 % / 1.000-1.103 between runs on a shared box (README). Ties break by
    # rendezvous hashing of the prompt's content address (router.placement.tie_breaks), not
    # by each replica's own request count over its own worker order: replicas that see the
    # same worker states choose the same worker. The slice's gap was 0.058-0.065 (1.0757 /
    # 1.0758 against 1.011-1.018) before the replicas read what one router reads: the
    # workers' prefill counters (WorkerLoad.prefills / prefill_tokens: pool-wide util and
    # request_rate — the externality term decided most of the slice's near-balanced
    # placements on each replica's own quarter of the requests) and what is left of a
    # reported queue (aged by the worker's rate, less the router's own answered prefills: a
    # report a poll old priced the last worker ~1.5 × Q / rate seconds higher). README:
    # the figures.
    for (g, b), (hit, bal) in zip(zip(got, single, strict=True), ((0.02, 0.05), (0.05, 0.15)),
                                  strict=True):
        assert g["n"] == b["n"] >= ROWS - 2
        assert len(g["replicas"]) >= 3, g["replicas"]  # the load really spread
        assert abs(g["hit"] - b["hit"]) <= hit, (g, b)
        assert abs(g["balance"] - b["balance"]) <= bal, (g, b)
    assert single[1]["hit"] > 0.3  # the conversations share prefixes: a comparison that can fail
    m = four.metrics()  # one scrape: every replica's samples, summed (router/replicas.py)
    prompt, cached = sum(g["prompt"] for g in got), sum(g["cached"] for g in got)
    assert m["k3serve:request_prompt_tokens_total"] == prompt
    assert m["k3serve:request_cached_tokens_total"] == cached
    assert m["k3serve:cache_hit_rate"] == pytest.approx(cached / prompt)
    assert m["k3serve:time_to_first_token_seconds_count"] == sum(g["n"] for g in got)
    # each request's cached tokens are the fake prefill workers' real reuse
    assert sum(p["_cached"] for st in four.prefill for p in st.prefills) == cached


def test_killing_one_replica_fails_only_its_streams(four):
    four.decode.step_s = 0.08  # streams last ~5 s: the kill lands mid-stream
    prompt = "replicas share nothing but the workers"
    ids = TOKENIZER.encode(prompt, add_bos=True)
    _, want, _ = toy_generate(ids, SamplingParams(
        max_tokens=64, temperature=0, stop_token_ids=TOKENIZER.stop_token_ids))
    m0 = four.metrics()
    n = 12
    replica: list[str | None] = [None] * n
    raws = [b""] * n
    done = [False] * n
    t_hdr = [0.0] * n  # when each stream's headers came (its first token: ≥ 5 s to go)
    started = asyncio.Event()

    async def stream(i: int, c: httpx.AsyncClient):
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 64, "temperature": 0,
                "stream": True}
        try:
            async with c.stream("POST", four.url + "/v1/completions", json=body) as r:
                replica[i] = r.headers[REPLICA_HEADER]
                t_hdr[i] = time.monotonic()
                if all(x is not None for x in replica):
                    started.set()
                async for chunk in r.aiter_raw():
                    raws[i] += chunk
        except httpx.HTTPError as e:
            return e
        finally:
            done[i] = True
        return None

    async def run():
        async with httpx.AsyncClient(timeout=30, limits=_fresh()) as c:  # a connection each
            tasks = [asyncio.create_task(stream(i, c)) for i in range(n)]
            await asyncio.wait_for(started.wait(), 60)
            alive = [i for i in range(n) if not done[i]]
            # the replica of the newest stream; "running": its streams that started < 2 s ago
            # (63 more steps of 0.08 s to go, so the end cannot be written before the kill —
            # on a loaded box the first streams may be nearly done when the last one starts)
            victim = int(replica[max(alive, key=lambda i: t_hdr[i])])
            now = time.monotonic()
            running = {i for i in alive if int(replica[i]) == victim and now - t_hdr[i] < 2.0}
            os.kill(four.replica_pids()[victim], signal.SIGKILL)
            errs = await asyncio.gather(*tasks)
        return victim, running, errs

    try:
        victim, running, errs = asyncio.run(run())
        assert running  # the victim was streaming when it was killed
        for i, (raw, err) in enumerate(zip(raws, errs, strict=True)):
            text = "".join(json.loads(p)["choices"][0]["text"] for p in SSEReader().feed(raw)
                           if p != b"[DONE]")
            if i in running:  # failed visibly: an error or a body without [DONE]
                assert err is not None or not raw.endswith(b"data: [DONE]\n\n"), raw[-200:]
                assert text != want
            elif int(replica[i]) != victim:  # the other replicas' streams complete
                assert err is None and raw.endswith(b"data: [DONE]\n\n"), (err, raw[-200:])
                assert text == want
        for _ in range(8):  # the others keep serving new requests
            r = four.http.post(four.url + "/v1/completions", json={
                "model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0},
                timeout=30)
            assert r.status_code == 200, r.text
    finally:
        four.decode.step_s = 0.0
    deadline = time.monotonic() + 60
    while len(four.replica_pids()) < 4:  # the supervisor starts it again
        assert time.monotonic() < deadline, "the killed replica was not started again"
        time.sleep(0.2)
    m = four.metrics()
    assert m["k3serve:num_requests_running"] == 0  # the dead replica's share dropped
    assert m["k3serve:request_prompt_tokens_total"] >= m0["k3serve:request_prompt_tokens_total"]


# ----------------------------------------------------------------------------- units
class _Pool:
    def __init__(self) -> None:
        self.calls: list[str] = []
        self.fail: set[str] = set()

    async def register(self, url: str) -> None:
        self.calls.append(url)
        if url in self.fail:
            raise RuntimeError("unreachable")


def test_replicas_with_the_same_view_choose_the_same_worker():
    """Cost ties break by rendezvous hashing of the prompt's content address with the worker
    id (``router.placement.tie_breaks``): the same choice whatever a replica's request count
    (``seq``) or the order it lists the workers in — which is what differed between replicas
    before (a rotation by each one's own ``seq``, over its own registration order)."""
    from router.choose import affinity_key
    from router.placement import PlacementRequest, hrw_weight
    from router.policies import WorkerView
    from router.policies.table import POLICIES, place
    from router.preprocess import prompt_hashes

    urls = [f"http://10.0.0.{i}:8000" for i in range(4)]
    views = [urls, urls[::-1], urls[2:] + urls[:2]]  # three replicas' registration orders
    won = dict.fromkeys(urls, 0)
    for p in range(200):
        ids = [1 + (p * 7 + j) % 250 for j in range(40)]  # 2 full blocks of 16 + 8 tokens
        key = affinity_key(ids, prompt_hashes(ids, 16, "f", None), "f", None)
        for policy in ("prefix_home", "cache_aware", "least_load", "approx_radix"):
            got = {place(PlacementRequest(40, 16, seq=seq, key=key),
                         [WorkerView(u, 0, 0, 0, 10_000.0) for u in order], policy=policy
                         ).prefill
                   for seq, order in zip((0, 12_345, 7), views, strict=True)}
            assert len(got) == 1, (policy, got)  # idle pool: every cost ties
        winner = max(urls, key=lambda u: hrw_weight(key, u))
        assert got == {winner}
        won[winner] += 1
        # the losers' order does not matter, and removing a loser keeps the winner
        rest = [u for u in urls if u != winner]
        assert place(PlacementRequest(40, 16, key=key),
                     [WorkerView(u, 0, 0, 0, 10_000.0) for u in [*rest[1:], winner]]
                     ).prefill == winner
    assert min(won.values()) >= 30, won  # 200 distinct cold prompts spread (50 each expected)
    # without a key ties still rotate by seq (callers that carry no content)
    assert {place(PlacementRequest(40, 16, seq=s), [WorkerView(u, 0, 0, 0, 1e4) for u in urls],
                  policy="prefix_home").prefill for s in range(4)} == set(urls)
    assert set(POLICIES) >= {"round_robin", "random"}  # these stay seq-driven by definition
    # prompts shorter than one block get a content key too (salted like the blocks)
    assert affinity_key([5, 6], [], "f", None) == affinity_key([5, 6], [], "f", None)
    assert affinity_key([5, 6], [], "f", None) not in (affinity_key([5, 7], [], "f", None),
                                                      affinity_key([5, 6], [], "f", "tenant"))


def test_registry_fans_registrations_out(tmp_path):
    a, b = Registry(tmp_path), Registry(tmp_path)
    pool_b = _Pool()
    a.add("http://w1")
    a.add("http://w2")
    pool_b.fail.add("http://w2")
    assert asyncio.run(b.sync(pool_b)) == 1
    pool_b.fail.clear()
    assert asyncio.run(b.sync(pool_b)) == 1  # the failed one is tried again
    assert asyncio.run(b.sync(pool_b)) == 0  # nothing new
    time.sleep(0.01)
    a.add("http://w1")  # registered again (a worker restart): b reads its info again
    assert asyncio.run(b.sync(pool_b)) == 1
    assert sorted(pool_b.calls) == ["http://w1", "http://w1", "http://w2", "http://w2"]
    assert pool_b.calls[-1] == "http://w1"
    assert asyncio.run(a.sync(_Pool())) == 0  # a registered them itself


def test_placement_reads_the_larger_of_own_account_and_reported():
    info = WorkerInfo(role="decode", model=MODEL, fingerprint="f", block_size=16,
                      capacity=Capacity(num_pages=100, num_slots=8))
    w = Worker("http://w", info, queued_tokens=10, running=2, reserved_tokens=320)
    rate = 1000.0
    assert (w.placement_queued(rate), w.placement_running) == (10, 2)
    assert (w.placement_free_tokens(), w.placement_free_slots()) == (1600 - 320, 6)
    w.report(WorkerLoad(queued_prefill_tokens=500, running=5, free_pages=50, free_slots=7))
    t = w.reported_at  # read at the report's arrival: all of it left
    assert (w.placement_queued(rate, t), w.placement_running) == (500, 5)
    assert (w.placement_free_tokens(), w.placement_free_slots()) == (800, 6)
    with w.load(queued_tokens=40):  # sent after the report: counted on top of it
        assert w.placement_queued(rate, t) == 540
    # answered: no longer queued — only what this router still waits for is added (at most
    # its own outstanding 10; counting the answered 40 until the next poll sent repeats
    # away from the worker holding their prefix)
    assert w.placement_queued(rate, t) == 510
    # the report ages: the worker computes at its rate meanwhile (0.2 s: 200 of its 500)
    assert w.placement_queued(rate, t + 0.2) == 300 + 10
    assert w.placement_queued(rate, t + 5.0) == 10  # drained: the own account is left
    w.report(WorkerLoad(queued_prefill_tokens=0))
    assert w.placement_queued(rate) == 10
    # a report that came while this router's prefill ran may count it: once answered, its
    # tokens leave what is left of that report (no waiting for the next poll)
    with w.load(queued_tokens=300):
        w.report(WorkerLoad(queued_prefill_tokens=700))  # 300 of ours + 400 of others
        t = w.reported_at
        assert w.placement_queued(rate, t) == 700
    assert w.placement_queued(rate, t) == 400
    w.report(WorkerLoad(queued_prefill_tokens=400))  # the next report: counted as is
    assert w.placement_queued(rate, w.reported_at) == 400


def _frozen() -> RecentLoad:
    """A :class:`RecentLoad` whose clock stands still: no decay between the reads."""
    return RecentLoad(clock=lambda: 0.0)


def _prefill_worker(url: str) -> Worker:
    """A prefill worker's router-side state with frozen load clocks."""
    info = WorkerInfo(role="prefill", model=MODEL, fingerprint="f", block_size=16,
                      capacity=Capacity(num_pages=100, num_slots=8))
    return Worker(url, info, recent=_frozen(), seen=_frozen())


def test_replicas_read_the_pools_prefill_counters():
    """A prefill worker's counters (``WorkerLoad.prefills`` / ``prefill_tokens``, every
    replica pulls them): ``util`` and ``request_rate`` of placement count the worker's
    prefills from every replica; the first report is the baseline, a counter that went down
    restarted with the worker."""
    w = _prefill_worker("http://w")
    rate, H = 1000.0, w.recent.horizon_s
    w.report(WorkerLoad(prefills=7, prefill_tokens=9000))  # its history: not this window's
    assert w.counts_prefills and w.seen.tokens() == 0
    with w.load(queued_tokens=100):  # this replica's one prefill (of 100 tokens) ...
        pass
    # ... and three more from other replicas, 1,000 tokens in all, by the next report
    w.report(WorkerLoad(prefills=11, prefill_tokens=10_100))
    pl = w.placement_load
    assert pl.util(rate) == pytest.approx(1100 / (rate * H))
    assert pl.request_rate() == pytest.approx(4 / H)  # the pool's 4, not this replica's 1
    with w.load(queued_tokens=50):  # sent after the report: on top of it
        assert w.placement_load.util(rate) == pytest.approx(1150 / (rate * H))
        assert w.placement_load.request_rate() == pytest.approx(5 / H)
    w.report(WorkerLoad(prefills=2, prefill_tokens=300))  # restarted: all of it is new
    assert w.seen.tokens() == pytest.approx(1100 + 300)
    assert w.placement_load.request_rate() == pytest.approx(6 / H)
    # a worker without the counters: requests are the own account's, tokens the events'
    old = _prefill_worker("http://old")
    old.report(WorkerLoad())
    assert not old.counts_prefills
    with old.load(queued_tokens=100):
        pass
    old.report(WorkerLoad())
    assert old.placement_load.request_rate() == pytest.approx(1 / H)


def test_an_older_load_report_landing_late_is_ignored():
    """Polls and prefill answers carry load reports on different connections, so an older
    one can land second: within one event epoch it is ignored (by ``last_seq``, or by its
    counters, which never go down within an epoch) — read as a restart it added the worker's
    whole lifetime counters to its load. In a new epoch, lower counters are a restart."""
    w, H = _prefill_worker("http://w"), RecentLoad().horizon_s
    w.report(WorkerLoad(prefills=10_000, prefill_tokens=5_000_000), "e1", 40)
    w.report(WorkerLoad(prefills=10_002, prefill_tokens=5_000_100), "e1", 42)
    assert w.seen.request_rate() == pytest.approx(2 / H) and w.seen.tokens() == 100
    w.report(WorkerLoad(prefills=10_005, prefill_tokens=5_000_400), "e1", 44)
    w.report(WorkerLoad(prefills=10_004, prefill_tokens=5_000_300), "e1", 44)  # older, same seq
    w.report(WorkerLoad(prefills=10_003, prefill_tokens=5_000_200), "e1", 43)  # older seq
    assert w.seen.request_rate() == pytest.approx(5 / H) and w.seen.tokens() == 400
    assert w.reported.prefills == 10_005
    w.report(WorkerLoad(queued_prefill_tokens=9, prefills=10_005, prefill_tokens=5_000_400),
             "e1", 40)  # an older answer without new prefills: its queue is not taken either
    assert w.reported.queued_prefill_tokens == 0
    w.report(WorkerLoad(prefills=3, prefill_tokens=300), "e2", 3)  # restarted: all of it new
    assert w.seen.request_rate() == pytest.approx(8 / H) and w.seen.tokens() == 700


def test_placement_util_is_the_larger_of_own_account_and_the_pools():
    """``util`` that placement reads (``Worker.placement_load``): a replica that sent a quarter
    of a worker's prefills sees the worker's computed tokens (its cache events, pulled by
    every replica), not its own quarter; one router alone keeps its own."""
    w = _prefill_worker("http://w")
    rate, H = 1000.0, w.recent.horizon_s
    with w.load(queued_tokens=300):  # no load report yet: the own account alone
        w.seen.add(5000, requests=0.0)
        assert w.placement_load.util(rate) == pytest.approx(300 / (rate * H))
    w.recent, w.seen = _frozen(), _frozen()
    w.report(WorkerLoad())
    for _ in range(2):  # this router's two prefills of 200 tokens
        with w.load(queued_tokens=200):
            pass
    assert w.placement_load.util(rate) == pytest.approx(400 / (rate * H))
    w.report(WorkerLoad())  # a pull: nothing pending; the events say the worker computed 1,600
    w.seen.add(1600, requests=0.0)
    assert w.placement_load.util(rate) == pytest.approx(1600 / (rate * H))
    assert w.placement_load.request_rate() == pytest.approx(2 / H)  # its own requests
    with w.load(queued_tokens=100):  # sent after the pull: on top of the events
        assert w.placement_load.util(rate) == pytest.approx(1700 / (rate * H))
    one = _prefill_worker("http://one")
    with one.load(queued_tokens=500):
        pass
    one.report(WorkerLoad())
    one.seen.add(480, requests=0.0)  # its own prefill, a poll later, without the partial block
    assert one.placement_load.util(rate) == pytest.approx(500 / (rate * H))
    assert one.placement_load.request_rate() == pytest.approx(1 / H)


def test_launcher_and_ray_config_take_the_router_count():
    from deploy.config import load_deploy_config
    from deploy.launcher import StartupError, start_stack
    from deploy.serve import build_parser

    assert build_parser().parse_args(["--routers", "4"]).routers == 4
    assert load_deploy_config(ROOT / "deploy/configs/supernode-64.yaml").router.replicas == 4
    assert load_deploy_config(ROOT / "deploy/configs/local-cpu.yaml").router.replicas == 1

    class Dead:
        def poll(self):
            return 1

        def terminate(self): ...
        def kill(self): ...
        def wait(self, timeout=None):
            return 1

    class Backend:
        name, internal_host, spawned = "fake", "127.0.0.1", []

        def free_port(self, host):
            return free_port()

        def spawn(self, name, module, args, env):
            self.spawned.append((module, args))
            return Dead()

    be = Backend()
    with pytest.raises(StartupError):
        start_stack(launch=be, routers=3, ready_timeout=1)
    module, args = be.spawned[0]
    assert module == "router" and args[args.index("--replicas") + 1] == "3"
    with pytest.raises(ValueError, match="routers"):
        start_stack(launch=be, routers=0)
