"""kvstore transfer benchmark: k3-tiny- and k3-mini-shaped payloads between two processes.

A decode peer (``python -m kvstore.loopback``) holds the destination pools; this process is the
prefill side. Per preset it measures, on the same pools and the same merged runs, interleaved
repetitions in one run:

* raw TE   — ``TransferEngine.batch_transfer_sync_write`` of the runs (sub-batches ≤ 32 MiB),
  addresses computed beforehand: the floor kvstore is compared to;
* in-stack — a ``KVSender`` driven like the prefill worker drives it: ``poll()`` once per
  simulated engine step (``--step-ms``), pairing first (the peer's TE connection already
  open), then every layer ready at once (``finish``). ``in-stack s`` = last write confirmed −
  last layer ready (the sender's ``t_written``), ``done s`` = until its completion message
  was delivered (``t_done``), ``pair s`` = pairing; ``stack/raw`` = raw time ÷ in-stack time;
* tight    — the same with the sender polled continuously (``--step-ms 0`` alone);
* the same two on a random (fragmented) page list;
* overlap — a simulated prefill: a sleep of ``layer_ms`` per layer, ``layer_ready(l)`` after
  each, ``poll()`` once per layer; ``exposed`` = last write confirmed − last layer ready.

The receiver confirms each transfer (its manifest check); the first repetition of each preset
also compares a SHA-256 of the request's bytes on both sides.

GPU pools (``--device cuda``, both processes' pools on the GPU): ``--staging host`` sends them
through the pinned host mirrors (:mod:`kvstore.staging`); ``--staging direct`` registers the GPU
pools with the TE. ``raw`` is TE on whatever is registered (host mirrors, or GPU memory).

Writes a JSON result (``--json``, default ``transfer.json``): the command, date, host and one
row per preset with every median above and the per-repetition times.

Usage: ``python benchmarks/transfer.py [--presets k3-tiny,k3-mini] [--tokens 1024] [--reps 5]
[--step-ms 20] [--device cpu|cuda] [--staging auto|host|direct] [--json PATH]``
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
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
from k3serve.messages import PairRequest, TransferMetadata
from k3serve.process import device_name, nonnegative_float, output_file, positive_int
from k3serve.sampling import SamplingParams
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


def _drive(tx: KVSender, step_s: float, timeout_s: float = 60.0, until=None) -> None:
    """Poll ``tx`` once per ``step_s`` (a worker polls once per engine step) until ``until()``
    (default: terminal)."""
    until = until or (lambda: tx.state.terminal)
    t_end = time.monotonic() + timeout_s
    while not until():
        if time.monotonic() > t_end:
            raise RuntimeError(f"sender stuck in {tx.state.name}: {tx.error}")
        time.sleep(step_s or 0.0002)
        tx.poll()


def _meta(ticket: str, n: int) -> TransferMetadata:
    return TransferMetadata(request_id=ticket, prompt_token_ids=list(range(n)), token_id=1,
                            sampling=SamplingParams(), position=n)


def _batches(runs: list, limit: int = 32 << 20) -> list[list]:
    out, cur, size = [], [], 0
    for r in runs:
        if cur and size + r.length > limit:
            out.append(cur)
            cur, size = [], 0
        cur.append(r)
        size += r.length
    return out + [cur]


def bench_preset(name: str, reps: int, tokens: int | None = None, step_ms: float = 20.0,
                 device: str = "cpu", staging: str = "auto") -> dict:
    cfg = PRESETS[name]
    n = tokens or TOKENS[name]
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
    step_s = step_ms / 1e3
    try:
        # destination layout, as a sender learns it (pairing a throwaway ticket)
        t0 = peer.cmd(op="register", **dst_contig)["ticket"]
        resp = client.pair(
            peer.info["bootstrap"],
            PairRequest(ticket=t0, sender="bench", fingerprint=layout.fingerprint()),
            layout.fingerprint(),
        )
        dst_layout, sid = PoolLayout.from_msg(resp.layout), resp.session_id
        peer.cmd(op="abort", ticket=t0)

        def run_list(src: CacheRef, dst: dict) -> list:
            plan = plan_runs(layout, src, dst_layout, _ref(dst))
            return [r for l in sorted(plan) for r in plan[l]]

        runs, frag = run_list(src_contig, dst_contig), run_list(src_frag, dst_frag)
        payload = sum(r.length for r in runs)
        formula = cfg.kda_state_bytes_per_seq() + n * cfg.mla_latent_bytes_per_token()
        assert payload == formula == sum(r.length for r in frag), (payload, formula)

        def raw_once(rl: list) -> float:
            te = eng.raw
            t = time.perf_counter()
            for b in _batches(rl):
                rc = te.batch_transfer_sync_write(
                    sid, [r.src for r in b], [r.dst for r in b], [r.length for r in b])
                if rc != 0:
                    raise RuntimeError(f"raw write failed ({rc})")
            return time.perf_counter() - t

        def stack_once(src: CacheRef, dst: dict, step: float, verify: bool = False) -> dict:
            ticket = peer.cmd(op="register", **dst)["ticket"]
            tx = KVSender(ticket, peer.info["bootstrap"], layout, src, engine=eng, client=client)
            _drive(tx, step, until=lambda: tx.state != KVPoll.BOOTSTRAPPING)
            t_ready = time.monotonic()
            tx.finish(_meta(ticket, n))  # every layer ready at once
            _drive(tx, step)
            if tx.state != KVPoll.SUCCESS:
                raise RuntimeError(f"transfer failed: {tx.error}")
            t0_abs = time.monotonic() - tx.elapsed_s
            out = peer.cmd(op="wait", ticket=ticket, verify=verify)
            if out["state"] != "SUCCESS":
                raise RuntimeError(f"receiver: {out}")
            if verify and out["digest"] != request_digest(pools, src):
                raise RuntimeError("bytes differ at the destination")
            return {"pair": tx.stats["t_paired"],
                    "written": t0_abs + tx.stats["t_written"] - t_ready,
                    "done": t0_abs + tx.stats["t_done"] - t_ready,
                    "stage_in": float(out.get("stage_in_s", 0.0))}

        def overlap_once(layer_ms: float) -> dict:
            ticket = peer.cmd(op="register", **dst_contig)["ticket"]
            tx = KVSender(ticket, peer.info["bootstrap"], layout, src_contig, engine=eng,
                          client=client)
            _drive(tx, step_s, until=lambda: tx.state != KVPoll.BOOTSTRAPPING)
            t = time.monotonic()
            for l in range(cfg.num_layers):
                time.sleep(layer_ms / 1e3)  # the "prefill" of layer l
                if l in tx.layout.layers:
                    tx.layer_ready(l)
                tx.poll()
            t_last = time.monotonic()
            tx.finish(_meta(ticket, n))
            _drive(tx, step_s)
            if tx.state != KVPoll.SUCCESS or peer.cmd(op="wait", ticket=ticket)["state"] != (
                    "SUCCESS"):
                raise RuntimeError(f"overlap transfer failed: {tx.error}")
            t0_abs = time.monotonic() - tx.elapsed_s
            return {"compute": t_last - t, "exposed": t0_abs + tx.stats["t_written"] - t_last}

        raw_once(runs)  # warm the connection
        stack_once(src_contig, dst_contig, step_s, verify=True)
        stack_once(src_frag, dst_frag, step_s, verify=True)
        # interleaved, so that load from other processes hits every path alike
        m: dict[str, list[float]] = {k: [] for k in (
            "raw", "stack", "done", "pair", "tight", "stage_in", "raw_f", "stack_f")}
        for _ in range(reps):
            m["raw"].append(raw_once(runs))
            x = stack_once(src_contig, dst_contig, step_s)
            m["stack"].append(x["written"])
            m["done"].append(x["done"])
            m["pair"].append(x["pair"])
            m["stage_in"].append(x["stage_in"])
            m["tight"].append(stack_once(src_contig, dst_contig, 0.0)["written"])
            m["raw_f"].append(raw_once(frag))
            m["stack_f"].append(stack_once(src_frag, dst_frag, step_s)["written"])
        med = {k: statistics.median(v) for k, v in m.items()}
        ratio = lambda a, b: statistics.median(x / y for x, y in zip(m[a], m[b]))
        layer_ms = med["raw"] * 1e3 / cfg.num_layers  # compute ≈ transfer: the most to hide
        ov = [overlap_once(layer_ms) for _ in range(reps)]
        return {
            "preset": name, "device": device,
            "staging": "host" if eng.staging is not None else "direct",
            "tokens": n, "payload": payload, "runs": len(runs), "frag_runs": len(frag),
            "step_ms": step_ms, **med,
            "ratio": ratio("raw", "stack"), "ratio_tight": ratio("raw", "tight"),
            "ratio_f": ratio("raw_f", "stack_f"),
            "layers": cfg.num_layers, "layer_ms": layer_ms,
            "compute": statistics.median(x["compute"] for x in ov),
            "exposed": statistics.median(x["exposed"] for x in ov),
            "reps": m,
        }
    finally:
        client.close()
        peer.close()
        eng.close()


def build_parser() -> argparse.ArgumentParser:
    """The flags of ``python benchmarks/transfer.py``."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default="k3-tiny,k3-mini",
                    help="comma-separated model presets whose payloads are sent "
                         "(default: k3-tiny,k3-mini)")
    ap.add_argument("--tokens", type=positive_int, default=None,
                    help="prompt tokens (default: 1024 for k3-tiny, 4096 for k3-mini)")
    ap.add_argument("--reps", type=positive_int, default=5,
                    help="interleaved repetitions per preset; the table shows their median "
                         "(default: 5)")
    ap.add_argument("--step-ms", type=nonnegative_float, default=20.0,
                    help="simulated engine step: the sender is polled once per step (ms)")
    ap.add_argument("--device", type=device_name, default="cpu",
                    help="where both sides' pools live (cpu, cuda)")
    ap.add_argument("--staging", default="auto", choices=("auto", "host", "direct"),
                    help="GPU pools: sent through pinned host mirrors (host) or registered "
                         "with the TE as they are (direct); auto: host for CUDA pools, CPU "
                         "pools as they are (default: auto)")
    ap.add_argument("--json", type=output_file, default="transfer.json",
                    help="write the result here")
    return ap


