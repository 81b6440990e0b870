"""worker/ without an engine: the typed internal API of both roles (OpenAPI), the error answers,
the frozen WorkerConfig and its environment, the request lifecycles' transition tables.

The apps are built around a worker object that has a config but no engine (``__new__``):
building the app and its schema, validating bodies and checking the token need nothing more;
the engine-backed behaviour is tests/worker/test_disagg.py's.
"""

from __future__ import annotations

import dataclasses

import pytest
from fastapi.testclient import TestClient

from decode.state import TRANSITIONS as DECODE_TRANSITIONS
from decode.state import DecodePhase, DecodeState
from decode.worker import DecodeWorker
from k3serve import messages
from k3serve.sampling import SamplingParams
from prefill.state import TRANSITIONS as PREFILL_TRANSITIONS
from prefill.state import PrefillPhase, PrefillState
from prefill.worker import PrefillWorker
from worker.config import WorkerConfig, WorkerEnv, parse_config
from worker.http import create_app

TOKEN = "plumbing-token"
ROUTES = {
    "prefill": {("get", "/internal/info"), ("get", "/internal/cache_events"),
                ("get", "/internal/cache_state"), ("get", "/internal/requests"),
                ("post", "/internal/abort"), ("post", "/internal/prefill")},
    "decode": {("get", "/internal/info"), ("get", "/internal/cache_events"),
               ("get", "/internal/cache_state"), ("get", "/internal/requests"),
               ("post", "/internal/abort"), ("post", "/internal/reserve"),
               ("post", "/internal/generate"), ("post", "/internal/stream"),
               ("post", "/internal/resume"), ("post", "/internal/channel"),
               ("post", "/internal/attach")},
}
ROLES = {"prefill": PrefillWorker, "decode": DecodeWorker}


def _app(role: str):
    w = ROLES[role].__new__(ROLES[role])  # no engine: see the module docstring
    w.config = WorkerConfig(role=role, cluster_token=TOKEN)
    return create_app(w)


def _model_of(schema: dict) -> str:
    """The k3serve.messages model a body schema names (fails for anything else)."""
    ref = schema.get("$ref", "")
    assert ref.startswith("#/components/schemas/"), schema
    name = ref.rsplit("/", 1)[1]
    cls = getattr(messages, name, None)
    assert isinstance(cls, type) and issubclass(cls, messages.Message), name
    return name


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_every_internal_body_is_a_named_message(role):
    spec = _app(role).openapi()
    ops = {(m, p): op for p, item in spec["paths"].items() for m, op in item.items()}
    assert {k for k in ops if k[1].startswith("/internal")} == ROUTES[role]
    assert ("get", "/health") in ops and ("get", "/metrics") in ops
    seen: dict[tuple[str, str], list[str]] = {}
    for (method, path), op in ops.items():
        if not path.startswith("/internal") and path != "/health":
            continue
        names = []
        if method == "post":
            content = op["requestBody"]["content"]
            assert list(content) == ["application/json"], (path, content)
            names.append(_model_of(content["application/json"]["schema"]))
        for status, resp in op["responses"].items():
            content = resp.get("content")
            assert content, (path, status)  # no body without a schema
            for media, c in content.items():
                names.append(_model_of(c["schema"]))
                if status.startswith(("4", "5")) or status == "default":
                    assert media == "application/json" and names[-1] in (
                        "ErrorBody", "WorkerHealth"), (path, status, names[-1])
        seen[(method, path)] = names
    assert seen[("get", "/health")] == ["WorkerHealth", "WorkerHealth"]
    assert seen[("post", "/internal/abort")][:2] == ["AbortRequest", "AbortResponse"]
    assert seen[("get", "/internal/info")][0] == "WorkerInfo"
    if role == "prefill":
        assert seen[("post", "/internal/prefill")][:2] == ["PrefillRequest", "PrefillResponse"]
    else:
        assert seen[("post", "/internal/reserve")][:2] == ["ReserveRequest", "ReserveResponse"]
        for path in ("/internal/stream", "/internal/channel"):
            stream = ops[("post", path)]["responses"]["200"]["content"]
            assert list(stream) == ["text/event-stream"]
            assert _model_of(stream["text/event-stream"]["schema"]) == "StreamEvent"
        assert seen[("post", "/internal/channel")][0] == "ChannelRequest"
        assert seen[("post", "/internal/attach")][:2] == ["AttachRequest", "AttachResponse"]


