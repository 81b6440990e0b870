"""A stand-alone decode-side peer for loopback tests and benchmarks (not used in serving).

Run ``python -m kvstore.loopback --model k3-tiny --slots 4 --pages 64 --block-size 16``: it
allocates the pools of docs/INTERFACES.md §1 (random contents; ``--device cuda`` puts them on
the GPU, ``--staging host|direct|auto`` as ``K3SERVE_KV_STAGING``), registers them with a
:class:`KVEngine`, starts a :class:`KVBootstrapServer`, prints one JSON line
``{"ready": true, "bootstrap": "host:port", "session": "host:rpc_port", "pid": N}`` and then
answers JSON commands, one per line on stdin, one JSON line each on stdout:

    {"op": "register", "slot", "pages", "num_tokens", "timeout_s"}  → {"ticket"}
    {"op": "wait", "ticket", "timeout_s", "verify"}   → state, error, result, digest,
        unchanged_elsewhere (verify: nothing outside the reservation changed), released
    {"op": "abort", "ticket"}                         → {"ok"}
    {"op": "stats"}                                   → open / unreleased tickets, releases
    {"op": "exit"}

Helpers shared with the tests and benchmarks: :func:`make_pools`, :func:`pool_layout`,
:func:`fill_pools`, :func:`request_digest`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
import types
from typing import Any

import torch

from k3serve.config import PRESETS, ModelConfig
from kvstore.bootstrap import KVBootstrapServer
from kvstore.descriptors import CacheRef, PoolLayout
from kvstore.engine import EngineConfig, KVEngine
from kvstore.receiver import KVReceiver
from kvstore.states import KVPoll

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def make_pools(
    cfg: ModelConfig,
    slots: int,
    pages: int,
    block_size: int,
    cache_dtype: str | None = None,
    device: str = "cpu",
) -> dict[str, torch.Tensor]:
    """Zeroed pools: ``kda_state [L_kda, S, H, K, V]`` fp32, ``conv_state [L_kda, S, W-1, 3HK]``
    and ``mla_latent [L_mla, P, B, D]`` in ``cache_dtype`` (default: the model dtype), on
    ``device``."""
    dt = _DTYPES[cache_dtype or cfg.dtype]
    h, k = cfg.kda_num_heads, cfg.kda_head_dim
    kw = {"device": device}
    return {
        "kda_state": torch.zeros(cfg.num_kda_layers, slots, h, k, k, dtype=torch.float32, **kw),
        "conv_state": torch.zeros(
            cfg.num_kda_layers, slots, cfg.kda_conv_kernel - 1, cfg.kda_conv_dim, dtype=dt, **kw
        ),
        "mla_latent": torch.zeros(
            cfg.num_mla_layers, pages, block_size, cfg.mla_latent_dim, dtype=dt, **kw
        ),
    }


def register_pools(
    engine: KVEngine, cfg: ModelConfig, pools: dict[str, torch.Tensor], staging: str = "auto"
) -> PoolLayout:
    """Register ``pools`` with ``engine`` as a worker does (:meth:`KVEngine.register_pools`:
    CUDA pools through a host mirror unless ``staging='direct'``); returns the layout to
    advertise / send from."""
    ns = types.SimpleNamespace(cfg=cfg, **pools)
    return engine.register_pools(ns, extra=cfg.fingerprint_fields(), staging=staging)


def pool_layout(cfg: ModelConfig, pools: dict[str, torch.Tensor]) -> PoolLayout:
    return PoolLayout.from_pools(
        pools["kda_state"],
        pools["conv_state"],
        pools["mla_latent"],
        kda_layers=cfg.kda_layers,
        mla_layers=cfg.mla_layers,
        model=cfg.name,
        extra=cfg.fingerprint_fields(),
    )


def fill_pools(pools: dict[str, torch.Tensor], seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for t in pools.values():
        t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))  # CPU draw: same on any device


def _request_views(pools: dict[str, torch.Tensor], ref: CacheRef) -> list[torch.Tensor]:
    lat = pools["mla_latent"]
    n_pages = -(-ref.num_tokens // lat.shape[2])
    tok = lat[:, list(ref.pages[:n_pages])].reshape(lat.shape[0], -1, lat.shape[3])[
        :, : ref.num_tokens
    ]
    return [pools["kda_state"][:, ref.slot], pools["conv_state"][:, ref.slot], tok]


def request_digest(pools: dict[str, torch.Tensor], ref: CacheRef) -> str:
    """SHA-256 of one request's cache bytes in a canonical order (KDA states, conv states,
    latents of tokens ``[0, num_tokens)``): equal on both sides iff the transfer is exact."""
    h = hashlib.sha256()
    for v in _request_views(pools, ref):
        h.update(v.contiguous().view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()


def _changed_outside(
    pools: dict[str, torch.Tensor], snap: dict[str, torch.Tensor], ref: CacheRef
) -> list[str]:
    """Names of pools that differ from ``snap`` outside ``ref``'s slot and token range."""
    out = []
    for name, t in pools.items():
        a, b = t.view(torch.uint8).clone(), snap[name].view(torch.uint8).clone()
        if name == "mla_latent":
            bsz = t.shape[2]
            for i, p in enumerate(ref.pages):
                lo, hi = i * bsz, min((i + 1) * bsz, ref.num_tokens)
                if hi > lo:
                    a[:, p, : hi - lo] = 0
                    b[:, p, : hi - lo] = 0
        else:
            a[:, ref.slot] = 0
            b[:, ref.slot] = 0
        if not torch.equal(a, b):
            out.append(name)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="k3-tiny", choices=sorted(PRESETS))
    ap.add_argument("--slots", type=int, default=4)
    ap.add_argument("--pages", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--cache-dtype", default=None)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--device", default="cpu", help="where the pools live (cpu, cuda)")
    ap.add_argument("--staging", default="auto", choices=("auto", "host", "direct"))
    ap.add_argument("--release-grace-s", type=float, default=0.5)
    ap.add_argument(
        "--no-fill", action="store_true", help="leave pools zeroed (faster for benchmarks)"
    )
    args = ap.parse_args(argv)

    cfg = PRESETS[args.model]
    pools = make_pools(
        cfg, args.slots, args.pages, args.block_size, args.cache_dtype, device=args.device
    )
    if not args.no_fill:
        fill_pools(pools, args.seed)
    snap = {k: v.clone() for k, v in pools.items()}
    engine = KVEngine(EngineConfig())
    layout = register_pools(engine, cfg, pools, args.staging)
    server = KVBootstrapServer(engine, layout, release_grace_s=args.release_grace_s).start()
    stage_in_s: list[float] = []  # seconds of each mirror → device copy (host staging)
    if server.on_landed is not None:
        landed = server.on_landed

        def timed(ref: CacheRef) -> None:
            t = time.perf_counter()
            landed(ref)
            stage_in_s.append(time.perf_counter() - t)

        server.on_landed = timed
    rx: dict[str, KVReceiver] = {}
    releases: dict[str, int] = {}

    def reply(d: dict[str, Any]) -> None:
        sys.stdout.write(json.dumps(d) + "\n")
        sys.stdout.flush()

    reply(
        {
            "ready": True,
            "bootstrap": server.address,
            "session": engine.session_id,
            "pid": os.getpid(),
        }
    )
    for line in sys.stdin:
        if not line.strip():
            continue
        cmd = json.loads(line)
        op = cmd.get("op")
        try:
            if op == "register":
                ref = CacheRef(int(cmd["slot"]), tuple(cmd["pages"]), int(cmd["num_tokens"]))
                key: dict[str, str] = {}

                def on_release(key: dict[str, str] = key) -> None:
                    releases[key["t"]] = releases.get(key["t"], 0) + 1

                r = KVReceiver(
                    server, ref, timeout_s=float(cmd.get("timeout_s", 30.0)), on_release=on_release
                )
                key["t"] = r.ticket
                rx[r.ticket] = r
                reply({"ticket": r.ticket})
            elif op == "wait":
                r = rx[cmd["ticket"]]
                t_end = time.monotonic() + float(cmd.get("timeout_s", 30.0))
                while not r.poll().terminal and time.monotonic() < t_end:
                    time.sleep(0.0005)
                if r.state == KVPoll.FAILED:  # give a pending release its chance
                    while not r.released and time.monotonic() < t_end:
                        r.poll()
                        time.sleep(0.01)
                out: dict[str, Any] = {
                    "state": r.state.name,
                    "error": r.error,
                    "released": r.released,
                    "releases": releases.get(r.ticket, 0),
                    "layers": r.layers_received,
                    "staging": engine.staging is not None,
                    "stage_in_s": stage_in_s[-1] if stage_in_s else 0.0,
                }
                if r.state == KVPoll.SUCCESS and r.result is not None:
                    res = r.result
                    out["result"] = {
                        "metadata": res.metadata.model_dump(mode="json"),
                        "layer_bytes": res.layer_bytes,
                        "total_bytes": res.total_bytes,
                        "num_runs": res.num_runs,
                        "attempts": res.attempts,
                        "seconds": res.seconds,
                        "sender_seconds": res.sender_seconds,
                    }
                    if cmd.get("verify", True):
                        out["digest"] = request_digest(pools, r.ref)
                        out["changed_elsewhere"] = _changed_outside(pools, snap, r.ref)
                        snap = {k: v.clone() for k, v in pools.items()}  # next check's baseline
                reply(out)
            elif op == "abort":
                rx[cmd["ticket"]].abort(cmd.get("reason", "aborted by test"))
                reply({"ok": True})
            elif op == "stats":
                server.pump()
                reply(
                    {
                        "open": server.open_tickets(),
                        "unreleased": server.unreleased(),
                        "releases": sum(releases.values()),
                    }
                )
            elif op == "exit":
                reply({"ok": True})
                break
            else:
                reply({"error": f"unknown op {op!r}"})
        except Exception as e:  # noqa: BLE001 - report to the driver, keep serving
            reply({"error": repr(e)})
    server.stop()


if __name__ == "__main__":
    main()
