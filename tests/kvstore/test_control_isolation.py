"""kvstore control path under a peer that never answers: pairing, completion messages and
failure reports to one hung decode peer must not delay transfers to a healthy one; the
transfer thread finishes transfers without the caller polling; the Transfer Engine's ports
accept connections only on the engine's interface; Mooncake's start-up log stays off stderr."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from k3serve.config import PRESETS
from k3serve.messages import StatusMessage, TransferMetadata
from k3serve.sampling import SamplingParams
from kvstore import (
    BootstrapClient,
    CacheRef,
    KVBootstrapServer,
    KVEngine,
    KVPoll,
    KVReceiver,
    KVSender,
)
from kvstore.listen import bound_device, interface_of, listening_sockets
from kvstore.loopback import fill_pools, make_pools, pool_layout, request_digest

TINY = PRESETS["k3-tiny"]
B = 16
#: how long a request to the hung peer blocks (the client's HTTP timeout): far above every bound
HUNG_S = 30.0


class HungPeer:
    """A TCP port that completes the handshake (the kernel's backlog) and never answers."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.addr = f"127.0.0.1:{self.sock.getsockname()[1]}"

    def close(self) -> None:
        self.sock.close()  # queued connections are reset: stuck requests end at once


@pytest.fixture(scope="module")
def side():
    dst_e, src_e = KVEngine(), KVEngine()
    dpools, spools = make_pools(TINY, 4, 64, B), make_pools(TINY, 4, 64, B)
    fill_pools(dpools, 5)
    fill_pools(spools, 6)
    dlay, slay = pool_layout(TINY, dpools), pool_layout(TINY, spools)
    dst_e.register_layout(dlay)
    src_e.register_layout(slay)
    server = KVBootstrapServer(dst_e, dlay, release_grace_s=0.2).start()
    hung = HungPeer()
    client = BootstrapClient(http_timeout_s=HUNG_S)
    yield {"server": server, "client": client, "hung": hung, "src_e": src_e, "slay": slay,
           "dpools": dpools, "spools": spools}
    hung.close()
    client.close()
    server.stop()
    dst_e.close()
    src_e.close()


def meta(n: int) -> TransferMetadata:
    return TransferMetadata(request_id="r", prompt_token_ids=list(range(n)), token_id=1,
                            sampling=SamplingParams(temperature=0.0, seed=1), position=n)


def test_hung_peer_does_not_delay_a_healthy_peer(side):
    client, hung, src_e = side["client"], side["hung"], side["src_e"]
    # more stuck jobs on the hung peer than any shared pool has threads: pairings and failure
    # reports (best effort: beyond the backlog they are dropped, never queued without bound)
    stuck = [KVSender(f"t{i}", hung.addr, side["slay"], CacheRef(i % 4, (i,), 10),
                      engine=src_e, client=client, timeout_s=1.0) for i in range(4)]
    report = StatusMessage(ticket="x", sender="s", kind="failed", layers={}, runs=0,
                           attempts=1, elapsed_s=0.0, error="e", quiesced=True)
    queued = [client.submit_best_effort(client.post_status, hung.addr, report, peer=hung.addr)
              for _ in range(2 * client.max_backlog)]
    assert queued.count(None) >= client.max_backlog  # dropped once the backlog is full
    assert client.backlog(hung.addr) == client.max_backlog

    n = 3 * B + 5
    t0 = time.monotonic()
    rx = KVReceiver(side["server"], CacheRef(2, (10, 11, 12, 13), n), timeout_s=20)
    src = CacheRef(1, (20, 21, 22, 23), n)
    tx = KVSender(rx.ticket, side["server"].address, side["slay"], src, engine=src_e,
                  client=client, timeout_s=20)
    tx.finish(meta(n))
    while not (tx.poll().terminal and rx.poll().terminal):
        assert time.monotonic() - t0 < 5.0, f"healthy transfer stuck in {tx.state.name}"
        time.sleep(0.01)
    healthy_s = time.monotonic() - t0
    assert tx.poll() == KVPoll.SUCCESS and rx.state == KVPoll.SUCCESS, (tx.error, rx.error)
    assert request_digest(side["dpools"], rx.ref) == request_digest(side["spools"], src)
    assert all(s.state == KVPoll.BOOTSTRAPPING for s in stuck)  # still blocked meanwhile
    assert healthy_s < 5.0
    # the first pairing opened the TE session to this peer; later ones reuse it
    assert not client.first_contact(side["server"].engine.session_id)

    # the stuck senders fail at their deadline + job_grace_s, not at the HTTP timeout
    while not all(s.poll().terminal for s in stuck):
        assert time.monotonic() - t0 < 1.0 + stuck[0].job_grace_s + 3.0, "stuck senders hang"
        time.sleep(0.01)
    assert all(s.state == KVPoll.FAILED and s.expired and s.released for s in stuck)
    assert time.monotonic() - t0 < HUNG_S / 2


def test_transfer_thread_finishes_without_polling(side):
    """Writes, completion and SUCCESS happen on the engine's transfer thread."""
    n = 2 * B
    rx = KVReceiver(side["server"], CacheRef(3, (30, 31), n), timeout_s=20)
    seen: list[KVPoll] = []
    tx = KVSender(rx.ticket, side["server"].address, side["slay"], CacheRef(0, (40, 41), n),
                  engine=side["src_e"], client=side["client"],
                  on_release=lambda: seen.append(tx.state))
    for layer in range(TINY.num_layers):
        tx.layer_ready(layer)
    tx.finish(meta(n))
    t_end = time.monotonic() + 10
    while "t_done" not in tx.stats:  # no tx.poll(): only the transfer thread advances it
        assert time.monotonic() < t_end and tx.error is None, tx.error
        time.sleep(0.005)
    assert {"t_paired", "t_written", "t_done"} <= set(tx.stats)
    # what the caller sees (and on_release) changes only when it polls
    assert tx.state == KVPoll.BOOTSTRAPPING and not tx.released
    assert tx.poll() == KVPoll.SUCCESS and tx.released
    assert seen == [KVPoll.SUCCESS]  # on_release reads the state it was released in
    while rx.poll() != KVPoll.SUCCESS:
        assert time.monotonic() < t_end
        time.sleep(0.005)


def test_engine_ports_listen_on_the_hostname_interface_only():
    before = listening_sockets()
    with KVEngine() as e:  # hostname 127.0.0.1
        new = {i: v for i, v in listening_sockets().items() if i not in before}
        ports = sorted(p for _, p in new.values())
        assert e.rpc_port in ports and len(ports) >= 2  # handshake RPC + tcp data port
        assert e.listen_interface == "lo" and e.open_ports == []
        assert all(bound_device(fd) == "lo" for fd, _ in new.values())
        ss = subprocess.run(["ss", "-ltn"], check=True, capture_output=True, text=True).stdout
        for p in ports:  # `ss -ltn`: 0.0.0.0%lo:PORT / *%lo:PORT, never a bare wildcard
            rows = [l for l in ss.splitlines() if l.split()[3:4] and
                    l.split()[3].endswith(f":{p}")]
            assert rows and all("%lo:" in r.split()[3] for r in rows), rows
        with socket.create_connection(("127.0.0.1", e.rpc_port), timeout=2):
            pass  # still reachable where it advertises itself
    assert interface_of("127.0.0.1:1001") == "lo" and interface_of("[::1]:5") == "lo"
    assert interface_of("0.0.0.0") is None and interface_of("192.0.2.77") is None


def test_mooncake_start_up_log_stays_off_stderr(tmp_path):
    code = ("from kvstore import KVEngine\n"
            "e = KVEngine()\nprint('ok', e.session_id)\ne.close()\n")
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "MC_LOG_LEVEL"}
    out = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True,
                         timeout=60, cwd=tmp_path, env={**env, "PYTHONPATH": str(root)})
    assert out.returncode == 0 and out.stdout.startswith("ok "), out.stderr[-2000:]
    noisy = [l for l in out.stderr.splitlines() if l[:1] in "IWE" and l[1:5].isdigit()]
    assert noisy == [] and "InitGoogleLogging" not in out.stderr, out.stderr[-2000:]
