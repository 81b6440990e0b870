"""Regressions found by reviewing the router's relay / tie-break / kick changes.

* ``IndexSync.kick`` while a pull is already running: the running pull may have asked for the
  worker's events before the newer prefill stored its blocks, so the newer kick must cause one
  more pull (it used to be dropped: "a pull already pending covers this one" is false once
  that pull's request is on the wire).
* Every pull of a worker's events holds ``Worker.sync_lock`` (the n > 1 path's pull in
  ``Router.run_prompt`` did not, and overlapped the kick's pull of the same worker: the
  "computed" tokens of the overlapping answer were counted twice in the load account).
* Tie-breaks and affinity keys: the same across processes (hash randomisation), different
  for different ``cache_salt`` values.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import pytest

from k3serve.messages import Capacity, WorkerInfo
from router.index_sync import IndexSync
from router.placement import PlacementRequest
from router.pool import WorkerPool
from router.workers import Worker

MODEL = "k3-tiny"


def _pool_and_worker() -> tuple[WorkerPool, Worker]:
    info = WorkerInfo(role="prefill", model=MODEL, fingerprint="f", block_size=4,
                      capacity=Capacity(num_pages=8, num_slots=8, num_snapshots=0),
                      max_model_len=256)
    return WorkerPool(MODEL, None), Worker("http://127.0.0.1:9", info)


# ----------------------------------------------------------------------------- kick
def test_kick_during_a_running_pull_pulls_again_after_it():
    """Kick #2 arrives while kick #1's pull is in flight: a second pull follows (its blocks
    may postdate the first pull's answer); kicks arriving meanwhile share that one pull."""
    async def run() -> tuple[int, int]:
        pool, w = _pool_and_worker()
        started = asyncio.Event()
        release = asyncio.Event()
        calls = 0

        async def sync(worker: Worker) -> None:
            nonlocal calls
            calls += 1
            if calls == 1:
                started.set()
                await release.wait()  # the first pull's GET is on the wire

        pool.index_sync.sync = sync  # type: ignore[method-assign]
        try:
            pool.index_sync.kick(w)
            await started.wait()
            pool.index_sync.kick(w)  # a newer prefill answered during the pull
            pool.index_sync.kick(w)  # and another: the same follow-up pull covers both
            release.set()
            assert w.kick_task is not None
            await w.kick_task
            tasks_alive = sum(1 for t in asyncio.all_tasks()
                              if t.get_name().startswith("kick "))
            return calls, tasks_alive
        finally:
            await pool.close()

    calls, alive = asyncio.run(run())
    assert calls == 2
    assert alive == 0


def test_kick_waiting_for_the_lock_covers_later_kicks():
    """While the poll loop holds ``sync_lock``, kicks wait; they then pull once, not once
    each (no pile-up of tasks or pulls)."""
    async def run() -> int:
        pool, w = _pool_and_worker()
        calls = 0

        async def sync(worker: Worker) -> None:
            nonlocal calls
            calls += 1

        pool.index_sync.sync = sync  # type: ignore[method-assign]
        try:
            async with w.sync_lock:  # the poll loop's pull
                for _ in range(5):
                    pool.index_sync.kick(w)
                    await asyncio.sleep(0)
            assert w.kick_task is not None
            await w.kick_task
            return calls
        finally:
            await pool.close()

    assert asyncio.run(run()) == 1


def test_kick_failure_is_observed_and_a_later_kick_still_pulls():
    """A failing pull leaves no unobserved task exception and does not stop later kicks."""
    async def run() -> tuple[int, list]:
        pool, w = _pool_and_worker()
        calls = 0
        loop_errors: list = []
        asyncio.get_running_loop().set_exception_handler(lambda lp, ctx: loop_errors.append(ctx))

        async def sync(worker: Worker) -> None:
            nonlocal calls
            calls += 1
            raise RuntimeError("worker down")

        pool.index_sync.sync = sync  # type: ignore[method-assign]
        try:
            pool.index_sync.kick(w)
            await w.kick_task
            pool.index_sync.kick(w)
            await w.kick_task
            return calls, loop_errors
        finally:
            await pool.close()

    calls, errors = asyncio.run(run())
    assert calls == 2
    assert errors == []