@pytest.mark.parametrize("role,path,body,field", [
    ("prefill", "/internal/prefill", {"request_id": "x", "prompt_token_ids": "abc"},
     "prompt_token_ids"),
    ("prefill", "/internal/prefill", {"request_id": "x", "prompt_token_ids": [1],
                                      "ticket": "t", "bootstrap_addr": "h:1",
                                      "sampling": {"temperature": "hot"}},
     "sampling.temperature"),
    ("decode", "/internal/reserve", {"request_id": "x", "prompt_token_ids": [1], "n": 2}, "n"),
    ("decode", "/internal/stream", {"request_id": "x", "token_id": -1}, "token_id"),
    ("decode", "/internal/attach", {"request_id": "x\ny", "token_id": 1, "channel": "c"},
     "request_id"),
    ("decode", "/internal/channel", {"channel": ""}, "channel"),
    ("decode", "/internal/abort", {}, "request_id"),
])
def test_a_bad_internal_body_is_a_400_naming_the_field(role, path, body, field):
    client = TestClient(_app(role))  # no `with`: the engine thread is not started
    r = client.post(path, json=body, headers={"X-K3serve-Cluster-Token": TOKEN})
    assert r.status_code == 400, r.text
    err = messages.ErrorBody.model_validate(r.json())
    assert err.error == "invalid_request" and err.message.startswith(field + ":"), err


@pytest.mark.parametrize("headers", [{}, {"X-K3serve-Cluster-Token": "wrong"},
                                     {"X-K3serve-Cluster-Token": "\xe9".encode("latin-1")}])
def test_internal_routes_need_the_cluster_token(headers):
    r = TestClient(_app("decode")).post("/internal/abort", json={"request_id": "x"},
                                        headers=headers)
    assert r.status_code == 403
    assert messages.ErrorBody.model_validate(r.json()).error == "forbidden"


# ============================================================================ config
def test_worker_config_is_frozen_and_read_once(monkeypatch):
    monkeypatch.setenv("K3SERVE_CLUSTER_TOKEN", "tok")
    monkeypatch.setenv("K3SERVE_WORKER_THREADS", "3")
    monkeypatch.setenv("K3SERVE_TEST_HOOKS", "true")
    monkeypatch.setenv("K3SERVE_KV_RECEIVER_TIMEOUT_S", "7.5")
    c = parse_config("decode", ["--port", "0", "--no-prefix-caching", "--router-url",
                                "http://r:1/", "--host", "0.0.0.0"])
    assert (c.cluster_token, c.threads, c.test_hooks) == ("tok", 3, True)
    assert c.kv.receiver_timeout_s == 7.5 and not c.enable_prefix_caching
    assert c.router_url == "http://r:1"
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.port = 5  # type: ignore[misc]
    b = c.bound_to(4321)
    assert (b.port, c.port) == (4321, 0)
    assert b.url == "http://127.0.0.1:4321" and b.name == "decode@0.0.0.0:4321"
    monkeypatch.setenv("K3SERVE_KV_RECEIVER_TIMEOUT_S", "1")
    assert c.kv.receiver_timeout_s == 7.5  # read at startup, not later


@pytest.mark.parametrize("raw,want", [("1", True), ("true", True), ("0", False),
                                      ("false", False), ("no", False)])
def test_boolean_environment_parses_as_a_boolean(monkeypatch, raw, want):
    monkeypatch.setenv("K3SERVE_TEST_HOOKS", raw)
    assert WorkerEnv().test_hooks is want


def test_empty_cluster_token_means_none_and_bad_numbers_are_refused(monkeypatch):
    monkeypatch.setenv("K3SERVE_CLUSTER_TOKEN", "")
    assert WorkerEnv().cluster_token is None
    monkeypatch.setenv("K3SERVE_WORKER_THREADS", "many")
    with pytest.raises(ValueError, match="K3SERVE_WORKER_THREADS"):
        WorkerEnv()


