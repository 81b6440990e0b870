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


class LoopbackPeer:
    """The decode-side peer behind :func:`main`: pools registered with a :class:`KVEngine`, a
    :class:`KVBootstrapServer`, and one :class:`KVReceiver` per ``register`` command.

    Args:
        cfg: the model config (pool shapes). pools: from :func:`make_pools`.
        staging: ``K3SERVE_KV_STAGING`` mode. release_grace_s: the server's release grace (s).
    """

    def __init__(self, cfg: ModelConfig, pools: dict[str, torch.Tensor], staging: str,
                 release_grace_s: float) -> None:
        self.pools = pools
        self.snap = {k: v.clone() for k, v in pools.items()}  # baseline of the next check
        self.engine = KVEngine(EngineConfig())
        layout = register_pools(self.engine, cfg, pools, staging)
        self.server = KVBootstrapServer(self.engine, layout, release_grace_s=release_grace_s)
        self.server.start()
        self.stage_in_s: list[float] = []  # seconds of each mirror → device copy (host staging)
        if self.server.on_landed is not None:
            landed = self.server.on_landed

            def timed(ref: CacheRef) -> None:
                t = time.perf_counter()
                landed(ref)
                self.stage_in_s.append(time.perf_counter() - t)

            self.server.on_landed = timed
        self.rx: dict[str, KVReceiver] = {}
        self.releases: dict[str, int] = {}

    def ready(self) -> dict[str, Any]:
        return {"ready": True, "bootstrap": self.server.address,
                "session": self.engine.session_id, "pid": os.getpid()}

    def handle(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """One command's reply (module docstring); unknown ops answer ``{"error"}``."""
        op = cmd.get("op")
        if op == "register":
            return self.register(cmd)
        if op == "wait":
            return self.wait(cmd)
        if op == "abort":
            self.rx[cmd["ticket"]].abort(cmd.get("reason", "aborted by test"))
            return {"ok": True}
        if op == "stats":
            self.server.pump()
            return {"open": self.server.open_tickets(), "unreleased": self.server.unreleased(),
                    "releases": sum(self.releases.values())}
        if op == "exit":
            return {"ok": True}
        return {"error": f"unknown op {op!r}"}

    def register(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """A receiver for ``slot`` / ``pages`` / ``num_tokens``; its ticket."""
        ref = CacheRef(int(cmd["slot"]), tuple(cmd["pages"]), int(cmd["num_tokens"]))
        key: dict[str, str] = {}

        def on_release(key: dict[str, str] = key) -> None:
            self.releases[key["t"]] = self.releases.get(key["t"], 0) + 1

        r = KVReceiver(
            self.server, ref, timeout_s=float(cmd.get("timeout_s", 30.0)), on_release=on_release
        )
        key["t"] = r.ticket
        self.rx[r.ticket] = r
        return {"ticket": r.ticket}

    def wait(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """Poll a ticket to its end (or ``timeout_s``); its state, result and, with
        ``verify``, the digest and the pools changed outside the reservation."""
        r = self.rx[cmd["ticket"]]
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
            "releases": self.releases.get(r.ticket, 0),
            "layers": r.layers_received,
            "staging": self.engine.staging is not None,
            "stage_in_s": self.stage_in_s[-1] if self.stage_in_s else 0.0,
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
                out["digest"] = request_digest(self.pools, r.ref)
                out["changed_elsewhere"] = _changed_outside(self.pools, self.snap, r.ref)
                self.snap = {k: v.clone() for k, v in self.pools.items()}
        return out


def _reply(d: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(d) + "\n")
    sys.stdout.flush()


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
    peer = LoopbackPeer(cfg, pools, args.staging, args.release_grace_s)
    _reply(peer.ready())
    for line in sys.stdin:
        if not line.strip():
            continue
        cmd = json.loads(line)
        try:
            _reply(peer.handle(cmd))
        except Exception as e:  # noqa: BLE001 - report to the driver, keep serving
            _reply({"error": repr(e)})
            continue
        if cmd.get("op") == "exit":
            break
    peer.server.stop()


if __name__ == "__main__":
    main()