def test_pull_holds_the_sync_lock():
    """``IndexSync.pull`` (what the pipeline's n > 1 path calls) never overlaps a kick's
    pull of the same worker."""
    async def run() -> int:
        pool, w = _pool_and_worker()
        inside = 0
        most = 0
        release = asyncio.Event()

        async def sync(worker: Worker) -> None:
            nonlocal inside, most
            inside += 1
            most = max(most, inside)
            try:
                await asyncio.wait_for(release.wait(), 0.2)
            except TimeoutError:
                pass
            finally:
                inside -= 1

        pool.index_sync.sync = sync  # type: ignore[method-assign]
        try:
            pool.index_sync.kick(w)
            await asyncio.sleep(0)
            puller = asyncio.create_task(pool.index_sync.pull(w))
            await asyncio.sleep(0.05)
            release.set()
            await puller
            await w.kick_task
            return most
        finally:
            await pool.close()

    assert asyncio.run(run()) == 1


def test_n2_request_pulls_of_one_worker_never_overlap(monkeypatch):
    """End to end: an ``n = 2`` request triggers the kick of its prefill worker and the
    pipeline's own pull before choices 2..n; the two must not run at the same time."""
    from deploy.fake_stack import Stack

    orig = IndexSync.sync
    inside: dict[str, int] = {}
    overlaps: list[str] = []

    async def sync(self: IndexSync, w: Worker) -> None:
        inside[w.url] = inside.get(w.url, 0) + 1
        if inside[w.url] > 1:
            overlaps.append(w.url)
        try:
            await asyncio.sleep(0.1)  # widen the window an overlap would need
            await orig(self, w)
        finally:
            inside[w.url] -= 1

    monkeypatch.setattr(IndexSync, "sync", sync)
    stack = Stack(num_prefill=1, num_decode=1, poll_interval_s=60.0)
    try:
        overlaps.clear()
        r = stack.client.completions.create(model=MODEL, prompt="two choices " * 8,
                                            max_tokens=2, n=2)
        assert len(r.choices) == 2
        assert overlaps == []
    finally:
        stack.close()


# ----------------------------------------------------------------------------- tie-breaks
_PROBE = r"""
import json, sys
from router.choose import affinity_key
from router.placement import PlacementRequest, tie_breaks
from router.preprocess import prompt_hashes
out = {}
for salt in (None, "a", "b"):
    for ids in ([1, 2, 3], list(range(40))):
        hs = prompt_hashes(ids, 16, "fp", salt)
        k = affinity_key(ids, hs, "fp", salt)
        req = PlacementRequest(len(ids), 16, seq=7, key=k)
        out[f"{salt}/{len(ids)}"] = [k, tie_breaks(req, ["http://w1", "http://w2", "http://w3"])]
print(json.dumps(out))
"""


def _probe(seed: str) -> dict:
    env = {**os.environ, "PYTHONHASHSEED": seed}
    r = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True,
                       text=True, check=True, timeout=120)
    return json.loads(r.stdout)


def test_tie_breaks_are_the_same_across_processes_and_salts_isolate():
    a, b = _probe("1"), _probe("12345")
    assert a == b  # no dependence on hash randomisation
    for n in (3, 40):  # short prompt (no full block) and long prompt
        keys = {a[f"{salt}/{n}"][0] for salt in ("None", "a", "b")}
        assert len(keys) == 3, keys  # cache_salt values never share an affinity key
    for k, ties in a.values():
        assert len(set(ties)) == 3  # distinct: a strict order among the workers


# ----------------------------------------------------------------------------- SSE writer
def _wait(cond, timeout: float = 10.0) -> bool:
    import time

    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.02)
    return cond()


