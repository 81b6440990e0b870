"""Mooncake Store client: a shared DRAM pool below the workers (the only Mooncake Store code).

Where it sits (DESIGN.md §3, the last bullet): every prefill and decode worker is a Store client
of one ``mooncake_master`` (``deploy`` starts it, bound to loopback on one machine). Workers put
what they write into their own pools — MLA blocks and KDA snapshots — under their block hashes;
a prefill worker that holds less of a prompt's prefix than the store fetches the difference
before computing (:class:`~kvstore.store.bridge.StoreBridge` moves the bytes in and out of the
pools; this module moves them to and from the store)::

    engine thread                         writer thread (this module)        mooncake_master
    ─────────────                         ───────────────────────────        ───────────────
    bridge.export_new() ── put_*(key, bytes) ──▶ bounded queue ──▶ batch_is_exist → put ──▶ ..
    handler (executor thread): lookup(keys) / get(key) ──────────────────────────────────▶ ..

Keys carry the layout fingerprint (``k3s/{fp}/b/{hash}`` for a block's latents,
``k3s/{fp}/s/{hash}`` for the snapshot at the boundary after block ``hash``), so two builds that
lay their pools out differently never read each other's bytes, even when their hashes agree.
Values are raw bytes: a block is ``mla_latent[:, page]`` (``[L_mla, B, D]`` in the cache dtype),
a snapshot is ``snap_state[:, id]`` (``[L_kda, H, K, V]`` float32) followed by
``snap_conv[:, id]`` (``[L_kda, W-1, C]``) — :meth:`k3serve.cache.pools.KVPools.block_bytes`.

What the store holds, for the router (its index's ``store`` holder, priced below a local hit):
every value a client put (or found already there) is a ``stored`` change, and every value it
learns has gone — evicted by the master, or lost when it restarted — is a ``removed`` change,
in order (:meth:`KVStore.drain_changes`; the worker logs them as cache events with
``source: "store"``). A client learns that a value went (a) at once when a read of it fails or
a lookup finds absent a key it had reported, (b) within ``reconcile_s`` by itself: the writer
thread re-checks the keys it reported, ``reconcile_batch`` per pass, with one batched
``batch_is_exist`` each (so the router stops claiming an evicted prefix within about
``reported keys / reconcile_batch × reconcile_s``).

Failure model: puts are asynchronous and bounded (``max_pending_bytes``; beyond it a put is
dropped and counted), never on the engine thread. A store that is down (master gone: RPC
errors) or full (no space for a put) turns lookups into misses and puts into counted failures,
with ONE log line per change of state; a probe notices the master's return (the Mooncake
client re-mounts its segment by itself) and logs one line again. The probe waits ``retry_s``,
then twice as long after each failed probe, at most ``retry_max_s`` (each failed call makes the
Mooncake client log an error line of its own).
"""

from __future__ import annotations

import contextlib
import enum
import itertools
import logging
import queue
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

log = logging.getLogger("k3serve.store")

STORE_ENV_PREFIX = "K3SERVE_STORE_"
#: Mooncake error codes (``mooncake-store/include/types.h``) this client tells apart.
_NO_SPACE = (-200, -201)  # NO_AVAILABLE_HANDLE / ... : the pool is full


class StoreConfig(BaseSettings):
    """Store client settings (``K3SERVE_STORE_<FIELD>``; ``--store-url`` sets ``url``).

    Attributes:
        url: the master's RPC address ``host:port`` (``None``: no store).
        segment_mb: DRAM this client contributes to the shared pool (MiB).
        local_buffer_mb: the client's transfer buffer (MiB; must hold one value).
        protocol: ``tcp`` (one machine, CI) or ``rdma``.
        hostname: this client's address (loopback on one machine).
        max_pending_mb: queued put bytes beyond which puts are dropped (MiB).
        retry_s: first probe interval while the store is down (s); doubled after each
            failed probe up to ``retry_max_s``.
        retry_max_s: longest probe interval while the store is down (s).
        reconcile_s: interval of the writer's check that reported keys are still there (s).
        reconcile_batch: keys checked per reconciliation pass (one ``batch_is_exist``).
        max_reported: reported keys remembered for reconciliation (the oldest are forgotten).
    """

    model_config = SettingsConfigDict(env_prefix=STORE_ENV_PREFIX, extra="ignore", frozen=True)

    url: str | None = None
    segment_mb: int = Field(default=256, ge=16)  # Mooncake needs ≥ 16 MiB
    local_buffer_mb: int = Field(default=64, ge=1)
    protocol: str = "tcp"
    hostname: str = "127.0.0.1"
    max_pending_mb: int = Field(default=64, ge=1)
    retry_s: float = Field(default=1.0, gt=0)
    retry_max_s: float = Field(default=16.0, gt=0)
    reconcile_s: float = Field(default=2.0, gt=0)
    reconcile_batch: int = Field(default=4096, ge=1)
    max_reported: int = Field(default=200_000, ge=1)

    @property
    def enabled(self) -> bool:
        return bool(self.url)


