"""kvstore — moves one request's cache from a prefill worker into a decode worker's memory.

Where it sits in the request lifecycle: step 7 ("transfer") of :mod:`k3serve.protocol`; the
messages it exchanges are the kvstore models of :mod:`k3serve.messages` (``PairRequest`` →
``PairResponse`` | ``PairError``, ``StatusMessage`` (HTTP or TE notification) → ``StatusAck``,
``KVHealth``; ``TransferMetadata`` travels inside the ``done`` status).

What is specific to kvstore: each side is a non-blocking ``poll() -> KVPoll`` state machine
(:class:`KVPoll`, SGLang's contract) — :class:`KVSender` (prefill: BOOTSTRAPPING → pair →
WAITING_FOR_INPUT → writes layer by layer, overlapping compute → TRANSFERRING → ``done`` →
SUCCESS | FAILED; diagram in :mod:`kvstore.sender`) and :class:`KVReceiver` (decode: one ticket
of the :class:`KVBootstrapServer`; diagram in :mod:`kvstore.tickets`). The only package that
imports ``mooncake`` (lazily, in :mod:`kvstore.engine`); it imports nothing of prefill/,
decode/, router/ or the worker package.

Modules: ``engine`` (Transfer Engine wrapper), ``layout`` (pool regions, fingerprint),
``descriptors`` (slot/pages → merged runs), ``sender`` + ``writes`` + ``retry`` (prefill side),
``pump`` (the transfer thread that advances senders off the worker's engine loop),
``client`` + ``control`` (the control channel: per-peer executors, so one hung decode peer never
delays another), ``bootstrap`` + ``tickets`` + ``receiver`` (decode side), ``listen`` (TE ports
kept to the hostname's interface), ``config`` (``K3SERVE_KV_*``), ``faults`` (injected failures
/ hangs), ``staging`` (CUDA pools reach the TE through a pinned host mirror,
``K3SERVE_KV_STAGING``), ``loopback`` (a stand-alone decode peer for tests/benchmarks).

Guarantees: a ticket succeeds only when the sender's per-layer byte manifest equals the bytes
the decode side expects for its reservation; a fingerprint mismatch (model, block size, dtypes,
state and latent shapes, layer ids) refuses the pairing on both sides and names every field
that differs; failed reservations are released only when no sender can still write into them;
every wait has a timeout.
"""

from __future__ import annotations

from kvstore.bootstrap import KVBootstrapServer
from kvstore.client import BootstrapClient
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
