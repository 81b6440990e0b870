"""kvstore — moves one request's cache from a prefill worker into a decode worker's memory.

The only package that imports ``mooncake`` (lazily, in :mod:`kvstore.engine`). What moves per
request: for every KDA layer the slot's fp32 recurrent state and its conv state, for every MLA
layer the latents of the prompt's tokens (``num_tokens × (kv_lora + rope) × dtype`` bytes),
then the metadata (prompt ids, token #1 + logprobs, sampling params, position) with a notify.

Request flow (DESIGN.md §1, §4)::

    decode D                                   prefill P
    ────────                                   ─────────
    engine = KVEngine(cfg.engine_config())     engine = KVEngine(cfg.engine_config())
    engine.register_layout(layout_D)           engine.register_layout(layout_P)
    server = KVBootstrapServer(engine,         client = BootstrapClient()
                 layout_D).start()
    rx = KVReceiver(server, CacheRef(slot,     (router hands P: rx.ticket, server.address)
             pages, n), on_release=free)
                                               tx = KVSender(ticket, addr, layout_P,
                                                       CacheRef(slot_P, pages_P, n),
                                                       engine=engine, client=client)
            ◀── POST /kv/pair (fingerprint) ── BOOTSTRAPPING
            ── session id, dst layout, slot/pages ─▶ WAITING_FOR_INPUT
                                               model(..., layer_hook=tx.layer_ready)
            ◀══ TE writes, layer by layer ════ TRANSFERRING (overlaps the next layer)
            ◀── notify "layer" per layer ───── (progress; receiver → TRANSFERRING)
                                               tx.finish(metadata)
            ◀── notify "done" + manifest ───── SUCCESS
    rx.poll() == SUCCESS: rx.result.metadata

Public API
    :class:`KVEngine` (``EngineConfig``): ``register / register_layout``, ``write`` (sync
    batch), ``submit`` → :class:`TransferHandle` (``poll`` / ``wait``), ``notify``,
    ``notifications``, ``session_id``. Errors: :class:`TransferError` (op, peer, code),
    :class:`MooncakeUnavailable`. One engine per process.

    :mod:`kvstore.descriptors` (pure): :class:`PoolLayout` (``from_kvpools(KVPools)`` or
    ``from_pools(kda_state, conv_state, mla_latent, kda_layers=, mla_layers=, model=)``;
    ``fingerprint()``), :class:`CacheRef` (slot, pages, num_tokens; ``CacheRef.of(handle)``
    takes a ``k3serve.protocol.CacheHandle``), :func:`plan_runs` / :func:`layer_runs` → merged
    :class:`Run` (src, dst, length, layer, region), :func:`expected_layer_bytes`.

    :class:`KVBootstrapServer` (decode; one per engine — it drains the engine's
    notifications): ``start() / stop()``, ``address``, ``register_ticket(ref, on_release=)``,
    ``pump()``. :class:`BootstrapClient` (prefill; one per process, shared by senders).

    :class:`KVSender`: ``layer_ready(layer, upto_tokens=None)`` (= the engine's
    ``layer_hook``), ``finish(metadata)``, ``poll() -> KVPoll``, ``abort()``, ``error``,
    ``bytes_sent``, ``num_runs``, ``attempts``, ``stats``; ``on_release`` runs once no write
    reads the source (prefill: ``LLMEngine.release``).
    :class:`KVReceiver`: ``poll() -> KVPoll``, ``result`` (:class:`TransferResult`:
    metadata, per-layer bytes, attempts), ``error``, ``layers_received``, ``abort()``,
    ``released``, ``close()``; ``on_release`` runs once a FAILED reservation can be reused
    (decode: ``abort_request`` the reservation there, not at FAILED — a paired sender may
    still be writing until then).
    States: :class:`KVPoll` FAILED, BOOTSTRAPPING, WAITING_FOR_INPUT, TRANSFERRING, SUCCESS.

    :class:`KVConfig` (``from_env``: ``K3SERVE_KV_PROTOCOL=tcp|rdma``, ``..._NOTIFY=te|http``,
    ``..._FAIL_FIRST_N`` test hook, timeouts, retries).

    ``python -m kvstore.loopback``: a stand-alone decode peer for tests and benchmarks.

Guarantees: a ticket succeeds only when the sender's per-layer byte manifest equals the bytes
the decode side expects for its reservation; a fingerprint mismatch (model, block size, dtypes,
state and latent shapes, layer ids) refuses the pairing on both sides and names every field
that differs; failed reservations are released only when no sender can still write into them;
every wait has a timeout.
"""

from __future__ import annotations

from kvstore.bootstrap import BootstrapClient, KVBootstrapServer
from kvstore.config import KVConfig
from kvstore.descriptors import (
    CacheRef,
    PoolLayout,
    RegionLayout,
    Run,
    expected_layer_bytes,
    layer_runs,
    plan_runs,
)
from kvstore.engine import EngineConfig, KVEngine, TransferHandle
from kvstore.errors import (
    BootstrapError,
    FingerprintMismatch,
    KVStoreError,
    MooncakeUnavailable,
    TransferError,
)
from kvstore.receiver import KVReceiver
from kvstore.sender import KVSender
from kvstore.states import KVPoll, TransferResult

__all__ = [
    "BootstrapClient",
    "BootstrapError",
    "CacheRef",
    "EngineConfig",
    "FingerprintMismatch",
    "KVBootstrapServer",
    "KVConfig",
    "KVEngine",
    "KVPoll",
    "KVReceiver",
    "KVSender",
    "KVStoreError",
    "MooncakeUnavailable",
    "PoolLayout",
    "RegionLayout",
    "Run",
    "TransferError",
    "TransferHandle",
    "TransferResult",
    "expected_layer_bytes",
    "layer_runs",
    "plan_runs",
]
