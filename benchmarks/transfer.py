"""kvstore transfer benchmark: k3-tiny- and k3-mini-shaped payloads between two processes.

A decode peer (``python -m kvstore.loopback``) holds the destination pools; this process is the
prefill side. Per preset it measures, on the same pools and the same merged runs:

* raw TE   — ``TransferEngine.batch_transfer_sync_write`` of the runs (sub-batches ≤ 32 MiB),
  addresses computed beforehand: the floor kvstore is compared to;
* kvstore  — ``KVSender`` from construction (HTTP pairing with fingerprint check included) to
  SUCCESS (all writes confirmed + completion notify sent), every layer ready at once;
  ``excl. pairing`` starts the clock at pairing done;
* descriptors per request with contiguous pages and with a random (fragmented) page list;
* overlap — a simulated prefill: a sleep of ``layer_ms`` per layer, ``layer_ready(l)`` after
  each; ``hidden`` = share of the kvstore transfer time that disappeared behind the compute:
  (compute + transfer − measured) / transfer.

The receiver confirms each transfer (its manifest check); the first repetition of each preset
also compares a SHA-256 of the request's bytes on both sides.

GPU pools (``--device cuda``, both processes' pools on the GPU): ``--staging host`` sends them
through the pinned host mirrors (:mod:`kvstore.staging`: device → host copy per layer at the
sender, TE host → host, host → device at the receiver before SUCCESS — ``stage-in ms`` is that
last copy, timed in the peer, and ``kv+in GB/s`` counts it); ``--staging direct`` registers the
GPU pools with the TE (Mooncake's tcp transport then moves CUDA memory itself). ``raw`` is TE on
whatever is registered (host mirrors, or GPU memory). ``--json PATH`` writes the rows.

Usage: ``python benchmarks/transfer.py [--presets k3-tiny,k3-mini] [--reps 5]
[--device cpu|cuda] [--staging auto|host|direct] [--json PATH]``
"""

from __future__ import annotations

import argparse
import json
import os
import random
import select
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from k3serve.config import PRESETS
from k3serve.messages import PairRequest, SamplingSpec, TransferMetadata
from kvstore import BootstrapClient, CacheRef, KVEngine, KVPoll, KVSender, PoolLayout
from kvstore.descriptors import plan_runs
from kvstore.loopback import fill_pools, make_pools, register_pools, request_digest

BLOCK = 64
TOKENS = {"k3-tiny": 1024, "k3-mini": 4096}


def _pythonpath() -> str:
    """The repository first, then what the caller had (the device carries mooncake there)."""
    return os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])


class Peer:
    def __init__(
        self, model: str, slots: int, pages: int, device: str = "cpu", staging: str = "auto"
    ) -> None:
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvstore.loopback",
                "--model",
                model,
                "--slots",
                str(slots),
                "--pages",
                str(pages),
                "--block-size",
                str(BLOCK),
                "--no-fill",
                "--device",
                device,
                "--staging",
                staging,
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": _pythonpath()},
        )
        self.info = self._read(120)

    def _read(self, timeout_s: float) -> dict:
        r, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        line = self.proc.stdout.readline() if r else ""
        if not line:
            raise RuntimeError(f"decode peer did not answer (exit {self.proc.poll()})")
        return json.loads(line)

    def cmd(self, **kw) -> dict:
        self.proc.stdin.write(json.dumps(kw) + "\n")
        self.proc.stdin.flush()
        return self._read(float(kw.get("timeout_s", 10)) + 30)

    def close(self) -> None:
        try:
            self.cmd(op="exit")
            self.proc.wait(timeout=10)
        except Exception:  # noqa: BLE001
            self.proc.kill()
            self.proc.wait()


def _ref(d: dict) -> CacheRef:
    """A loopback ``register`` command's reservation as a CacheRef."""
    return CacheRef(d["slot"], tuple(d["pages"]), d["num_tokens"])


def _drive(tx: KVSender, timeout_s: float = 60.0) -> None:
    t_end = time.monotonic() + timeout_s
    while not tx.poll().terminal:
        if time.monotonic() > t_end:
            raise RuntimeError("sender did not finish")
        time.sleep(0.0002)
    if tx.state != KVPoll.SUCCESS:
        raise RuntimeError(f"transfer failed: {tx.error}")