class StoreState(enum.Enum):
    """Connection state (logged once per change)."""

    CONNECTING = "connecting"
    UP = "up"
    FULL = "full"
    DOWN = "down"
    CLOSED = "closed"


@dataclass
class StoreStats:
    """Counters since start (bytes, operations); read by the worker's metrics.

    Attributes:
        puts: values written; put_bytes: their bytes.
        put_skipped: puts not sent because the key existed already.
        put_dropped: puts dropped before sending (queue over ``max_pending_mb``, store down).
        gets: values read; get_bytes: their bytes.
        failures: operations the store refused or that failed (down, full, RPC errors).
        gone: reported values found gone (evicted, lost), reported as ``removed``.
    """

    puts: int = 0
    put_bytes: int = 0
    put_skipped: int = 0
    put_dropped: int = 0
    gets: int = 0
    get_bytes: int = 0
    failures: int = 0
    gone: int = 0


def block_key(fingerprint: str, h: str) -> str:
    """Store key of the MLA latents of the block with hash ``h``."""
    return f"k3s/{fingerprint[:16]}/b/{h}"


def snapshot_key(fingerprint: str, h: str) -> str:
    """Store key of the KDA snapshot at the boundary after the block with hash ``h``."""
    return f"k3s/{fingerprint[:16]}/s/{h}"


def _parse_key(key: str) -> tuple[str, bool]:
    """``(hash, is_snapshot)`` of a :func:`block_key` / :func:`snapshot_key`."""
    _, _, kind, h = key.split("/", 3)
    return h, kind == "s"


