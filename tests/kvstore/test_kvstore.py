"""kvstore: descriptors (pure), the engine wrapper, sender/receiver state machines, and
two-process loopback transfers over the real Mooncake Transfer Engine (tcp, 127.0.0.1)."""

from __future__ import annotations

import contextlib
import json
import os
import random
import select
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from k3serve.config import PRESETS
from k3serve.messages import (
    PairRequest,
    StatusAck,
    StatusMessage,
    TransferMetadata,
)
from k3serve.sampling import SamplingParams
from kvstore import (
    BootstrapClient,
    BootstrapError,
    CacheRef,
    EngineConfig,
    FingerprintMismatch,
    KVBootstrapServer,
    KVConfig,
    KVEngine,
    KVPoll,
    KVReceiver,
    KVSender,
    MooncakeUnavailable,
    PoolLayout,
    TransferError,
)
from kvstore.descriptors import (
    expected_layer_bytes,
    fingerprint_diff,
    layer_runs,
    plan_runs,
    region_from_tensor,
    runs_bytes,
    validate_ref,
)
from kvstore.engine import MAX_NOTIFY_BYTES
from kvstore.loopback import fill_pools, make_pools, pool_layout, request_digest
from kvstore.retry import RetryBudget

ROOT = Path(__file__).resolve().parents[2]
TINY = PRESETS["k3-tiny"]
B = 16  # small pages: more page boundaries per prompt


# ============================================================================ pure descriptors
class FakeTensor:
    """Just what region_from_tensor reads; no memory behind it (k3-sized pools are fine)."""

    def __init__(self, shape: tuple[int, ...], es: int, dtype: str, base: int) -> None:
        self.shape, self._es, self.dtype, self._base = shape, es, dtype, base
        st, acc = [], 1
        for s in reversed(shape):
            st.append(acc)
            acc *= s
        self._stride = tuple(reversed(st))
        self.nbytes = acc * es

    def data_ptr(self) -> int:
        return self._base

    def stride(self) -> tuple[int, ...]:
        return self._stride

    def element_size(self) -> int:
        return self._es


def fake_layout(
    cfg, slots: int, pages: int, block: int, base: int = 1 << 40, lat_dtype: str | None = None
) -> PoolLayout:
    es = {"bfloat16": 2, "float32": 4, "float16": 2}
    cd = cfg.dtype
    ld = lat_dtype or cfg.dtype
    h, k = cfg.kda_num_heads, cfg.kda_head_dim
    kda = FakeTensor((cfg.num_kda_layers, slots, h, k, k), 4, "float32", base)
    conv = FakeTensor(
        (cfg.num_kda_layers, slots, cfg.kda_conv_kernel - 1, cfg.kda_conv_dim),
        es[cd],
        cd,
        base + kda.nbytes + 4096,
    )
    lat = FakeTensor(
        (cfg.num_mla_layers, pages, block, cfg.mla_latent_dim),
        es[ld],
        ld,
        base + kda.nbytes + conv.nbytes + 8192,
    )
    return PoolLayout.from_pools(
        kda,
        conv,
        lat,
        kda_layers=cfg.kda_layers,
        mla_layers=cfg.mla_layers,
        model=cfg.name,
        extra=cfg.fingerprint_fields(),
    )