# ============================================================================ lifecycles
@pytest.mark.parametrize("table,start,end", [
    (PREFILL_TRANSITIONS, PrefillPhase.WAITING, PrefillPhase.ENDED),
    (DECODE_TRANSITIONS, DecodePhase.TRANSFER, DecodePhase.DONE),
])
def test_every_phase_is_reachable_and_ends(table, start, end):
    assert set(table) == set(type(start))
    seen, todo = {start}, [start]
    while todo:
        for nxt in table[todo.pop()]:
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    assert seen == set(type(start))
    assert table[end] == frozenset()
    for phase in type(start):  # every phase can still end
        reach, todo = {phase}, [phase]
        while todo:
            for nxt in table[todo.pop()]:
                if nxt not in reach:
                    reach.add(nxt)
                    todo.append(nxt)
        assert end in reach, phase


def test_a_transition_outside_the_table_is_refused():
    r = PrefillState("r", [1], None, "t", "h:1", None)  # type: ignore[arg-type]
    r.to(PrefillPhase.COMPUTING)
    assert not r.answered
    with pytest.raises(RuntimeError, match="COMPUTING → ANSWERED"):
        r.to(PrefillPhase.ANSWERED)
    assert r.phase is PrefillPhase.COMPUTING
    q = DecodeState("q", [1], None, None, None)  # type: ignore[arg-type]
    q.to(DecodePhase.AWAIT_FIRST)
    assert q.fallback and q.failed_at > 0
    q.to(DecodePhase.DONE)
    assert q.finished_at is not None
    with pytest.raises(RuntimeError, match="DONE → RUNNING"):
        q.to(DecodePhase.RUNNING)


def test_transfer_metadata_is_typed_on_the_decode_side():
    meta = messages.TransferMetadata(
        request_id="r", prompt_token_ids=[1, 2], token_id=3, logprob=None,
        top_logprobs=[(3, -0.1), (4, None)], sampling=SamplingParams(seed=5), position=2)
    done = messages.StatusMessage(ticket="t", sender="s", kind="done", metadata=meta)
    wire = done.model_dump_json()  # what kvstore carries (TE notification or HTTP body)
    assert messages.StatusMessage.model_validate_json(wire).metadata == meta
    bad = done.model_dump(mode="json")
    bad["metadata"]["token_id"] = "three"
    with pytest.raises(ValueError, match="token_id"):
        messages.StatusMessage.model_validate(bad)


# ============================================================================ engine thread
class _FakeEngine:
    """What EngineLoop uses of an engine: ``has_unfinished_requests`` and ``step``."""

    def __init__(self) -> None:
        self.pending, self.steps, self.fail = 0, 0, False

    def has_unfinished_requests(self) -> bool:
        return self.pending > 0

    def step(self) -> list[int]:
        if self.fail:
            self.fail = False
            raise RuntimeError("boom")
        self.pending -= 1
        self.steps += 1
        return [self.steps]


def test_engine_loop_runs_calls_steps_and_errors_on_its_thread():
    import asyncio
    import threading
    import time

    from worker.loop import EngineLoop

    eng, outs, errs = _FakeEngine(), [], []
    loop = EngineLoop(eng, tick=lambda: False, on_outputs=outs.extend, on_error=errs.append,
                      idle_s=0.01).start()
    try:
        async def calls():
            name = await loop.call(lambda: threading.current_thread().name)
            with pytest.raises(KeyError):
                await loop.call(lambda: {}["missing"])
            await loop.call(setattr, eng, "pending", 3)
            return name

        assert asyncio.run(calls()) == "engine"
        t_end = time.monotonic() + 10
        while outs != [1, 2, 3]:
            assert time.monotonic() < t_end, outs
            time.sleep(0.01)
        eng.fail = True
        loop.submit(setattr, eng, "pending", 1).result(10)
        while not errs:
            assert time.monotonic() < t_end, errs
            time.sleep(0.01)
        assert [str(e) for e in errs] == ["boom"] and loop.num_step_errors == 1 and loop.alive
    finally:
        loop.stop()
    assert not loop.alive
    with pytest.raises(RuntimeError, match="stopping"):
        loop.submit(lambda: None).result(1)