def test_n2_stream_client_disconnect_aborts_every_choice_and_frees_the_admission():
    """A client that leaves an ``n = 2`` stream mid-way: both decode requests are aborted,
    the workers' load accounts and the admitted choices return to zero, no task is left."""
    import httpx

    from deploy.fake_stack import Stack

    s = Stack(num_prefill=1, num_decode=1, api_key=None)
    try:
        dec = s.decode[0][0]
        dec.hang_after = 1  # each stream stalls after one token until the router aborts it
        body = {"model": MODEL, "prompt": "slow pair", "max_tokens": 200, "stream": True,
                "n": 2}
        seen: set[int] = set()
        with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=30) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data:") and '"text"' in line:
                    seen.add(json.loads(line[5:])["choices"][0]["index"])
                    if len(seen) == 2:
                        break
        assert _wait(lambda: len(dec.aborted) >= 2), dec.aborted
        assert _wait(lambda: s.router.admission.admitted == 0)
        assert _wait(lambda: all((w.running, w.reserved_tokens, w.queued_tokens) == (0, 0, 0)
                                 for w in s.router.pool.workers.values()))
    finally:
        s.close()


def test_stream_routes_answer_head_and_options_with_405_not_500():
    import httpx

    from deploy.fake_stack import Stack

    s = Stack(num_prefill=1, num_decode=1, api_key=None)
    try:
        for path in ("/v1/completions", "/v1/chat/completions"):
            for method in ("HEAD", "OPTIONS", "GET"):
                r = httpx.request(method, s.url + path, timeout=10)
                assert r.status_code == 405, (method, path, r.status_code)
        # the stream still works after them (no wedged connection or admission)
        r = httpx.post(s.url + "/v1/completions", timeout=30, json={
            "model": MODEL, "prompt": "after", "max_tokens": 3, "stream": True,
            "stream_options": {"include_usage": True}})
        assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]"), r.text
        assert s.router.admission.admitted == 0
    finally:
        s.close()


def test_n2_stream_interleaves_per_choice_in_order_with_usage_last():
    """``n = 2`` streamed: each choice's text equals the non-streaming answer's, nothing
    after a choice's finish, one finish per choice, the usage chunk right before [DONE]."""
    import httpx

    from deploy.fake_stack import Stack

    s = Stack(num_prefill=1, num_decode=1, api_key=None)
    try:
        body = {"model": MODEL, "prompt": "pairs of streams", "max_tokens": 12, "n": 2,
                "temperature": 0}
        full = httpx.post(s.url + "/v1/completions", json=body, timeout=30).json()
        want = {c["index"]: c["text"] for c in full["choices"]}
        r = httpx.post(s.url + "/v1/completions", timeout=30, json={
            **body, "stream": True, "stream_options": {"include_usage": True}})
        frames = [ln[5:].strip() for ln in r.text.splitlines() if ln.startswith("data:")]
        assert frames[-1] == "[DONE]"
        chunks = [json.loads(f) for f in frames[:-1]]
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == \
            full["usage"]["completion_tokens"]
        got: dict[int, str] = {}
        finishes: dict[int, int] = {}
        for c in chunks[:-1]:
            (ch,) = c["choices"]
            assert finishes.get(ch["index"], 0) == 0  # nothing after a choice's finish
            got[ch["index"]] = got.get(ch["index"], "") + ch["text"]
            if ch.get("finish_reason"):
                finishes[ch["index"]] = finishes.get(ch["index"], 0) + 1
        assert got == want
        assert finishes == {0: 1, 1: 1}
    finally:
        s.close()