class KVStore:
    """One worker's client of the shared Mooncake Store (module docstring).

    Thread model: :meth:`put_block` / :meth:`put_snapshot` are called from the engine thread
    and only enqueue; the writer thread sends; :meth:`lookup` / :meth:`get` may be called from
    any thread but the engine thread (they block on the network).

    Args:
        config: :class:`StoreConfig` with ``url`` set.
        fingerprint: the layout fingerprint (part of every key).
        client: a ready Store client object (tests; default: connect with ``mooncake.store``).

    Raises:
        ValueError: ``config.url`` unset.
    """

    def __init__(self, config: StoreConfig, fingerprint: str, client: Any = None) -> None:
        if not config.enabled:
            raise ValueError("StoreConfig.url: no store address")
        self.config = config
        self.fingerprint = fingerprint
        self.stats = StoreStats()
        self.state = StoreState.CONNECTING
        self._client = client
        self._lock = threading.Lock()
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._pending = 0
        self._max_pending = config.max_pending_mb << 20
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="store-writer", daemon=True)
        self._next_probe = 0.0
        self._probe_wait = config.retry_s
        self._idle = threading.Event()
        self._idle.set()
        #: ``(hash, is_snapshot, stored)`` changes of what the store holds, in order, for the
        #: router's index; drained by :meth:`drain_changes` (bounded: the oldest are dropped).
        self._changes: deque[tuple[str, bool, bool]] = deque(maxlen=100_000)
        #: keys reported ``stored`` and not since found gone, oldest first (reconciliation)
        self._reported: OrderedDict[str, None] = OrderedDict()
        self._next_reconcile = 0.0

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> KVStore:
        """Start the writer thread (it connects first); returns self."""
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop the writer (queued puts are dropped) and close the client."""
        self._stop.set()
        self._q.put(None)
        if self._thread.is_alive():
            self._thread.join(5)
        self._set_state(StoreState.CLOSED)
        if self._client is not None:
            with contextlib.suppress(Exception):
                self._client.close()

    @property
    def available(self) -> bool:
        """Lookups go to the store (UP or FULL: a full store still serves reads)."""
        return self.state in (StoreState.UP, StoreState.FULL)

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until the put queue is empty (tests, benchmarks). Returns False on timeout."""
        t_end = time.monotonic() + timeout
        while time.monotonic() < t_end:
            if self._pending == 0 and self._idle.is_set():
                return True
            time.sleep(0.01)
        return False

    def _set_state(self, s: StoreState, why: str = "") -> None:
        with self._lock:
            old, self.state = self.state, s
        if old is s:
            return
        if s is StoreState.UP and old is not StoreState.CONNECTING:
            log.warning("store %s is back (%s): hits from the store resume", self.config.url,
                        old.value)
        elif s is StoreState.UP:
            log.info("store %s connected", self.config.url)
        elif s is StoreState.DOWN:
            log.warning("store %s is down (%s): store lookups miss until it returns",
                        self.config.url, why)
        elif s is StoreState.FULL:
            log.warning("store %s is full (%s): puts fail until space frees", self.config.url,
                        why)

    def _connect(self) -> bool:
        if self._client is not None:
            return True
        from kvstore.engine import capture_stderr, mc_log, set_log_level

        set_log_level()
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as e:
            self._set_state(StoreState.DOWN, f"mooncake.store unavailable: {e}")
            return False

        c = self.config
        client = MooncakeDistributedStore()
        # setup prints "Local segment descriptor not found" at glog level E on every start
        # (its own segment is looked up before it is registered): what it prints goes to the
        # kvstore.mooncake logger, at DEBUG when setup succeeds and WARNING when it fails
        rc, printed = capture_stderr(lambda: client.setup(
            c.hostname, "P2PHANDSHAKE", c.segment_mb << 20, c.local_buffer_mb << 20, c.protocol,
            "", c.url))
        for line in printed:
            mc_log.log(logging.DEBUG if rc == 0 else logging.WARNING, "%s", line)
        if rc != 0:
            with contextlib.suppress(Exception):
                client.close()
            self._set_state(StoreState.DOWN, f"setup returned {rc}")
            return False
        self._client = client
        return True

    # ------------------------------------------------------------------ engine thread
    def put_block(self, h: str, data: Any) -> bool:
        """Queue the latents of block ``h`` (a buffer: bytes / uint8 array). Never blocks.

        Returns:
            False when dropped (queue over its bound, or the store down).
        """
        return self._enqueue(block_key(self.fingerprint, h), data)

    def put_snapshot(self, h: str, data: Any) -> bool:
        """Queue the snapshot at the boundary after block ``h``. Never blocks."""
        return self._enqueue(snapshot_key(self.fingerprint, h), data)

    def drain_changes(self) -> list[tuple[str, bool, bool]]:
        """``(hash, is_snapshot, stored)`` changes since the last call, in order: ``stored``
        True — the store took the value (or had it); False — a reported value is gone."""
        out = []
        with contextlib.suppress(IndexError):
            while True:
                out.append(self._changes.popleft())
        return out

    def _report(self, key: str) -> None:
        """The store holds ``key`` (put, or found there): a ``stored`` change."""
        with self._lock:
            self._reported.pop(key, None)
            self._reported[key] = None
            while len(self._reported) > self.config.max_reported:
                self._reported.popitem(last=False)
            self._changes.append((*_parse_key(key), True))

    def _gone(self, keys: Sequence[str], only_reported: bool = True) -> None:
        """These keys are not in the store (any more): ``removed`` changes for those this
        client reported (all of them with ``only_reported`` False: a read that failed)."""
        with self._lock:
            for key in keys:
                if self._reported.pop(key, 0) is None or not only_reported:
                    self.stats.gone += 1
                    self._changes.append((*_parse_key(key), False))

    def _enqueue(self, key: str, data: Any) -> bool:
        n = memoryview(data).nbytes
        with self._lock:
            if self.state in (StoreState.DOWN, StoreState.CLOSED) or (
                self._pending + n > self._max_pending
            ):
                self.stats.put_dropped += 1
                return False
            self._pending += n
        self._q.put((key, data, n))
        return True

    # ------------------------------------------------------------------ writer thread
    def _run(self) -> None:
        while not self._stop.is_set() and not self._connect():
            self._stop.wait(self.config.retry_s)
        if self._stop.is_set():
            return
        self._set_state(StoreState.UP)
        while not self._stop.is_set():
            try:
                item = self._q.get(timeout=min(self.config.retry_s, self.config.reconcile_s))
            except queue.Empty:
                if self._probe():
                    self._reconcile()
                continue
            if item is None:
                return
            batch = [item]
            with contextlib.suppress(queue.Empty):
                while len(batch) < 64:
                    nxt = self._q.get_nowait()
                    if nxt is None:
                        self._stop.set()
                        break
                    batch.append(nxt)
            self._idle.clear()
            try:
                self._write(batch)
                self._reconcile()
            finally:
                with self._lock:
                    self._pending -= sum(n for _, _, n in batch)
                self._idle.set()

    def _reconcile(self) -> None:
        """Writer thread, at most every ``reconcile_s``: check the oldest-checked
        ``reconcile_batch`` reported keys with one ``batch_is_exist``; those gone become
        ``removed`` changes, those present go to the back of the round."""
        now = time.monotonic()
        if now < self._next_reconcile or not self.available:
            return
        self._next_reconcile = now + self.config.reconcile_s
        with self._lock:
            keys = list(itertools.islice(self._reported, self.config.reconcile_batch))
        if not keys:
            return
        try:
            ex = self._client.batch_is_exist(keys)
        except Exception as e:  # noqa: BLE001 - a dead master surfaces as anything
            log.debug("batch_is_exist: %s", e)
            return
        if len(ex) != len(keys) or (ex and all(x < 0 for x in ex)):
            return  # no answer: the store is down, the next put or probe notices
        self._gone([k for k, x in zip(keys, ex) if x == 0])
        with self._lock:
            for k, x in zip(keys, ex):
                if x == 1 and k in self._reported:
                    self._reported.move_to_end(k)

    def _write(self, batch: list[tuple[str, Any, int]]) -> None:
        if self.state is StoreState.DOWN and not self._probe():
            with self._lock:
                self.stats.put_dropped += len(batch)
            return
        try:
            exist = self._client.batch_is_exist([k for k, _, _ in batch])
        except Exception as e:  # noqa: BLE001 - a dead master surfaces as anything
            exist = [-1] * len(batch)
            log.debug("batch_is_exist: %s", e)
        if exist and all(x < 0 for x in exist):
            self._fail(len(batch), StoreState.DOWN, f"batch_is_exist returned {exist[0]}")
            return
        for (key, data, n), ex in zip(batch, exist, strict=True):
            if ex == 1:
                self.stats.put_skipped += 1
                self._report(key)
                continue
            try:
                rc = self._client.put(key, data)
            except Exception as e:  # noqa: BLE001
                rc = -1
                log.debug("put %s: %s", key, e)
            if rc == 0:
                self.stats.puts += 1
                self.stats.put_bytes += n
                self._report(key)
                if self.state is StoreState.FULL:
                    self._set_state(StoreState.UP)
            elif rc in _NO_SPACE:
                self._fail(1, StoreState.FULL, f"put returned {rc}")
            else:
                self._fail(1, StoreState.DOWN, f"put returned {rc}")
                return

    def _fail(self, n: int, state: StoreState, why: str) -> None:
        self.stats.failures += n
        self._set_state(state, why)
        if state is StoreState.DOWN:
            self._probe_wait = self.config.retry_s
            self._next_probe = time.monotonic() + self._probe_wait

    def _probe(self) -> bool:
        """While DOWN: one cheap call after ``retry_s``, then at doubling intervals up to
        ``retry_max_s``; True (and UP) once it answers."""
        if self.state is not StoreState.DOWN:
            return True
        now = time.monotonic()
        if now < self._next_probe:
            return False
        self._probe_wait = min(self._probe_wait * 2, max(self.config.retry_max_s,
                                                         self.config.retry_s))
        self._next_probe = now + self._probe_wait
        try:
            ok = self._client.is_exist(f"k3s/{self.fingerprint[:16]}/probe") >= 0
        except Exception:  # noqa: BLE001
            ok = False
        if ok:
            self._set_state(StoreState.UP)
        return ok

    # ------------------------------------------------------------------ readers
    def lookup(self, blocks: Sequence[str], snapshots: Sequence[str]) -> tuple[set[str], set[str]]:
        """Which of these block / snapshot hashes the store holds (one batched call).

        Returns:
            ``(blocks held, snapshots held)``; both empty when the store is not available.
        """
        if not self.available or not (blocks or snapshots):
            return set(), set()
        keys = [block_key(self.fingerprint, h) for h in blocks]
        keys += [snapshot_key(self.fingerprint, h) for h in snapshots]
        try:
            ex = self._client.batch_is_exist(keys)
        except Exception as e:  # noqa: BLE001
            ex = [-1] * len(keys)
            log.debug("batch_is_exist: %s", e)
        if ex and all(x < 0 for x in ex):
            self._fail(1, StoreState.DOWN, f"batch_is_exist returned {ex[0]}")
            return set(), set()
        self._gone([k for k, x in zip(keys, ex) if x == 0])  # evicted since reported
        nb = len(blocks)
        return ({h for h, x in zip(blocks, ex[:nb]) if x == 1},
                {h for h, x in zip(snapshots, ex[nb:]) if x == 1})

    def get_block(self, h: str) -> bytes | None:
        """The latents of block ``h`` as bytes, or ``None`` (missing, evicted, store down)."""
        return self._get(block_key(self.fingerprint, h))

    def get_snapshot(self, h: str) -> bytes | None:
        """The snapshot after block ``h`` as bytes, or ``None``."""
        return self._get(snapshot_key(self.fingerprint, h))

    def _get(self, key: str) -> bytes | None:
        if not self.available:
            return None
        try:
            data = self._client.get(key)
        except Exception as e:  # noqa: BLE001
            log.debug("get %s: %s", key, e)
            data = b""
        if not data:
            self.stats.failures += 1
            if self.available:  # the master answered: the value is gone (evicted, lost)
                self._gone([key], only_reported=False)
            return None
        self.stats.gets += 1
        self.stats.get_bytes += len(data)
        return bytes(data)


__all__ = ["KVStore", "StoreConfig", "StoreState", "StoreStats", "block_key", "snapshot_key"]