def main() -> None:
    ap = build_parser()
    args = ap.parse_args()
    unknown = [p for p in args.presets.split(",") if p not in PRESETS]
    if unknown:
        ap.error(f"--presets: {','.join(unknown)} not among {','.join(PRESETS)}")
    rows = [bench_preset(p, args.reps, args.tokens, args.step_ms, args.device, args.staging)
            for p in args.presets.split(",")]
    result = {"command": " ".join([os.path.basename(sys.executable), *sys.argv]),
              "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
              "host": platform.node(), "cpus": os.cpu_count(), "rows": rows}
    Path(args.json).write_text(json.dumps(result, indent=1))
    gbs = lambda r, k: r["payload"] / r[k] / 1e9
    print(f"\nthroughput (payload bytes / time, median of {args.reps} interleaved repetitions; "
          f"in-stack: polled every {args.step_ms:g} ms, last layer ready -> last write "
          "confirmed; ratios = median of raw time / in-stack time)")
    print(f"{'preset':8} {'tokens':>6} {'MB':>6} {'runs':>5} | {'raw GB/s':>8} "
          f"{'stack GB/s':>10} {'stack/raw':>9} {'done ms':>7} {'pair ms':>7} "
          f"{'tight/raw':>9} | {'frag runs':>9} {'raw GB/s':>8} {'stack GB/s':>10} "
          f"{'stack/raw':>9}")
    for r in rows:
        print(f"{r['preset']:8} {r['tokens']:>6} {r['payload'] / 1e6:>6.2f} {r['runs']:>5} | "
              f"{gbs(r, 'raw'):>8.2f} {gbs(r, 'stack'):>10.2f} {r['ratio']:>9.2f} "
              f"{r['done'] * 1e3:>7.1f} {r['pair'] * 1e3:>7.1f} {r['ratio_tight']:>9.2f} | "
              f"{r['frag_runs']:>9} {gbs(r, 'raw_f'):>8.2f} {gbs(r, 'stack_f'):>10.2f} "
              f"{r['ratio_f']:>9.2f}")
    print("\noverlap with a simulated prefill (sleep `layer ms` per layer, then layer_ready)")
    print(f"{'preset':8} {'layers':>6} {'layer ms':>8} {'compute ms':>10} {'exposed ms':>10}")
    for r in rows:
        print(f"{r['preset']:8} {r['layers']:>6} {r['layer_ms']:>8.2f} "
              f"{r['compute'] * 1e3:>10.1f} {r['exposed'] * 1e3:>10.1f}")
    print(f"\nexposed = last layer ready -> last write confirmed; JSON: {args.json}")


if __name__ == "__main__":
    main()
