"""kvstore host staging (kvstore/staging.py): the pinned-mirror path GPU pools take to the TE,
exercised here on CPU pools (same code; copies synchronous, mirror unpinned)."""

from __future__ import annotations

import types

import pytest
import torch

from k3serve.config import PRESETS
from kvstore import (
    BootstrapClient,
    CacheRef,
    KVBootstrapServer,
    KVConfig,
    KVEngine,
    KVPoll,
    KVReceiver,
    KVSender,
)
from kvstore.loopback import fill_pools, make_pools, pool_layout, register_pools, request_digest
from kvstore.staging import HostStaging, _ranges, make_staging
from tests.kvstore.test_kvstore import B, Peer, meta_for, run_until

TINY = PRESETS["k3-tiny"]


def _pools(seed: int | None = None) -> dict[str, torch.Tensor]:
    p = make_pools(TINY, 4, 64, B)
    if seed is not None:
        fill_pools(p, seed)
    return p


def test_ranges_groups_consecutive_pages():
    assert _ranges([7, 8, 2, 3, 4, 9]) == [(7, 2), (2, 3), (9, 1)]
    assert _ranges([]) == []


def test_modes_and_mirror_layout():
    pools = _pools(0)
    lay = pool_layout(TINY, pools)
    ns = types.SimpleNamespace(**pools)
    assert make_staging("auto", ns, lay) is None  # CPU pools: registered as they are
    assert make_staging("direct", ns, lay) is None
    with pytest.raises(ValueError, match="K3SERVE_KV_STAGING"):
        make_staging("pinned", ns, lay)
    st = make_staging("host", ns, lay)
    assert isinstance(st, HostStaging) and not st.pinned
    assert st.layout.fingerprint() == lay.fingerprint()
    assert [r.base for r in st.layout.regions] != [r.base for r in lay.regions]
    assert st.nbytes == sum(t.numel() * t.element_size() for t in pools.values())
    assert KVConfig.from_env({"K3SERVE_KV_STAGING": "direct"}).staging == "direct"
    with pytest.raises(ValueError, match="K3SERVE_KV_STAGING"):
        KVConfig.from_env({"K3SERVE_KV_STAGING": "gpu"})


def test_stage_out_copies_only_the_layer_range_and_stage_in_only_the_request():
    pools = _pools(1)
    st = HostStaging(pools, pool_layout(TINY, pools))
    ref = CacheRef(2, (9, 3, 4, 20), 3 * B + 5)
    mla0 = TINY.mla_layers[0]
    assert st.stage_out(ref, mla0, B, 2 * B + 1, with_state=False) is None  # CPU: done
    h, d = st.host["mla_latent"], pools["mla_latent"]
    assert torch.equal(h[0, [3, 4]], d[0, [3, 4]])  # pages of tokens [B, 2B+1)
    assert not h[0, [9, 20]].any() and not h[1:].any()  # nothing else of the mirror
    kda0 = TINY.kda_layers[0]
    st.stage_out(ref, kda0, 0, ref.num_tokens, with_state=True)
    assert torch.equal(st.host["kda_state"][0, 2], pools["kda_state"][0, 2])
    assert not st.host["kda_state"][0, [0, 1, 3]].any()
    with pytest.raises(ValueError):
        st.stage_out(ref, 99, 0, 1, with_state=True)
    # the way back: every layer of the request, nothing outside its tokens
    for layer in TINY.kda_layers + TINY.mla_layers:
        st.stage_out(ref, layer, 0, ref.num_tokens, with_state=True)
    dev = _pools(2)  # another "device" whose contents must survive outside the request
    back = HostStaging(dev, pool_layout(TINY, dev))
    for name in back.host:
        back.host[name].copy_(st.host[name])
    before = {k: v.clone() for k, v in dev.items()}
    back.stage_in_ref(ref)
    assert request_digest(dev, ref) == request_digest(pools, ref)
    last = dev["mla_latent"][:, 20, 5:]  # tail of the last page: not the request's tokens
    assert torch.equal(last, before["mla_latent"][:, 20, 5:])
    other = [s for s in range(4) if s != 2]
    assert torch.equal(dev["kda_state"][:, other], before["kda_state"][:, other])
    with pytest.raises(ValueError, match="does not fill"):
        back.stage_in(2, (9, 3), 5 * B)