def test_stream_client_gone_before_the_first_token_aborts_and_frees_everything():
    """The client leaves while the prefill still runs (before the response starts): the
    reservation is aborted on D, the admission and the load accounts return to zero."""
    import httpx

    from deploy.fake_stack import Stack

    s = Stack(num_prefill=1, num_decode=1, api_key=None)
    try:
        (pre, _), = s.prefill
        dec = s.decode[0][0]
        pre.prefill_s_per_token = 0.05  # ~1 s of prefill for this prompt
        body = {"model": MODEL, "prompt": "gone early " * 6, "max_tokens": 50, "stream": True}
        try:
            httpx.post(s.url + "/v1/completions", json=body, timeout=0.3)
        except httpx.TimeoutException:
            pass
        assert _wait(lambda: len(dec.aborted) >= 1), "the reservation was not aborted on D"
        assert _wait(lambda: s.router.admission.admitted == 0)
        assert _wait(lambda: all((w.running, w.reserved_tokens, w.queued_tokens) == (0, 0, 0)
                                 for w in s.router.pool.workers.values()))
        pre.prefill_s_per_token = 0.0
        r = httpx.post(s.url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
    finally:
        s.close()


def test_kick_after_a_worker_restart_resyncs_and_keeps_predictions_exact():
    """Poll loop slowed to a minute: after a prefill worker restarts (new epoch), the kick of
    the next request's answer resyncs it (no deadlock with ``sync_lock``), and a repeated
    prompt's predicted cached tokens equal the worker's actual reuse."""
    from deploy.fake_stack import Stack

    s = Stack(num_prefill=1, num_decode=1, poll_interval_s=60.0)
    try:
        (pre, _), = s.prefill
        w = s.router.pool.workers[pre.url]
        prompt = "restart and kick " * 10
        s.client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
        pre.restart()  # empty cache, new epoch: the index's view is stale now
        s.client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
        assert _wait(lambda: w.resyncs >= 1 and w.kick_task is not None and w.kick_task.done())
        m0 = s.metrics()
        r = s.client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
        m1 = s.metrics()

        def delta(name: str) -> float:
            return sum(v for k, v in m1.items() if k.startswith(name)) - sum(
                v for k, v in m0.items() if k.startswith(name))

        cached = delta("k3serve:request_cached_tokens_total")
        assert cached > 0 and r.usage.prompt_tokens_details.cached_tokens == cached
        assert delta("k3serve:router_predicted_cached_tokens_total") == cached
    finally:
        s.close()


def test_a_writer_that_raises_mid_stream_closes_the_connection_and_cleans_up(monkeypatch):
    """A bug in rendering a chunk after the headers went out: the connection ends (not hung,
    no 500 after a 200), the decode request is aborted, the admission is given back."""
    import httpx

    from deploy.fake_stack import Stack
    from router.render import Render

    orig = Render.frame
    calls = 0

    def frame(self, d, first):
        nonlocal calls
        calls += 1
        if calls == 2:
            raise RuntimeError("render bug")
        return orig(self, d, first)

    monkeypatch.setattr(Render, "frame", frame)
    s = Stack(num_prefill=1, num_decode=1, api_key=None)
    try:
        dec = s.decode[0][0]
        dec.hang_after = 3
        body = {"model": MODEL, "prompt": "boom", "max_tokens": 100, "stream": True}
        ended = None
        with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=10) as r:
            assert r.status_code == 200
            try:
                for _ in r.iter_lines():
                    pass
                ended = "complete"
            except httpx.RemoteProtocolError:
                ended = "closed"
        assert ended == "closed"  # not a body that looks complete without [DONE]
        assert _wait(lambda: len(dec.aborted) >= 1)
        assert _wait(lambda: s.router.admission.admitted == 0)
    finally:
        s.close()


def test_coalesce_merges_only_a_choice_s_adjacent_deltas():
    """Interleaved choices in the delta queue: ``coalesce`` absorbs the same choice's
    deltas up to the first other item (returned, not lost), never past a finish."""
    from router.sse_response import GONE, coalesce
    from router.stream import Delta

    q: asyncio.Queue = asyncio.Queue()
    for d in (Delta(0, "b", [2]), Delta(1, "x", [9]), Delta(0, "c", [3], finish_reason="stop")):
        q.put_nowait(d)
    head = Delta(0, "a", [1])
    nxt = coalesce(head, q)
    assert (head.text, head.token_ids, head.finish_reason) == ("ab", [1, 2], None)
    assert isinstance(nxt, Delta) and (nxt.index, nxt.text) == (1, "x")
    last = q.get_nowait()
    q.put_nowait(Delta(0, "late", [4]))
    q.put_nowait(GONE)
    assert coalesce(last, q) is None  # a finished delta takes nothing more
    assert q.qsize() == 2
    d = q.get_nowait()
    assert coalesce(d, q) is GONE  # the disconnect marker is handed on, not absorbed