def bench_preset(name: str, reps: int, device: str = "cpu", staging: str = "auto") -> dict:
    cfg = PRESETS[name]
    n = TOKENS[name]
    k = -(-n // BLOCK)
    pages = 2 * k + 4
    peer = Peer(name, 2, pages, device, staging)
    eng = KVEngine()
    client = BootstrapClient()
    pools = make_pools(cfg, 2, pages, BLOCK, device=device)
    fill_pools(pools, 0)
    layout = register_pools(eng, cfg, pools, staging)  # the mirror's layout when staged
    rng = random.Random(0)
    src_contig = CacheRef(0, tuple(range(k)), n)
    dst_contig = {"slot": 1, "pages": list(range(k + 2, 2 * k + 2)), "num_tokens": n}
    src_frag = CacheRef(1, tuple(rng.sample(range(pages), k)), n)
    dst_frag = {"slot": 0, "pages": rng.sample(range(pages), k), "num_tokens": n}
    try:
        # destination layout, as a sender learns it (pairing a throwaway ticket)
        t0 = peer.cmd(op="register", **dst_contig)["ticket"]
        resp = client.pair(
            peer.info["bootstrap"],
            PairRequest(ticket=t0, sender="bench", fingerprint=layout.fingerprint()),
            layout.fingerprint(),
        )
        dst_layout, sid = PoolLayout.from_msg(resp.layout), resp.session_id
        plan = plan_runs(layout, src_contig, dst_layout, CacheRef.from_msg(resp.dst))
        runs = [r for l in sorted(plan) for r in plan[l]]
        payload = sum(r.length for r in runs)
        formula = cfg.kda_state_bytes_per_seq() + n * cfg.mla_latent_bytes_per_token()
        assert payload == formula, (payload, formula)
        frag_runs = sum(map(len, plan_runs(layout, src_frag, dst_layout, _ref(dst_frag)).values()))
        peer.cmd(op="abort", ticket=t0)

        def raw_once(src: CacheRef, dst: dict) -> float:
            te = eng.raw
            rplan = plan_runs(layout, src, dst_layout, _ref(dst))
            runs = [r for l in sorted(rplan) for r in rplan[l]]
            batches, cur, size = [], [], 0
            for r in runs:
                if cur and size + r.length > (32 << 20):
                    batches.append(cur)
                    cur, size = [], 0
                cur.append(r)
                size += r.length
            batches.append(cur)
            t = time.perf_counter()
            for b in batches:
                rc = te.batch_transfer_sync_write(
                    sid, [r.src for r in b], [r.dst for r in b], [r.length for r in b]
                )
                if rc != 0:
                    raise RuntimeError(f"raw write failed ({rc})")
            return time.perf_counter() - t

        def kv_once(src: CacheRef, dst: dict, layer_ms: float = 0.0, verify: bool = False) -> dict:
            ticket = peer.cmd(op="register", **dst)["ticket"]
            t = time.perf_counter()
            tx = KVSender(ticket, peer.info["bootstrap"], layout, src, engine=eng, client=client)
            if layer_ms:
                for l in range(cfg.num_layers):
                    time.sleep(layer_ms / 1e3)  # the "prefill" of layer l
                    if l in tx.layout.layers:
                        tx.layer_ready(l)
                    tx.poll()
            compute = time.perf_counter() - t
            tx.finish(
                TransferMetadata(
                    request_id=ticket,
                    prompt_token_ids=list(range(n)),
                    token_id=1,
                    sampling=SamplingSpec(),
                    position=n,
                )
            )
            _drive(tx)
            total = time.perf_counter() - t
            out = peer.cmd(op="wait", ticket=ticket, verify=verify)
            if out["state"] != "SUCCESS":
                raise RuntimeError(f"receiver: {out}")
            if verify and out["digest"] != request_digest(pools, src):
                raise RuntimeError("bytes differ at the destination")
            return {"total": total, "after_pair": total - tx.stats["t_paired"], "compute": compute,
                    "stage_in": float(out.get("stage_in_s", 0.0))}  # fmt: skip

        raw_once(src_contig, dst_contig)  # warm the connection
        kv_once(src_contig, dst_contig, verify=True)
        kv_once(src_frag, dst_frag, verify=True)
        # interleaved, so that load from other processes hits both paths alike
        keys = ("raw", "kv", "kv_ap", "kv_in", "stage_in", "raw_f", "kv_f")
        m: dict[str, list[float]] = {k: [] for k in keys}
        for _ in range(reps):
            m["raw"].append(raw_once(src_contig, dst_contig))
            x = kv_once(src_contig, dst_contig)
            m["kv"].append(x["total"])
            m["kv_ap"].append(x["after_pair"])
            m["kv_in"].append(x["total"] + x["stage_in"])
            m["stage_in"].append(x["stage_in"])
            m["raw_f"].append(raw_once(src_frag, dst_frag))
            m["kv_f"].append(kv_once(src_frag, dst_frag)["total"])
        med = {k: statistics.median(v) for k, v in m.items()}
        ratio = statistics.median(a / b for a, b in zip(m["raw"], m["kv"]))
        ratio_f = statistics.median(a / b for a, b in zip(m["raw_f"], m["kv_f"]))
        layer_ms = med["kv"] * 1e3 / cfg.num_layers  # compute ≈ transfer: the most overlap can hide
        ov = [kv_once(src_contig, dst_contig, layer_ms) for _ in range(reps)]
        exposed = statistics.median(x["total"] - x["compute"] for x in ov)
        return {
            "preset": name,
            "device": device,
            "staging": "host" if eng.staging is not None else "direct",
            "tokens": n,
            "payload": payload,
            "runs": len(runs),
            "frag_runs": frag_runs,
            **med,
            "ratio": ratio,
            "ratio_f": ratio_f,
            "layers": cfg.num_layers,
            "layer_ms": layer_ms,
            "compute": statistics.median(x["compute"] for x in ov),
            "exposed": exposed,
            "hidden": 1 - exposed / med["kv"],
        }
    finally:
        client.close()
        peer.close()
        eng.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default="k3-tiny,k3-mini")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--device", default="cpu", help="where both sides' pools live (cpu, cuda)")
    ap.add_argument("--staging", default="auto", choices=("auto", "host", "direct"))
    ap.add_argument("--json", default=None, help="write the rows here")
    args = ap.parse_args()
    rows = [bench_preset(p, args.reps, args.device, args.staging) for p in args.presets.split(",")]
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    gbs = lambda r, k: r["payload"] / r[k] / 1e9
    print(
        "\nthroughput (payload bytes / time, median of interleaved repetitions; ratio = median of "
        "raw time / kvstore time)"
    )
    print(
        f"{'preset':8} {'pools':>5} {'staging':>7} {'tokens':>6} {'payload MB':>10} | {'runs':>5} "
        f"{'raw GB/s':>8} {'kv GB/s':>7} {'kv/raw':>6} {'kv excl.pair':>12} {'stage-in ms':>11} "
        f"{'kv+in GB/s':>10} | {'frag runs':>9} {'raw GB/s':>8} {'kv GB/s':>7} {'kv/raw':>6}"
    )
    for r in rows:
        print(
            f"{r['preset']:8} {r['device']:>5} {r['staging']:>7} {r['tokens']:>6} "
            f"{r['payload'] / 1e6:>10.2f} | {r['runs']:>5} "
            f"{gbs(r, 'raw'):>8.2f} {gbs(r, 'kv'):>7.2f} {r['ratio']:>6.2f} {gbs(r, 'kv_ap'):>12.2f} "
            f"{r['stage_in'] * 1e3:>11.2f} {gbs(r, 'kv_in'):>10.2f} | "
            f"{r['frag_runs']:>9} {gbs(r, 'raw_f'):>8.2f} {gbs(r, 'kv_f'):>7.2f} {r['ratio_f']:>6.2f}"
        )
    print("\noverlap with a simulated prefill (sleep `layer ms` per layer, then layer_ready)")
    print(
        f"{'preset':8} {'layers':>6} {'layer ms':>8} {'compute ms':>10} {'transfer ms':>11} "
        f"{'exposed ms':>10} {'hidden %':>8}"
    )
    for r in rows:
        print(
            f"{r['preset']:8} {r['layers']:>6} {r['layer_ms']:>8.2f} {r['compute'] * 1e3:>10.1f} "
            f"{r['kv'] * 1e3:>11.1f} {r['exposed'] * 1e3:>10.1f} {100 * r['hidden']:>8.0f}"
        )
    print(
        "\ntransfer = kvstore alone (pairing included); exposed = from the end of the last layer to "
        "SUCCESS; hidden = 1 - exposed / transfer"
    )


if __name__ == "__main__":
    main()