class _SlowCopies:
    """A staging whose copies 'land' only after a few readiness checks (what a CUDA event
    does while the device is behind): writes must wait for them."""

    def __init__(self, inner: HostStaging, checks: int = 3) -> None:
        self.inner, self.checks, self.waited = inner, checks, 0

    def stage_out(self, *a):
        self.inner.stage_out(*a)
        left = [self.checks]

        def ready() -> bool:
            left[0] -= 1
            self.waited += left[0] >= 0
            return left[0] < 0

        return ready


@pytest.mark.parametrize("dst_mode", ["host", "direct"])
def test_staged_sender_chunked_prefill_lands_in_the_device_pools(dst_mode):
    """Both engines in this process; the sender stages (chunked prefill: layers ready up to a
    partial page, then the whole prompt); the receiver stages too or takes the writes
    directly. SUCCESS means the decode side's *pools* hold the request (copied in before)."""
    spools, dpools = _pools(5), _pools(6)
    n = 4 * B + 3
    src, dst = CacheRef(1, (2, 3, 10, 11, 12), n), CacheRef(3, (40, 41, 42, 7, 8), n)
    with KVEngine() as se, KVEngine() as de:
        slay = register_pools(se, TINY, spools, "host")
        dlay = register_pools(de, TINY, dpools, dst_mode)
        assert (se.staging is not None, de.staging is not None) == (True, dst_mode == "host")
        se.staging = slow = _SlowCopies(se.staging)
        client = BootstrapClient()
        with KVBootstrapServer(de, dlay) as srv:
            rx = KVReceiver(srv, dst, timeout_s=20)
            tx = KVSender(rx.ticket, srv.address, slay, src, engine=se, client=client)
            run_until(lambda: tx.state == KVPoll.WAITING_FOR_INPUT, 10, tx)
            for layer in TINY.kda_layers + TINY.mla_layers:  # chunk 1: tokens [0, 2B+1)
                if layer in TINY.mla_layers:
                    tx.layer_ready(layer, 2 * B + 1)
            tx.poll()
            for layer in range(TINY.num_layers):  # chunk 2: the rest, states final
                tx.layer_ready(layer)
            tx.finish(meta_for(n))
            run_until(lambda: tx.state.terminal and rx.state.terminal, 20, tx, rx)
            assert (tx.state, rx.state) == (KVPoll.SUCCESS, KVPoll.SUCCESS), (tx.error, rx.error)
        client.close()
    assert slow.waited > 0  # some writes did wait for their copy
    assert request_digest(dpools, dst) == request_digest(spools, src)


def test_two_process_staged_both_sides():
    """The loopback decode peer with ``--staging host`` and a staged prefill side: the bytes
    land in the peer's pools exactly and nothing else there changes."""
    peer = Peer("--staging", "host")
    try:
        spools = _pools(9)
        n = 5 * B + 7
        src = CacheRef(0, (5, 6, 7, 30, 31, 32), n)
        client = BootstrapClient()
        with KVEngine() as se:
            slay = register_pools(se, TINY, spools, "host")
            ticket = peer.cmd(op="register", slot=2, pages=[1, 2, 3, 50, 51, 9], num_tokens=n,
                              timeout_s=20)["ticket"]  # fmt: skip
            tx = KVSender(ticket, peer.addr, slay, src, engine=se, client=client)
            for layer in range(TINY.num_layers):
                tx.layer_ready(layer)
                tx.poll()
            tx.finish(meta_for(n))
            run_until(lambda: tx.state.terminal, 20, tx)
            assert tx.state == KVPoll.SUCCESS, tx.error
            out = peer.cmd(op="wait", ticket=ticket, timeout_s=10)
        client.close()
        assert out["state"] == "SUCCESS" and out["staging"], out
        assert out["digest"] == request_digest(spools, src)
        assert out["changed_elsewhere"] == []
        assert out["stage_in_s"] > 0
    finally:
        peer.close()