@pytest.mark.parametrize("n", [1, 2])
def test_stream_gives_its_admission_back_before_the_end_of_the_body(monkeypatch, n):
    """The end of a stream's body (the ``more_body: False`` write) goes out after the
    request's admission and load are given back, as before the raw writer (the generator's
    ``finally`` ran before ``StreamingResponse``'s last write): a client that sends its next
    request on seeing ``[DONE]`` must find the capacity free (no spurious 429)."""
    import httpx

    import router.sse_response as app_mod
    from deploy.fake_stack import Stack

    s = Stack(num_prefill=1, num_decode=1, api_key=None)
    seen: list[tuple] = []
    orig = app_mod.SSEResponse.__call__

    async def call(self, scope, receive, send):
        async def spy(message):
            if message.get("type") == "http.response.body" and not message.get("more_body"):
                seen.append((s.router.admission.admitted,
                             [(w.running, w.reserved_tokens, w.queued_tokens)
                              for w in s.router.pool.workers.values()]))
            await send(message)

        await orig(self, scope, receive, spy)

    monkeypatch.setattr(app_mod.SSEResponse, "__call__", call)
    try:
        r = httpx.post(s.url + "/v1/completions", timeout=30, json={
            "model": MODEL, "prompt": "free before done", "max_tokens": 4, "n": n,
            "stream": True})
        assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
        assert seen == [(0, [(0, 0, 0)] * 2)]
    finally:
        s.close()


@pytest.mark.parametrize("policy", ["cache_aware", "least_load", "prefix_home", "approx_radix"])
def test_tie_break_ignores_the_order_a_router_lists_its_workers_in(policy):
    """Replicas list workers in their own registration order: with a key, every cost policy
    and the decode choice pick the same worker id for every order of tied workers."""
    import itertools

    from router.placement import DecodeWorkerState, PrefillWorkerState
    from router.policies.table import place

    ids = [f"http://10.0.0.{i}:8000" for i in range(4)]
    for k in range(12):
        req = PlacementRequest(64, 16, seq=k, key=f"key-{k}")
        picks = set()
        for perm in itertools.permutations(ids):
            pre = [PrefillWorkerState(u) for u in perm]
            dec = [DecodeWorkerState(u.replace("8000", "9000")) for u in perm]
            p = place(req, pre, dec, policy=policy)
            picks.add((p.prefill, p.decode))
        assert len(picks) == 1, (policy, k, picks)


@pytest.mark.parametrize("n", [1, 2])
def test_stream_cut_without_finish_still_gets_finish_reasons_and_usage(n):
    """D ends each stream after 3 tokens with no finish event (only ``[DONE]``): every choice
    still ends with a finish_reason (``abort``) and the usage chunk comes before [DONE]."""
    import httpx

    from deploy.fake_stack import Stack

    s = Stack(num_prefill=1, num_decode=1, api_key=None)
    try:
        s.decode[0][0].cut_stream = (3, None)
        r = httpx.post(s.url + "/v1/completions", timeout=30, json={
            "model": MODEL, "prompt": "cut short", "max_tokens": 50, "n": n, "stream": True,
            "stream_options": {"include_usage": True}})
        frames = [ln[5:].strip() for ln in r.text.splitlines() if ln.startswith("data:")]
        assert frames[-1] == "[DONE]"
        chunks = [json.loads(f) for f in frames[:-1]]
        assert "error" not in chunks[-1] and chunks[-1]["choices"] == []
        assert chunks[-1]["usage"]["completion_tokens"] == 4 * n  # token #1 + 3 from D
        reasons = {c["choices"][0]["index"]: c["choices"][0]["finish_reason"]
                   for c in chunks[:-1] if c["choices"][0].get("finish_reason")}
        assert reasons == {i: "abort" for i in range(n)}
        assert s.router.admission.admitted == 0
    finally:
        s.close()
