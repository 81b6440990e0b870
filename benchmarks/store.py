"""Shared-store benchmark: Mooncake Store put/get GB/s beside raw Transfer Engine, same run.

One ``mooncake_master`` on loopback (``deploy.local.start_store_master``); two store clients in
this process (:class:`kvstore.store.client.KVStore`, the product's client: a writer that puts through
its bounded queue + writer thread, a reader that gets) each contribute a DRAM segment. Payloads
have the shapes the workers put (``KVPools.snapshot_nbytes`` / ``block_nbytes``):

* one KDA snapshot of k3-tiny / k3-mini (all KDA states float32 + conv states);
* 64 MLA blocks (64 tokens each, every MLA layer) of k3-tiny / k3-mini;

``put`` = enqueue → writer thread flushed (existence check + put), ``get`` = the reader's
``get_*`` (bytes in this process). ``raw TE`` = ``KVEngine.write`` (one batched
``batch_transfer_sync_write``) of the same bytes into a second process's registered buffer over
tcp loopback: the floor of any transfer on this machine.

Usage: ``python benchmarks/store.py [--reps 5] [--json OUT]``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np

from deploy.local import start_store_master
from k3serve.cache.pools import KVPools
from k3serve.config import PRESETS
from k3serve.process import output_file, positive_int
from kvstore import KVEngine
from kvstore.store.client import KVStore, StoreConfig, StoreStats

_PEER = r"""
import sys, numpy as np
sys.path.insert(0, sys.argv[1])
from kvstore import KVEngine
n = int(sys.argv[2])
buf = np.zeros(n, np.uint8)
e = KVEngine()
e.register(buf.ctypes.data, n)
print(e.rpc_port, buf.ctypes.data, flush=True)
sys.stdin.readline()
"""


def _shapes() -> dict[str, tuple[int, int]]:
    out = {}
    for name in ("k3-tiny", "k3-mini"):
        cfg = PRESETS[name]
        p = KVPools(cfg, num_slots=1, num_pages=1, block_size=64, num_snapshots=1)
        out[name] = (p.snapshot_nbytes(), p.block_nbytes())
    return out


def _gbps(nbytes: int, seconds: list[float]) -> float:
    return nbytes / statistics.median(seconds) / 1e9


def stats_line(name: str, s: StoreStats) -> str:
    """One client's counters as words: ``writer: 650 puts (12.34 MB), 0 skipped, ...``."""
    return (f"{name}: {s.puts} puts ({s.put_bytes / 1e6:.2f} MB), {s.put_skipped} skipped "
            f"(key present), {s.put_dropped} dropped, {s.gets} gets "
            f"({s.get_bytes / 1e6:.2f} MB), {s.failures} failures, {s.gone} gone")


def build_parser() -> argparse.ArgumentParser:
    """The flags of ``python benchmarks/store.py``."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=positive_int, default=5,
                    help="timed repetitions per payload; the table shows their median "
                         "(default: 5)")
    ap.add_argument("--json", type=output_file, default=None,
                    help="also write the table's rows as JSON here")
    return ap


def main() -> None:
    a = build_parser().parse_args()
    shapes = _shapes()
    master, url = start_store_master()
    time.sleep(0.5)
    cfg = StoreConfig(url=url, segment_mb=1024, local_buffer_mb=64, max_pending_mb=512)
    writer = KVStore(cfg, "bench-" + os.urandom(4).hex()).start()
    reader = KVStore(cfg, writer.fingerprint).start()
    peer = None
    try:
        for s in (writer, reader):
            t_end = time.monotonic() + 30
            while not s.available and time.monotonic() < t_end:
                time.sleep(0.05)
            if not s.available:
                raise SystemExit(f"store client not connected ({s.state})")
        biggest = max(max(sn, 64 * bl) for sn, bl in shapes.values())
        peer = subprocess.Popen([sys.executable, "-c", _PEER, str(ROOT), str(biggest)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        port, dst = map(int, peer.stdout.readline().split())
        te = KVEngine()
        rows = []
        for name, (snap_b, block_b) in shapes.items():
            for kind, size, count in (("snapshot", snap_b, 1), ("64 MLA blocks", block_b, 64)):
                vals = [np.random.randint(0, 255, size, dtype=np.uint8) for _ in range(count)]
                src = np.concatenate(vals)
                te.register(src.ctypes.data, src.nbytes)
                put_s, get_s, te_s = [], [], []
                for r in range(a.reps):
                    keys = [f"{name}-{kind}-{r}-{i}" for i in range(count)]
                    t0 = time.perf_counter()
                    for k, v in zip(keys, vals):
                        (writer.put_snapshot if kind == "snapshot" else writer.put_block)(k, v)
                    writer.flush(120)
                    put_s.append(time.perf_counter() - t0)
                    t0 = time.perf_counter()
                    got = [(reader.get_snapshot if kind == "snapshot" else reader.get_block)(k)
                           for k in keys]
                    get_s.append(time.perf_counter() - t0)
                    if r == 0 and any(g is None or g != v.tobytes() for g, v in zip(got, vals)):
                        raise SystemExit(f"{name} {kind}: store returned different bytes")
                    t0 = time.perf_counter()
                    te.write(f"127.0.0.1:{port}", [(src.ctypes.data, dst, src.nbytes)])
                    te_s.append(time.perf_counter() - t0)
                te.unregister(src.ctypes.data)
                total = size * count
                rows.append({"preset": name, "payload": kind, "bytes": total,
                             "put_GBps": _gbps(total, put_s), "get_GBps": _gbps(total, get_s),
                             "raw_te_GBps": _gbps(total, te_s),
                             "put_ms": statistics.median(put_s) * 1e3,
                             "get_ms": statistics.median(get_s) * 1e3})
        print(f"{'preset':8} {'payload':14} {'MB':>8} {'put GB/s':>9} {'get GB/s':>9} "
              f"{'raw TE GB/s':>11}")
        for r in rows:
            print(f"{r['preset']:8} {r['payload']:14} {r['bytes'] / 1e6:8.2f} "
                  f"{r['put_GBps']:9.2f} {r['get_GBps']:9.2f} {r['raw_te_GBps']:11.2f}")
        print("store stats:")
        for name, client in (("writer", writer), ("reader", reader)):
            print(f"  {stats_line(name, client.stats)}")
        if a.json:
            Path(a.json).write_text(json.dumps({"rows": rows}, indent=1))
        te.close()
    finally:
        if peer is not None:
            peer.stdin.close()
            peer.wait(10)
        writer.close()
        reader.close()
        master.terminate()
        master.wait(10)


if __name__ == "__main__":
    main()