def independent_run_count(cfg, src_pages, dst_pages, n_tokens: int, block: int) -> int:
    """Runs from the page lists alone: each KDA layer 2 (state, conv); each MLA layer one run
    plus one per page boundary where source or destination is not the next page."""
    k = -(-n_tokens // block)
    breaks = sum(
        1
        for i in range(k - 1)
        if src_pages[i + 1] != src_pages[i] + 1 or dst_pages[i + 1] != dst_pages[i] + 1
    )
    return 2 * cfg.num_kda_layers + (cfg.num_mla_layers * (1 + breaks) if n_tokens else 0)


class FreeListAllocator:
    """A page allocator that fragments like a real one: LIFO free list, random churn."""

    def __init__(self, num_pages: int, rng: random.Random) -> None:
        self.free = list(range(num_pages - 1, -1, -1))
        self.rng = rng

    def alloc(self, n: int) -> list[int]:
        return [self.free.pop() for _ in range(n)]

    def churn(self, rounds: int) -> None:
        live: list[list[int]] = []
        for _ in range(rounds):
            if live and self.rng.random() < 0.45:
                self.free.extend(reversed(live.pop(self.rng.randrange(len(live)))))
            elif len(self.free) > 8:
                live.append(self.alloc(self.rng.randint(1, 6)))


@pytest.mark.parametrize("name", ["k3-tiny", "k3-mini", "k3"])
def test_contiguous_pages_give_one_run_per_region_per_layer(name):
    cfg = PRESETS[name]
    block, n = 64, 64 * 7 + 13
    k = -(-n // block)
    src_l, dst_l = fake_layout(cfg, 4, 64, block), fake_layout(cfg, 8, 96, block, base=1 << 44)
    plan = plan_runs(
        src_l,
        CacheRef(1, tuple(range(3, 3 + k)), n),
        dst_l,
        CacheRef(6, tuple(range(50, 50 + k)), n),
    )
    for layer, runs in plan.items():
        regions = [r.region for r in runs]
        assert sorted(regions) == sorted(set(regions)), f"layer {layer}: {regions}"
        want = ["kda_state", "conv_state"] if layer in cfg.kda_layers else ["mla_latent"]
        assert regions == want
    assert sum(map(len, plan.values())) == 2 * cfg.num_kda_layers + cfg.num_mla_layers


@pytest.mark.parametrize("seed", range(20))
def test_fragmented_run_count_matches_independent_count(seed):
    rng = random.Random(seed)
    cfg = TINY
    src_alloc, dst_alloc = FreeListAllocator(256, rng), FreeListAllocator(256, rng)
    src_alloc.churn(120)
    dst_alloc.churn(120)
    n = rng.randint(1, 40 * B)
    k = -(-n // B)
    sp, dp = src_alloc.alloc(k), dst_alloc.alloc(k)
    src_l, dst_l = fake_layout(cfg, 2, 256, B), fake_layout(cfg, 2, 256, B, base=1 << 44)
    plan = plan_runs(src_l, CacheRef(0, tuple(sp), n), dst_l, CacheRef(1, tuple(dp), n))
    got = sum(map(len, plan.values()))
    assert got == independent_run_count(cfg, sp, dp, n, B)
    # the allocator did fragment: some seeds must produce several runs per MLA layer
    if seed == 0:
        assert got > 2 * cfg.num_kda_layers + cfg.num_mla_layers


def test_runs_map_every_token_to_its_destination():
    cfg, rng = TINY, random.Random(5)
    src_l, dst_l = fake_layout(cfg, 3, 40, B), fake_layout(cfg, 3, 40, B, base=1 << 44)
    n = 9 * B + 5
    sp, dp = rng.sample(range(28), 10), list(range(20, 30))
    sp[3:6] = [30, 31, 32]
    src, dst = CacheRef(2, tuple(sp), n), CacheRef(0, tuple(dp), n)
    plan = plan_runs(src_l, src, dst_l, dst)
    sr, dr = src_l.region("mla_latent"), dst_l.region("mla_latent")
    tb = sr.token_bytes
    for m, layer in enumerate(cfg.mla_layers):
        got = {}
        for r in plan[layer]:
            assert r.length % tb == 0
            for t in range(r.length // tb):
                got[r.src + t * tb] = r.dst + t * tb
        want = {
            sr.base + m * sr.layer_stride + sp[t // B] * sr.item_stride + (t % B) * tb: dr.base
            + m * dr.layer_stride
            + dp[t // B] * dr.item_stride
            + (t % B) * tb
            for t in range(n)
        }
        assert got == want
    for j, layer in enumerate(cfg.kda_layers):
        for name in ("kda_state", "conv_state"):
            s_, d_ = src_l.region(name), dst_l.region(name)
            (run,) = [r for r in plan[layer] if r.region == name]
            assert (run.src, run.dst, run.length) == (s_.addr(j, 2), d_.addr(j, 0), s_.item_bytes)


@pytest.mark.parametrize("name", ["k3-tiny", "k3-mini", "k3"])
@pytest.mark.parametrize("n", [1, 63, 64, 4096])
def test_payload_bytes_equal_spec_formula(name, n):
    cfg = PRESETS[name]
    k = -(-n // 64)
    src_l, dst_l = fake_layout(cfg, 2, 80, 64), fake_layout(cfg, 2, 80, 64, base=1 << 44)
    src = CacheRef(0, tuple(range(k)), n)
    dst = CacheRef(1, tuple(range(79, 79 - k, -1)), n)  # reversed: nothing merges
    plan = plan_runs(src_l, src, dst_l, dst)
    formula = cfg.kda_state_bytes_per_seq() + n * cfg.mla_latent_bytes_per_token()
    assert sum(runs_bytes(r) for r in plan.values()) == formula
    assert sum(expected_layer_bytes(dst_l, dst).values()) == formula
    assert {l: runs_bytes(r) for l, r in plan.items()} == expected_layer_bytes(dst_l, dst)
    if name == "k3-mini":  # DESIGN: 18 KDA layers x 16 heads x 128^2 fp32 ≈ 19.5 MB (+ conv)
        assert 18 * 16 * 128 * 128 * 4 == 18_874_368 and cfg.mla_latent_bytes_per_token() == 6912


def test_token_chunks_cover_the_prompt_once():
    cfg = TINY
    src_l, dst_l = fake_layout(cfg, 2, 64, B), fake_layout(cfg, 2, 64, B, base=1 << 44)
    n = 7 * B + 3
    src, dst = CacheRef(0, tuple(range(10, 18)), n), CacheRef(1, (40, 41, 5, 6, 7, 60, 2, 3), n)
    layer = cfg.mla_layers[0]
    full = layer_runs(src_l, src, dst_l, dst, layer)
    pieces = []
    for a, b in [(0, 5), (5, 37), (37, 37), (37, n)]:
        pieces += layer_runs(src_l, src, dst_l, dst, layer, a, b)
    expand = lambda runs: sorted(
        (r.src + i, r.dst + i) for r in runs for i in range(0, r.length, 2)
    )
    assert expand(pieces) == expand(full)
    with pytest.raises(ValueError):
        layer_runs(src_l, src, dst_l, dst, layer, 0, n + 1)


def test_validate_ref_rejects_bad_reservations():
    lay = fake_layout(TINY, 4, 32, B)
    validate_ref(lay, CacheRef(3, (0, 1), 2 * B))
    with pytest.raises(ValueError, match="slot 4"):
        validate_ref(lay, CacheRef(4, (0, 1), 2 * B))
    with pytest.raises(ValueError, match="need 3"):
        validate_ref(lay, CacheRef(0, (0, 1), 2 * B + 1))
    with pytest.raises(ValueError, match="outside"):
        validate_ref(lay, CacheRef(0, (0, 32), 2 * B))
    with pytest.raises(ValueError, match="twice"):
        validate_ref(lay, CacheRef(0, (5, 5), 2 * B))


def test_fingerprint_diff_names_what_differs():
    a = fake_layout(TINY, 4, 32, B)
    assert (
        fingerprint_diff(a.fingerprint(), fake_layout(TINY, 9, 99, B, base=1 << 44).fingerprint())
        == []
    )
    b = fake_layout(TINY, 4, 32, B, lat_dtype="float32")
    diffs = fingerprint_diff(a.fingerprint(), b.fingerprint())
    assert "regions.mla_latent.dtype: local='bfloat16' remote='float32'" in diffs
    assert any(d.startswith("regions.mla_latent.item_bytes") for d in diffs)
    c = fake_layout(TINY, 4, 32, 2 * B)
    assert any(
        d.startswith("block_size: local=16 remote=32")
        for d in fingerprint_diff(a.fingerprint(), c.fingerprint())
    )
    d = fake_layout(PRESETS["k3-mini"], 4, 32, B)
    assert any(
        x.startswith("model: local='k3-tiny' remote='k3-mini'")
        for x in fingerprint_diff(a.fingerprint(), d.fingerprint())
    )
    assert a.fingerprint_hash() != b.fingerprint_hash()


def test_region_from_real_tensors_and_strided_views():
    pools = make_pools(TINY, 3, 8, B)
    lay = pool_layout(TINY, pools)
    kda = lay.region("kda_state")
    t = pools["kda_state"]
    assert kda.addr(2, 1) == t[2, 1].data_ptr() and kda.item_bytes == t[0, 0].numel() * 4
    lat = lay.region("mla_latent")
    assert lat.addr(1, 5, 3) == pools["mla_latent"][1, 5, 3].data_ptr()
    assert lat.extent == (pools["mla_latent"].data_ptr(), pools["mla_latent"].numel() * 2)
    big = torch.zeros(TINY.num_kda_layers, 6, 4, 64, 64)
    view = big[:, ::2]  # slots 0, 2, 4 of a bigger buffer
    r = region_from_tensor("kda_state", "slot", view, TINY.kda_layers)
    assert r.addr(1, 2) == view[1, 2].data_ptr() and r.item_stride == 2 * r.item_bytes
    with pytest.raises(ValueError, match="contiguous"):
        region_from_tensor("x", "slot", big.transpose(3, 4), TINY.kda_layers)


def test_kvconfig_from_env():
    cfg = KVConfig.from_env(
        {
            "K3SERVE_KV_PROTOCOL": "rdma",
            "K3SERVE_KV_FAIL_FIRST_N": "2",
            "K3SERVE_KV_SENDER_TIMEOUT_S": "1.5",
            "k3serve_kv_notify": "http",  # names are case-insensitive
            "K3SERVE_KV_PROGRESS": "false",  # a boolean: "false" is False (bool("false") is not)
            "K3SERVE_OTHER": "ignored",
        }
    )
    assert (cfg.protocol, cfg.fail_first_n, cfg.sender_timeout_s) == ("rdma", 2, 1.5)
    assert cfg.notify == "http" and cfg.progress is False
    assert KVConfig.from_env({"K3SERVE_KV_PROGRESS": "1"}).progress is True
    assert cfg.engine_config().protocol == "rdma"
    assert KVConfig.from_env({}, max_retries=0).max_retries == 0  # overrides win
    assert KVConfig.from_env({}) == KVConfig()  # defaults; the constructor reads no env
    for var, raw in [
        ("K3SERVE_KV_MAX_RETRIES", "x"),  # int
        ("K3SERVE_KV_MAX_RETRIES", "-1"),  # int out of range
        ("K3SERVE_KV_RECEIVER_TIMEOUT_S", "soon"),  # float
        ("K3SERVE_KV_PROGRESS", "maybe"),  # bool
        ("K3SERVE_KV_PROTOCOL", "nvlink"),  # one of tcp / rdma
    ]:
        with pytest.raises(ValueError, match=f"{var}='{raw}'"):
            KVConfig.from_env({var: raw})
    with pytest.raises(ValueError, match="KVConfig.notify"):
        KVConfig.from_env({}, notify="pigeon")
    with pytest.raises(ValueError):
        EngineConfig(protocol="nvlink")


def test_retry_budget_is_shared_and_backs_off_exponentially():
    b = RetryBudget(3, 0.1, max_backoff_s=0.25)
    assert b.backoff() == 0.0
    waits = []
    while b.take():
        waits.append(b.backoff())
    assert b.used == 3 and waits == [0.1, 0.2, 0.25] and not b.take()
    with pytest.raises(ValueError, match="max_retries"):
        RetryBudget(-1, 0.1)

    calls, slept = [], []

    def flaky(fail_times: int, exc: Exception):
        def f():
            calls.append(1)
            if len(calls) <= fail_times:
                raise exc
            return "ok"

        return f

    def retryable(e: BaseException) -> bool:
        return isinstance(e, OSError)

    b = RetryBudget(2, 0.01)
    assert b.retrying(retryable, lambda: False, slept.append)(flaky(2, OSError("x"))) == "ok"
    assert b.used == 2 and slept == [0.01, 0.02] and len(calls) == 3
    calls.clear()
    with pytest.raises(OSError):  # the budget is spent: the last error comes out
        b.retrying(retryable, lambda: False, slept.append)(flaky(1, OSError("y")))
    assert len(calls) == 1
    calls.clear()
    b = RetryBudget(5, 0.01)
    with pytest.raises(KeyError):  # not retryable: no retry taken
        b.retrying(retryable, lambda: False, slept.append)(flaky(1, KeyError("z")))
    calls.clear()
    with pytest.raises(OSError):  # stopped early (an abort): no retry taken
        b.retrying(retryable, lambda: True, slept.append)(flaky(1, OSError("w")))
    assert b.used == 0


def test_no_kvstore_module_imports_workers_or_router():
    """Import direction: kvstore may import k3serve, never prefill/, decode/, router/ or the
    worker package (lazy imports inside functions count too)."""
    import ast

    bad = []
    for path in sorted((ROOT / "kvstore").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            for name in names:
                if name.split(".")[0] in ("prefill", "decode", "router", "worker"):
                    bad.append(f"{path.name}:{node.lineno} imports {name}")
    assert not bad, bad


def test_bootstrap_openapi_names_every_body():
    """Every request and response body of the bootstrap HTTP API is a named model."""
    srv = KVBootstrapServer(_FakeEngine(), fake_layout(TINY, 2, 8, B))
    spec = srv.app().openapi()
    schemas = spec["components"]["schemas"]
    seen = set()
    for path, ops in spec["paths"].items():
        for method, op in ops.items():
            bodies = [("request", op["requestBody"])] if "requestBody" in op else []
            bodies += [(code, r) for code, r in op["responses"].items()]
            for what, b in bodies:
                schema = b["content"]["application/json"]["schema"]
                ref = schema.get("$ref", "")
                assert ref.startswith("#/components/schemas/"), (path, method, what, schema)
                name = ref.rsplit("/", 1)[1]
                assert schemas[name].get("type") == "object" and schemas[name]["properties"]
                seen.add((path, method, what, name))
    assert {(p, n) for p, _, w, n in seen if w == "request"} == {
        ("/kv/pair", "PairRequest"),
        ("/kv/status", "StatusMessage"),
    }
    assert ("/kv/pair", "post", "200", "PairResponse") in seen
    assert ("/kv/pair", "post", "4XX", "PairError") in seen
    assert ("/kv/status", "post", "200", "StatusAck") in seen
    assert ("/kv/health", "get", "200", "KVHealth") in seen
    assert "TransferMetadata" in schemas  # inside StatusMessage(kind="done")


class _FakeEngine:
    """What the bootstrap server reads of a KVEngine (no Transfer Engine needed)."""

    session_id = "127.0.0.1:1"
    scratch_addr = 4096

    def __init__(self) -> None:
        self.inbox: list[tuple[str, str]] = []

    def notifications(self) -> list[tuple[str, str]]:
        out, self.inbox = self.inbox, []
        return out


def test_bootstrap_http_bodies_are_validated_and_replies_parsed():
    """A bad body gets a 400 naming the field; the client parses every reply into its model;
    a TE notification that is no StatusMessage is dropped, a valid one applies."""
    import httpx

    from kvstore.errors import BootstrapError

    eng = _FakeEngine()
    lay = fake_layout(TINY, 2, 8, B)
    with KVBootstrapServer(eng, lay) as srv:
        url = f"http://{srv.address}"
        rx = KVReceiver(srv, CacheRef(0, (1, 2), 2 * B), timeout_s=10)
        with httpx.Client(trust_env=False) as h:
            r = h.post(url + "/kv/pair", json={"sender": "s"})
            assert r.status_code == 400 and r.json()["error"] == "invalid_request"
            assert "ticket: Field required" in r.json()["detail"]
            r = h.post(
                url + "/kv/pair", json={"ticket": rx.ticket, "sender": "s", "quiesce_by_s": 0}
            )
            assert r.status_code == 400 and "quiesce_by_s" in r.json()["detail"]
            r = h.post(url + "/kv/status", json={"ticket": "t", "sender": "s", "kind": "bogus"})
            ack = StatusAck.model_validate(r.json())
            assert r.status_code == 400 and not ack.accepted and "kind" in ack.error
            r = h.post(url + "/kv/status", content=b"not json")
            assert r.status_code == 400 and not StatusAck.model_validate(r.json()).accepted
            health = h.get(url + "/kv/health").json()
            assert health == srv.health().model_dump() and health["open_tickets"] == 1
        client = BootstrapClient()
        try:
            fp = lay.fingerprint()
            with pytest.raises(BootstrapError, match="unknown_ticket") as ei:
                client.pair(srv.address, PairRequest(ticket="nope", sender="s"), fp)
            assert ei.value.status == 404 and not ei.value.retryable
            other = fake_layout(TINY, 2, 8, 2 * B).fingerprint()
            rx2 = KVReceiver(srv, CacheRef(1, (3,), B), timeout_s=10)
            with pytest.raises(FingerprintMismatch, match="block_size: local=32 remote=16"):
                client.pair(
                    srv.address,
                    PairRequest(ticket=rx2.ticket, sender="s", fingerprint=other),
                    other,
                )
            resp = client.pair(
                srv.address, PairRequest(ticket=rx.ticket, sender="s", fingerprint=fp), fp
            )
            assert CacheRef.from_msg(resp.dst) == rx.ref and int(resp.notify_addr) == 4096
            assert PoolLayout.from_msg(resp.layout) == lay and resp.session_id == eng.session_id
            layer = TINY.mla_layers[0]
            ok = client.post_status(
                srv.address,
                StatusMessage(ticket=rx.ticket, sender="s", kind="layer", layers={layer: 5}),
            )
            assert ok.accepted and ok.state == "TRANSFERRING"
            with pytest.raises(BootstrapError, match="not the paired sender") as ei:
                client.post_status(
                    srv.address, StatusMessage(ticket=rx.ticket, sender="x", kind="layer")
                )
            assert ei.value.status == 409 and not ei.value.retryable
            # TE notifications: garbage is dropped, a "done" with a short manifest fails the ticket
            done = StatusMessage(
                ticket=rx.ticket, sender="s", kind="done", metadata=meta_for(2 * B)
            )
            eng.inbox = [
                ("k3kv", "{garbage"),
                ("k3kv", '{"ticket": 1}'),
                ("k3kv", done.model_dump_json()),
            ]
            assert rx.poll() == KVPoll.FAILED and "incomplete transfer" in rx.error
            assert rx.layers_received == {layer: 5}
        finally:
            client.close()


def test_done_without_metadata_fails_the_ticket():
    srv = KVBootstrapServer(_FakeEngine(), fake_layout(TINY, 2, 8, B))
    rx = KVReceiver(srv, CacheRef(0, (1,), B), timeout_s=10)
    assert (
        srv.pair(PairRequest(ticket=rx.ticket, sender="s", fingerprint=srv.layout.fingerprint()))[0]
        == 200
    )
    full = dict(rx._rec.expected)
    ok, _ = srv.on_status(StatusMessage(ticket=rx.ticket, sender="s", kind="done", layers=full))
    assert not ok and rx.poll() == KVPoll.FAILED and rx.error == "done without metadata"
    assert rx.released  # 'done' means the sender stopped writing


# ============================================================================ engine, in-process
@pytest.fixture(scope="module")
def engines():
    a, b = KVEngine(), KVEngine()
    yield a, b
    a.close()
    b.close()


def test_engine_write_submit_notify_and_errors(engines):
    dst_e, src_e = engines
    dst, src = (
        torch.zeros(1 << 20, dtype=torch.uint8),
        torch.randint(0, 255, (1 << 20,), dtype=torch.uint8),
    )
    dst_e.register(dst.data_ptr(), dst.numel())
    src_e.register(src.data_ptr(), src.numel())
    try:
        peer = dst_e.session_id
        assert src_e.write(peer, [(src.data_ptr(), dst.data_ptr(), 1000)]) == 1000
        assert torch.equal(dst[:1000], src[:1000]) and not dst[1000:].any()
        h = src_e.submit(peer, [(src.data_ptr() + 4096, dst.data_ptr() + 4096, 600_000)])
        h.wait(timeout_s=10)
        assert (
            h.done and h.done_bytes == 600_000 and torch.equal(dst[4096:604096], src[4096:604096])
        )
        # destination outside the peer's registered memory: Mooncake refuses, we raise with context
        bad = src_e.submit(peer, [(src.data_ptr(), 8, 8)])
        with pytest.raises(TransferError) as ei:
            bad.wait(timeout_s=10)
        assert ei.value.peer == peer and ei.value.code < 0 and bad.settled
        with pytest.raises(TransferError, match="write failed"):
            src_e.write(peer, [(src.data_ptr(), 8, 8)])
        with pytest.raises(TransferError, match="peer=127.0.0.1:1"):
            src_e.submit("127.0.0.1:1", [(src.data_ptr(), 4096, 8)]).wait(timeout_s=10)
        src_e.notify(peer, dst_e.scratch_addr, "hello", name="test")
        t_end = time.monotonic() + 5
        got = []
        while not got and time.monotonic() < t_end:
            got = dst_e.notifications()
            time.sleep(0.005)
        assert got == [("test", "hello")]
        with pytest.raises(ValueError):
            src_e.notify(peer, dst_e.scratch_addr, "x" * (MAX_NOTIFY_BYTES + 1))
    finally:
        dst_e.unregister(dst.data_ptr())
        src_e.unregister(src.data_ptr())


def test_missing_mooncake_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "mooncake", None)
    monkeypatch.setitem(sys.modules, "mooncake.engine", None)
    with pytest.raises(MooncakeUnavailable, match="mooncake-transfer-engine"):
        KVEngine()


def test_engine_with_http_metadata_server():
    """The other half of the config switch: a metadata service instead of P2PHANDSHAKE."""
    with socket.socket() as so:
        so.bind(("127.0.0.1", 0))
        port = so.getsockname()[1]
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mooncake.http_metadata_server",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        t_end = time.monotonic() + 20
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                assert time.monotonic() < t_end and proc.poll() is None, (
                    "metadata server did not start"
                )
                time.sleep(0.05)
        url = f"http://127.0.0.1:{port}/metadata"
        with (
            KVEngine(EngineConfig(metadata_server=url, hostname="127.0.0.1:1001")) as a,
            KVEngine(EngineConfig(metadata_server=url, hostname="127.0.0.1:1002")) as b,
        ):
            assert (a.session_id, b.session_id) == ("127.0.0.1:1001", "127.0.0.1:1002")
            dst, src = torch.zeros(4096, dtype=torch.uint8), torch.arange(4096).to(torch.uint8)
            a.register(dst.data_ptr(), 4096)
            b.register(src.data_ptr(), 4096)
            b.submit(a.session_id, [(src.data_ptr(), dst.data_ptr(), 4096)]).wait(timeout_s=10)
            assert torch.equal(dst, src)
    finally:
        proc.terminate()
        proc.wait(timeout=10)


# ============================================================================ in-process sender/receiver
@pytest.fixture(scope="module")
def pair(engines):
    """Decode pools + server on engine A, prefill pools on engine B (same process)."""
    dst_e, src_e = engines
    dpools, spools = make_pools(TINY, 4, 64, B), make_pools(TINY, 4, 64, B)
    fill_pools(dpools, 1)
    fill_pools(spools, 2)
    dlay, slay = pool_layout(TINY, dpools), pool_layout(TINY, spools)
    dst_e.register_layout(dlay)
    src_e.register_layout(slay)
    server = KVBootstrapServer(dst_e, dlay, release_grace_s=0.2).start()
    client = BootstrapClient()
    yield {
        "server": server,
        "client": client,
        "dpools": dpools,
        "spools": spools,
        "slay": slay,
        "src_e": src_e,
    }
    client.close()
    server.stop()
    dst_e.unregister_layout(dlay)
    src_e.unregister_layout(slay)


def meta_for(n: int, token_id: int = 1, **kw) -> TransferMetadata:
    """The metadata a prefill worker sends for an n-token prompt (ids ``0..n-1``)."""
    return TransferMetadata(
        request_id=kw.pop("request_id", "r"),
        prompt_token_ids=kw.pop("prompt_token_ids", list(range(n))),
        token_id=token_id,
        sampling=SamplingParams(temperature=0.0, seed=3),
        position=n,
        **kw,
    )


def same_meta(got, want: TransferMetadata) -> bool:
    """The receiver delivers the sender's TransferMetadata."""
    return isinstance(got, TransferMetadata) and got.model_dump() == want.model_dump()


def run_until(pred, timeout_s: float, *objs) -> float:
    t0 = time.monotonic()
    while not pred():
        for o in objs:
            o.poll()
        if time.monotonic() - t0 > timeout_s:
            raise AssertionError(f"not done within {timeout_s} s")
        time.sleep(0.001)
    return time.monotonic() - t0


def make_sender(p, rx, src_ref, **kw) -> KVSender:
    return KVSender(
        rx.ticket,
        p["server"].address,
        p["slay"],
        src_ref,
        engine=p["src_e"],
        client=p["client"],
        **kw,
    )


def test_inprocess_retry_then_success(pair):
    n = 3 * B + 1
    rx = KVReceiver(pair["server"], CacheRef(1, (9, 20, 21, 4), n), timeout_s=10)
    tx = make_sender(pair, rx, CacheRef(2, (0, 1, 2, 3), n), fail_first_n=1, max_retries=2)
    # pairing runs on the client's thread: on a loaded box it may already have paired
    assert rx.state in (KVPoll.BOOTSTRAPPING, KVPoll.WAITING_FOR_INPUT)
    for l in range(TINY.num_layers):
        tx.layer_ready(l)
        tx.poll()
    # progress: the receiver learns layer by layer what landed before the completion message
    expected = expected_layer_bytes(pair["server"].layout, rx.ref)
    run_until(lambda: rx.layers_received == expected, 10, tx, rx)
    assert rx.state == KVPoll.TRANSFERRING and tx.state == KVPoll.TRANSFERRING
    meta = meta_for(n, token_id=7, logprob=-0.25, top_logprobs=[(7, -0.25), (3, None)])
    tx.finish(meta)
    run_until(lambda: tx.state.terminal and rx.state.terminal, 10, tx, rx)
    assert tx.state == KVPoll.SUCCESS and rx.state == KVPoll.SUCCESS, (tx.error, rx.error)
    assert tx.attempts == 2 and rx.result.attempts == 2
    assert same_meta(rx.result.metadata, meta)
    assert rx.result.metadata.token_id == 7 and rx.result.metadata.position == n
    assert request_digest(pair["dpools"], rx.ref) == request_digest(pair["spools"], tx.src)


def test_inprocess_http_notify_large_metadata_and_chunks(pair):
    n = 5 * B
    for mode, meta in [
        ("http", meta_for(n, prompt_token_ids=list(range(50)))),
        ("te", meta_for(n, prompt_token_ids=list(range(60_000)))),  # too big for TE: HTTP
    ]:
        assert len(meta.model_dump_json()) > MAX_NOTIFY_BYTES or mode == "http"
        rx = KVReceiver(pair["server"], CacheRef(0, (30, 31, 32, 33, 34), n), timeout_s=10)
        tx = make_sender(pair, rx, CacheRef(3, (40, 41, 50, 51, 52), n), notify=mode)
        for upto in (B, 3 * B, n):  # chunked prefill: latents per chunk, states at the end
            for l in range(TINY.num_layers):
                tx.layer_ready(l, upto)
            tx.poll()
        tx.finish(meta)
        run_until(lambda tx=tx, rx=rx: tx.state.terminal and rx.state.terminal, 10, tx, rx)
        assert rx.state == KVPoll.SUCCESS, rx.error
        assert same_meta(rx.result.metadata, meta)
        assert rx.result.layer_bytes == expected_layer_bytes(pair["server"].layout, rx.ref)
        assert request_digest(pair["dpools"], rx.ref) == request_digest(pair["spools"], tx.src)
        rx.close()


def test_inprocess_decode_abort_refuses_http_completion(pair):
    n = 2 * B
    rx = KVReceiver(pair["server"], CacheRef(2, (44, 45), n), timeout_s=10)
    tx = make_sender(pair, rx, CacheRef(0, (10, 11), n), notify="http")
    run_until(lambda: tx.state == KVPoll.WAITING_FOR_INPUT, 10, tx)
    rx.abort("client went away")
    assert rx.poll() == KVPoll.FAILED and not rx.released  # the sender may still write
    tx.finish(meta_for(n))
    run_until(lambda: tx.state.terminal and rx.released, 10, tx, rx)
    assert tx.state == KVPoll.FAILED and "refused" in str(tx.error) and tx.retries_used == 0
    assert "client went away" in rx.error


def test_fault_plan_schedule_and_config():
    from kvstore.faults import FaultPlan

    plan = FaultPlan(0.1, 0.1, 0.1)
    faults = [plan.next() for _ in range(100)]
    assert faults.count("fail") == faults.count("hang") == faults.count("pair") == 10
    assert (faults[4], faults[7], faults[1]) == ("fail", "hang", "pair")  # deterministic
    assert not FaultPlan().active and all(FaultPlan().next() is None for _ in range(50))
    assert [FaultPlan(1.0).next() for _ in range(3)] == ["fail"] * 3
    with pytest.raises(ValueError, match="fail_fraction"):
        FaultPlan(1.5)
    with pytest.raises(ValueError):
        FaultPlan(0.6, 0.3, 0.3)
    cfg = KVConfig.from_env({"K3SERVE_KV_FAULT_FAIL_FRACTION": "0.1",
                             "K3SERVE_KV_FAULT_HANG_FRACTION": "0.05"})
    assert (cfg.fault_fail_fraction, cfg.fault_hang_fraction) == (0.1, 0.05)
    with pytest.raises(ValueError, match="K3SERVE_KV_FAULT_HANG_FRACTION"):
        KVConfig.from_env({"K3SERVE_KV_FAULT_HANG_FRACTION": "2"})


def test_inprocess_injected_fail_and_hang_expire_on_both_sides(pair):
    """An injected failure is reported once paired; a hung sender writes nothing, so the
    ticket expires at its deadline (receiver) and the sender at its own; both release."""
    n = 2 * B
    released = []
    rx = KVReceiver(pair["server"], CacheRef(3, (56, 57), n), timeout_s=10,
                    on_release=lambda: released.append("fail"))
    tx = make_sender(pair, rx, CacheRef(1, (12, 13), n), fault="fail")
    for l in range(TINY.num_layers):
        tx.layer_ready(l)
    tx.finish(meta_for(n))
    run_until(lambda: tx.state.terminal and rx.released, 10, tx, rx)
    assert tx.state == KVPoll.FAILED and rx.state == KVPoll.FAILED
    assert "injected" in rx.error and not rx.expired and not tx.expired
    rx2 = KVReceiver(pair["server"], CacheRef(3, (58, 59), n), timeout_s=0.3,
                     pair_timeout_s=10, on_release=lambda: released.append("hang"))
    tx2 = make_sender(pair, rx2, CacheRef(1, (14, 15), n), fault="hang", timeout_s=1.0)
    for l in range(TINY.num_layers):
        tx2.layer_ready(l)
    tx2.finish(meta_for(n))
    run_until(lambda: rx2.state.terminal, 5, tx2, rx2)
    assert rx2.state == KVPoll.FAILED and rx2.expired and "timed out" in rx2.error
    assert not tx2.state.terminal and tx2.bytes_sent == 0  # nothing written: it hangs
    run_until(lambda: tx2.state.terminal and rx2.released, 10, tx2, rx2)
    assert tx2.state == KVPoll.FAILED and tx2.expired
    assert released == ["fail", "hang"]
    rx3 = KVReceiver(pair["server"], CacheRef(3, (62,), B), timeout_s=10)
    tx3 = make_sender(pair, rx3, CacheRef(1, (16,), B), fault="pair")
    run_until(lambda: tx3.state.terminal, 5, tx3)
    assert tx3.state == KVPoll.FAILED and "t_paired" not in tx3.stats  # → 502 at prefill
    assert rx3.poll() == KVPoll.BOOTSTRAPPING  # never paired: the router's abort frees it
    rx3.abort("prefill answered 502")
    assert rx3.released


def test_failed_ticket_of_a_dead_sender_is_released_without_its_quiesce_wait(pair):
    """A paired sender announces when it stops writing (quiesce_by_s): a failed ticket's
    reservation waits for that while the sender's TE port answers, and is released as soon
    as the port refuses connections (the sender's process is gone)."""
    srv = pair["server"]
    alive = socket.socket()
    alive.bind(("127.0.0.1", 0))
    alive.listen()
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))
    dead_port = dead.getsockname()[1]
    dead.close()
    released, rxs = [], []
    for name, port in (("alive", alive.getsockname()[1]), ("dead", dead_port)):
        rx = KVReceiver(srv, CacheRef(2, (60 + len(rxs),), B), timeout_s=10,
                        on_release=lambda n=name: released.append(n))
        st, _ = srv.pair(PairRequest(ticket=rx.ticket, sender=f"s-{name}", quiesce_by_s=60,
                                     fingerprint=srv.layout.fingerprint(),
                                     sender_session=f"127.0.0.1:{port}"))
        assert st == 200
        rx.abort("the prefill worker went away")
        rxs.append(rx)
    run_until(lambda: rxs[1].released, 5, *rxs)
    assert released == ["dead"] and "gone" in rxs[1].error
    time.sleep(2.5 * srv.probe_interval_s)  # probed again meanwhile: still answers
    for rx in rxs:
        rx.poll()
    assert not rxs[0].released
    alive.close()  # now it is gone too
    run_until(lambda: rxs[0].released, 5, *rxs)
    for rx in rxs:
        rx.close()


def test_failure_report_reaches_a_busy_peer_that_answers(pair):
    """A sender whose ticket expired mid-transfer (the receiver's deadline passed while the
    sender, paired, wrote nothing) fails at its own deadline and reports it; the reservation
    is released then, not at the quiesce time it announced (its deadline + 2 × the engine's
    transfer timeout) — also while the peer's control queue is longer than the client's
    ``max_backlog``: the peer answers (here: status messages for other tickets, refused), so
    the report is queued behind them, not dropped."""
    srv, n = pair["server"], 2 * B
    client = BootstrapClient(workers=1, max_backlog=2)
    released: list[float] = []
    rx = KVReceiver(srv, CacheRef(2, (44, 45), n), timeout_s=0.3, pair_timeout_s=10,
                    on_release=lambda: released.append(time.monotonic()))
    tx = make_sender({**pair, "client": client}, rx, CacheRef(0, (46, 47), n), fault="hang",
                     timeout_s=2.0)
    t_deadline = time.monotonic() + tx.timeout_s
    tx.finish(meta_for(n))
    other = StatusMessage(ticket="other", sender="s", kind="layer", layers={0: 1}, runs=1,
                          attempts=1, elapsed_s=0.0)

    def chatter() -> None:  # another sender's progress message: answered (409 unknown ticket)
        with contextlib.suppress(BootstrapError):
            client.post_status(srv.address, other)
        time.sleep(0.02)

    try:
        while not tx.poll().terminal:
            while client.backlog(srv.address) < 2 * client.max_backlog:
                client.submit(chatter, peer=srv.address)
            rx.poll()
            assert time.monotonic() < t_deadline + 3, "the hung sender did not expire"
            time.sleep(0.005)
        assert rx.state == KVPoll.FAILED and rx.expired and "sender paired" in rx.error
        assert tx.state == KVPoll.FAILED and tx.expired and tx.bytes_sent == 0
        assert client.backlog(srv.address) >= client.max_backlog  # the report is queued
        run_until(lambda: rx.released, 3, rx)
        assert released[0] < t_deadline + 1.5  # the announced quiesce time: + 20 s
        # quiesced by the sender's report (its engine's port answers the liveness probes)
        assert srv.get(rx.ticket).quiesced and "gone" not in rx.error
    finally:
        client.close()
    rx.close()


def test_failure_report_goes_out_when_the_pairing_reply_never_came(pair):
    """A sender that fails while its pairing request is still unanswered gives up on it
    (``job_grace_s``) and reports anyway: the decode side paired it and releases the
    reservation on that report instead of holding it to the sender's quiesce time."""
    srv, n = pair["server"], B
    client = BootstrapClient()
    real_pair = client.pair

    def slow_pair(*a):  # paired there, the reply late
        resp = real_pair(*a)
        time.sleep(3.0)
        return resp

    client.pair = slow_pair
    rx = KVReceiver(srv, CacheRef(2, (48,), n), timeout_s=30)
    tx = make_sender({**pair, "client": client}, rx, CacheRef(0, (49,), n), timeout_s=30,
                     job_grace_s=0.3)
    try:
        run_until(lambda: rx.state == KVPoll.WAITING_FOR_INPUT, 5, rx)
        assert tx.poll() == KVPoll.BOOTSTRAPPING
        t0 = time.monotonic()
        tx.abort("the request ended")
        run_until(lambda: tx.state.terminal and rx.released, 2.5, tx, rx)
        assert time.monotonic() - t0 < 2.5  # before the pairing reply (3 s), not at 30 + 20 s
        assert rx.state == KVPoll.FAILED and "sender aborted" in rx.error
        assert tx.state == KVPoll.FAILED and "t_paired" not in tx.stats
    finally:
        client.close(wait=False)
    rx.close()


def test_inprocess_manifest_short_and_timeout(pair):
    srv = pair["server"]
    rx = KVReceiver(srv, CacheRef(0, (1, 2), 2 * B), timeout_s=10)
    st, _ = srv.pair(
        PairRequest(ticket=rx.ticket, sender="s1", fingerprint=srv.layout.fingerprint())
    )
    assert st == 200 and rx.poll() == KVPoll.WAITING_FOR_INPUT
    ok, _ = srv.on_status(
        StatusMessage(
            ticket=rx.ticket, sender="s1", kind="done", layers={0: 1}, metadata=meta_for(2 * B)
        )
    )
    assert not ok and rx.poll() == KVPoll.FAILED and "incomplete transfer" in rx.error
    assert "layer 3: got 0 B" in rx.error
    released = []
    rx2 = KVReceiver(
        srv, CacheRef(1, (3,), B), timeout_s=0.2, on_release=lambda: released.append(1)
    )
    run_until(lambda: rx2.state.terminal, 5, rx2)
    assert rx2.state == KVPoll.FAILED and "never paired" in rx2.error and released == [1]


def test_pairing_retries_an_unreachable_server_then_fails(pair):
    """Pairing over HTTP is retried (tenacity, the sender's shared budget) while the server is
    unreachable; with the budget spent the sender fails naming the cause."""
    with socket.socket() as so:  # a port nobody listens on
        so.bind(("127.0.0.1", 0))
        addr = f"127.0.0.1:{so.getsockname()[1]}"
    tx = KVSender(
        "t-unreachable",
        addr,
        pair["slay"],
        CacheRef(0, (0,), B),
        engine=pair["src_e"],
        client=pair["client"],
        max_retries=2,
        retry_backoff_s=0.01,
    )
    run_until(lambda: tx.state.terminal, 10, tx)
    assert tx.state == KVPoll.FAILED and "unreachable" in str(tx.error)
    assert tx.retries_used == 2 and tx.attempts == 3 and "t_paired" not in tx.stats


def test_finish_takes_only_transfer_metadata(pair):
    n = B
    rx = KVReceiver(pair["server"], CacheRef(3, (60,), n), timeout_s=10)
    tx = make_sender(pair, rx, CacheRef(1, (61,), n))
    want = meta_for(n, token_id=5)
    with pytest.raises(TypeError, match="TransferMetadata"):
        tx.finish(want.model_dump(mode="json"))  # a dict is not a message
    tx.finish(want)
    with pytest.raises(RuntimeError, match="twice"):
        tx.finish(want)
    run_until(lambda: tx.state.terminal and rx.state.terminal, 10, tx, rx)
    assert rx.state == KVPoll.SUCCESS and same_meta(rx.result.metadata, want)
    m = rx.result.metadata
    assert type(m) is TransferMetadata and m == want
    assert m.sampling.seed == 3
    rx.close()


def test_aborts_release_every_reservation(pair):
    """200 aborts at every stage; afterwards no reservation is left unreleased."""
    srv, rng = pair["server"], random.Random(0)
    freed: list[str] = []
    tickets = []
    for i in range(200):
        stage = i % 4
        rx = KVReceiver(
            srv, CacheRef(i % 4, (i % 64,), B), timeout_s=10, on_release=lambda i=i: freed.append(i)
        )
        tickets.append(rx)
        if stage == 0:  # decode aborts before any sender shows up
            rx.abort()
            assert rx.released
            continue
        if stage == 1:  # a sender paired: release must wait until it is quiesced
            srv.pair(
                PairRequest(ticket=rx.ticket, sender=f"s{i}", fingerprint=srv.layout.fingerprint())
            )
            rx.abort()
            assert not rx.released
            srv.on_status(
                StatusMessage(
                    ticket=rx.ticket, sender=f"s{i}", kind="aborted", error="x", quiesced=True
                )
            )
            rx.poll()
            assert rx.released
            continue
        tx = make_sender(pair, rx, CacheRef(rng.randrange(4), (rng.randrange(64),), B))
        run_until(lambda tx=tx: tx.state != KVPoll.BOOTSTRAPPING, 5, tx)
        if stage == 2:  # prefill aborts mid-way
            tx.layer_ready(0)
            tx.abort()
        else:  # decode aborts while the sender is writing; the sender still finishes
            tx.layer_ready(0)
            rx.abort()
            tx.finish(meta_for(B))
        run_until(lambda tx=tx, rx=rx: tx.state.terminal and rx.released, 5, tx, rx)
        assert rx.state == KVPoll.FAILED
        # a late pairing of an aborted ticket is refused
        assert srv.pair(PairRequest(ticket=rx.ticket, sender="late"))[0] == 410
    assert srv.unreleased() == 0 and sorted(freed) == list(range(200))


def test_plugs_into_kvpools_and_cache_handle():
    """The real pools (k3serve.cache.pools.KVPools) and the engine's CacheHandle plug in as is."""
    from k3serve.cache.pools import KVPools
    from k3serve.protocol import CacheHandle

    dpools, spools = (KVPools(TINY, 2, 16, block_size=B, dtype=torch.bfloat16) for _ in range(2))
    for t in spools.tensors().values():
        t.copy_(torch.randn(t.shape).to(t.dtype))
    dlay, slay = PoolLayout.from_kvpools(dpools), PoolLayout.from_kvpools(spools)
    assert dlay.fingerprint() == pool_layout(TINY, make_pools(TINY, 1, 1, B)).fingerprint()
    n = 2 * B + 3
    with KVEngine() as de, KVEngine() as se:
        de.register_layout(dlay)
        se.register_layout(slay)
        with KVBootstrapServer(de, dlay) as srv:
            rx = KVReceiver(srv, CacheHandle("r1", 1, (7, 3, 4), n, B))
            tx = KVSender(
                rx.ticket, srv.address, slay, CacheHandle("r1", 0, (0, 1, 2), n, B), engine=se
            )
            for layer in range(TINY.num_layers):  # the engine's layer_hook(layer, upto_tokens)
                tx.layer_ready(layer, n)
            tx.finish(meta_for(n))
            run_until(lambda: tx.state.terminal and rx.state.terminal and tx.released, 10, tx, rx)
            assert rx.state == KVPoll.SUCCESS, (tx.error, rx.error)
    assert torch.equal(dpools.kda_state[:, 1], spools.kda_state[:, 0])
    assert torch.equal(dpools.conv_state[:, 1], spools.conv_state[:, 0])
    d = dpools.mla_latent[:, [7, 3, 4]].flatten(1, 2)[:, :n]
    assert torch.equal(d, spools.mla_latent[:, [0, 1, 2]].flatten(1, 2)[:, :n])


# ============================================================================ two processes
class Peer:
    """``python -m kvstore.loopback`` (decode side) driven over stdin/stdout JSON lines."""

    def __init__(self, *args: str) -> None:
        self.log = tempfile.NamedTemporaryFile("w+", prefix="kvpeer-", suffix=".log", delete=False)  # noqa: SIM115
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvstore.loopback",
                "--model",
                "k3-tiny",
                "--slots",
                "4",
                "--pages",
                "64",
                "--block-size",
                str(B),
                *args,
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            cwd=ROOT,
            env=env,
        )
        try:
            self.info = self._read(60)
            assert self.info.get("ready"), self.info
        except BaseException:  # never ready: do not leave the process behind
            self.proc.kill()
            self.proc.wait(timeout=5)
            self.log.close()
            raise

    def _read(self, timeout_s: float) -> dict:
        r, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        if not r:
            raise AssertionError(f"peer silent for {timeout_s} s; log {self.log.name}")
        line = self.proc.stdout.readline()
        if not line:
            raise AssertionError(
                f"peer exited ({self.proc.poll()}); log:\n{Path(self.log.name).read_text()[-3000:]}"
            )
        return json.loads(line)

    def cmd(self, **kw) -> dict:
        self.proc.stdin.write(json.dumps(kw) + "\n")
        self.proc.stdin.flush()
        out = self._read(float(kw.get("timeout_s", 10)) + 20)
        assert "error" not in out or out.get("state"), out
        return out

    @property
    def addr(self) -> str:
        return self.info["bootstrap"]

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.cmd(op="exit")
                self.proc.wait(timeout=5)
            except (AssertionError, OSError, subprocess.TimeoutExpired) as e:
                print(f"peer did not exit cleanly: {e!r}")
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=5)
        self.log.close()
        os.unlink(self.log.name)


@pytest.fixture(scope="module")
def peer():
    p = Peer()
    yield p
    p.close()


@pytest.fixture(scope="module")
def prefill():
    """The prefill side, in this process: its own engine, pools with random contents."""
    eng = KVEngine()
    pools = make_pools(TINY, 4, 64, B)
    fill_pools(pools, 99)
    lay = pool_layout(TINY, pools)
    eng.register_layout(lay)
    client = BootstrapClient()
    yield {"engine": eng, "pools": pools, "layout": lay, "client": client}
    client.close()
    eng.close()


def test_two_process_layer_by_layer(peer, prefill):
    n = 6 * B + 5
    dst = {"slot": 3, "pages": [17, 18, 40, 41, 42, 5, 6], "num_tokens": n}
    ticket = peer.cmd(op="register", timeout_s=20, **dst)["ticket"]
    src = CacheRef(1, (2, 3, 4, 30, 31, 8, 60), n)
    released = []
    tx = KVSender(
        ticket,
        peer.addr,
        prefill["layout"],
        src,
        engine=prefill["engine"],
        client=prefill["client"],
        on_release=lambda: released.append(1),
    )
    run_until(lambda: tx.state == KVPoll.WAITING_FOR_INPUT, 10, tx)
    for l in range(TINY.num_layers):
        time.sleep(0.002)  # "compute" of layer l
        tx.layer_ready(l)
        tx.poll()
    meta = meta_for(n, token_id=42, logprob=-0.5)
    tx.finish(meta)
    run_until(lambda: tx.state.terminal, 10, tx)
    assert tx.state == KVPoll.SUCCESS, tx.error
    assert released == [1]
    out = peer.cmd(op="wait", ticket=ticket, timeout_s=10)
    assert out["state"] == "SUCCESS", out
    assert out["digest"] == request_digest(prefill["pools"], src)
    assert out["changed_elsewhere"] == []
    res = out["result"]
    assert TransferMetadata.model_validate(res["metadata"]) == meta
    assert (
        res["total_bytes"] == TINY.kda_state_bytes_per_seq() + n * TINY.mla_latent_bytes_per_token()
    )
    assert (
        res["num_runs"] == independent_run_count(TINY, src.pages, dst["pages"], n, B) == tx.num_runs
    )
    assert {int(k): v for k, v in out["layers"].items()} == {
        int(k): v for k, v in res["layer_bytes"].items()
    }


def test_two_process_fingerprint_mismatch_refused(peer, prefill):
    ticket = peer.cmd(op="register", slot=0, pages=[0, 1], num_tokens=2 * B, timeout_s=20)["ticket"]
    pools32 = make_pools(TINY, 2, 8, B, cache_dtype="float32")  # latents/conv in fp32: bytes differ
    lay32 = pool_layout(TINY, pools32)
    tx = KVSender(
        ticket,
        peer.addr,
        lay32,
        CacheRef(0, (0, 1), 2 * B),
        engine=prefill["engine"],
        client=prefill["client"],
    )
    run_until(lambda: tx.state.terminal, 10, tx)
    assert tx.state == KVPoll.FAILED and isinstance(tx.error, FingerprintMismatch)
    msg = str(tx.error)
    assert "regions.mla_latent.dtype: local='float32' remote='bfloat16'" in msg
    assert "regions.conv_state.dtype" in msg and tx.retries_used == 0
    out = peer.cmd(op="wait", ticket=ticket, timeout_s=10)
    assert out["state"] == "FAILED" and "fingerprint mismatch" in out["error"]
    assert "mla_latent.dtype" in out["error"] and out["released"]


def test_two_process_injected_failure_retry_then_failed(peer, prefill):
    n = 2 * B
    ticket = peer.cmd(op="register", slot=2, pages=[10, 11], num_tokens=n, timeout_s=20)["ticket"]
    tx = KVSender(
        ticket,
        peer.addr,
        prefill["layout"],
        CacheRef(0, (0, 1), n),
        engine=prefill["engine"],
        client=prefill["client"],
        fail_first_n=3,
        max_retries=2,
        retry_backoff_s=0.01,
    )
    for l in range(TINY.num_layers):
        tx.layer_ready(l)
    tx.finish(meta_for(n))
    run_until(lambda: tx.state.terminal, 10, tx)
    assert tx.state == KVPoll.FAILED and isinstance(tx.error, TransferError)
    assert "retries exhausted" in str(tx.error) and tx.retries_used == 2
    out = peer.cmd(op="wait", ticket=ticket, timeout_s=10)
    assert (
        out["state"] == "FAILED"
        and "sender failed" in out["error"]
        and "retries exhausted" in out["error"]
    )
    assert out["released"] and out["releases"] == 1


def test_two_process_dead_decode_peer(prefill):
    dead = Peer()
    try:
        ticket = dead.cmd(op="register", slot=0, pages=[0, 1, 2], num_tokens=3 * B, timeout_s=30)[
            "ticket"
        ]
        tx = KVSender(
            ticket,
            dead.addr,
            prefill["layout"],
            CacheRef(1, (5, 6, 7), 3 * B),
            engine=prefill["engine"],
            client=prefill["client"],
            timeout_s=20,
            max_retries=2,
            retry_backoff_s=0.05,
        )
        run_until(lambda: tx.state == KVPoll.WAITING_FOR_INPUT, 10, tx)
        dead.proc.kill()
        dead.proc.wait(timeout=5)
        t0 = time.monotonic()
        for l in range(TINY.num_layers):
            tx.layer_ready(l)
            tx.poll()
        tx.finish(meta_for(3 * B))
        run_until(lambda: tx.state.terminal, 15, tx)
        took = time.monotonic() - t0
        assert tx.state == KVPoll.FAILED and tx.released
        assert took < 10, f"dead peer detected after {took:.1f} s"
        assert "retries exhausted" in str(tx.error) or "unreachable" in str(tx.error)
    finally:
        dead.close()


def test_two_process_dead_prefill(peer):
    """The prefill pairs, then goes silent: the decode side fails at its timeout and releases
    the reservation once the sender's announced quiesce time has passed."""
    eng = KVEngine(EngineConfig(transfer_timeout_s=0.5))
    pools = make_pools(TINY, 1, 4, B)
    lay = pool_layout(TINY, pools)
    eng.register_layout(lay)
    try:
        ticket = peer.cmd(op="register", slot=1, pages=[50, 51], num_tokens=2 * B, timeout_s=1.0)[
            "ticket"
        ]
        tx = KVSender(ticket, peer.addr, lay, CacheRef(0, (0, 1), 2 * B), engine=eng, timeout_s=1.0)
        run_until(lambda: tx.state == KVPoll.WAITING_FOR_INPUT, 10, tx)
        t0 = time.monotonic()  # from here on tx is never polled again: a dead prefill
        out = peer.cmd(op="wait", ticket=ticket, timeout_s=15)
        took = time.monotonic() - t0
        assert (
            out["state"] == "FAILED"
            and "timed out" in out["error"]
            and "sender paired" in out["error"]
        )
        assert out["released"] and took < 6, (out, took)
        stats = peer.cmd(op="stats")
        assert stats["open"] == 0 and stats["unreleased"] == 0
    finally:
        eng.close()
