"""A thin wrapper over the Mooncake Transfer Engine (the only module that imports mooncake).

What the installed wheel (``mooncake-transfer-engine`` 0.3.x) gives and how we use it:

How to bring one up is :class:`kvstore.config.EngineConfig` (re-exported here).

* ``initialize(local_hostname, metadata_server, protocol, device)``: ``metadata_server`` is
  ``"P2PHANDSHAKE"`` (no metadata service: peers are addressed ``host:rpc_port``) or a
  connection string (``etcd://h:p``, ``http://h:p/metadata``, ...: peers are addressed by their
  ``local_hostname``). ``protocol`` ``tcp`` (one box, CI) or ``rdma`` (clusters).
* Writes are one-sided: the local engine writes into a remote engine's *registered* memory; the
  remote side refuses addresses outside its registered buffers.
* ``batch_transfer_sync_write`` blocks (GIL released) until the batch completes: our
  :meth:`KVEngine.write`.
* Non-blocking completion: ``get_batch_transfer_status`` *blocks* until a batch finishes
  (busy-wait) and ``transfer_check_status`` looks only at entry 0 of a batch, so the async path
  (:meth:`KVEngine.submit`) submits each chunk (≤ ``max_request_bytes``) as its own one-entry
  batch (``transfer_submit_write``) and polls it with ``transfer_check_status``: no thread, no
  spinning. A per-peer in-flight byte budget keeps the TCP transport's per-peer queue (1024
  slices of 64 KiB by default) from overflowing — an overflow fails the write outright.
* Listening: the engine's handshake and tcp data ports are restricted to the interface of the
  address peers dial (:mod:`kvstore.listen`); where they cannot be, a warning names them.
* Logs: Mooncake writes its glog lines to stderr; ``MC_LOG_LEVEL`` (default here ``ERROR``,
  ``INFO`` when the ``kvstore`` logger is at DEBUG) is set before the first engine, and what
  ``initialize`` prints goes to the ``kvstore.mooncake`` logger at DEBUG (WARNING when it fails);
  the store client (kvstore/store/client.py) routes what its ``setup`` prints the same way.
* Notifications: ``batch_transfer_sync(..., notify=TransferNotify(name, msg))`` delivers
  ``(name, msg)`` to the peer's ``get_notifies()`` after the (tiny) write; messages of a few
  hundred KiB work, 4 MB are dropped by the receiver *while the sender sees success* — keep
  them small (:data:`MAX_NOTIFY_BYTES`).
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Iterable
from typing import Any, Self

from kvstore.config import P2PHANDSHAKE, EngineConfig
from kvstore.descriptors import PoolLayout, Run
from kvstore.errors import MooncakeUnavailable, TransferError
from kvstore.listen import listening_sockets, restrict_listeners
from kvstore.pump import TransferPump

log = logging.getLogger(__name__)
mc_log = logging.getLogger("kvstore.mooncake")

#: Largest notification message we send through TE (bytes); larger ones go over HTTP.
MAX_NOTIFY_BYTES = 256 * 1024
_SCRATCH_BYTES = 4096
_BAD_BATCH_IDS = (0, (1 << 64) - 1)


def set_log_level() -> None:
    """Set ``MC_LOG_LEVEL`` unless the environment has it: ``ERROR``, or ``INFO`` when the
    ``kvstore`` logger is at DEBUG. Mooncake reads it once, when its first engine or store
    client starts: call this before."""
    if "MC_LOG_LEVEL" not in os.environ:
        os.environ["MC_LOG_LEVEL"] = "INFO" if mc_log.isEnabledFor(logging.DEBUG) else "ERROR"


def import_mooncake() -> Any:
    """Import ``mooncake.engine`` lazily.

    Raises:
        MooncakeUnavailable: the wheel or one of its shared libraries is missing; the message
            says what to install.
    """
    set_log_level()
    try:
        from mooncake import engine as mc
    except ImportError as e:  # includes missing libibverbs.so / libnuma.so
        raise MooncakeUnavailable(
            "cannot import mooncake.engine "
            f"({e}). Install `mooncake-transfer-engine-non-cuda` (CPU) or "
            "`mooncake-transfer-engine` (CUDA) and the Debian packages libibverbs1 librdmacm1 "
            "libnuma1 (`make sysdeps`)."
        ) from e
    return mc


class TransferHandle:
    """Progress of one :meth:`KVEngine.submit` (a set of runs to one peer).

    Attributes:
        peer: destination session id.
        total_bytes: bytes submitted (sum of run lengths).
        done_bytes: bytes confirmed written.
        error: the first failure (None while fine).
    """

    def __init__(self, engine: KVEngine, peer: str, total_bytes: int, num_chunks: int) -> None:
        self._engine = engine
        self.peer = peer
        self.total_bytes = total_bytes
        self.done_bytes = 0
        self.error: TransferError | None = None
        self._pending = num_chunks  # chunks queued or in flight

    @property
    def done(self) -> bool:
        """Every byte written successfully."""
        return self.error is None and self._pending == 0

    @property
    def settled(self) -> bool:
        """Nothing of this handle is queued or in flight any more (success or not): the source
        memory may be reused and the destination will not change because of it."""
        return self._pending == 0

    def chunk_settled(self) -> None:
        """One of this handle's chunks left the queue or the wire (written, failed or dropped);
        called by the engine's I/O thread only."""
        self._pending -= 1

    def poll(self) -> bool:
        """Advance the engine; True once done.

        Raises:
            TransferError: a chunk failed or timed out (the handle keeps its ``error``).
        """
        self._engine.progress()
        if self.error is not None:
            raise self.error
        return self.done

    def wait(self, timeout_s: float | None = None, interval_s: float = 0.0005) -> None:
        """Block until done (sleeping ``interval_s`` between polls).

        Raises:
            TransferError: failure, or not done within ``timeout_s`` seconds (code -2).
        """
        t_end = None if timeout_s is None else time.monotonic() + timeout_s
        while not self.poll():
            if t_end is not None and time.monotonic() > t_end:
                raise TransferError("write", -2, self.peer, f"not done after {timeout_s} s")
            time.sleep(interval_s)


class _Chunk:
    __slots__ = ("abandon_at", "batch_id", "deadline", "dst", "handle", "length", "src")

    def __init__(self, handle: TransferHandle, src: int, dst: int, length: int) -> None:
        self.handle, self.src, self.dst, self.length = handle, src, dst, length
        self.batch_id = 0
        self.deadline = self.abandon_at = 0.0


class KVEngine:
    """One Mooncake Transfer Engine per process.

    Args:
        config: see :class:`EngineConfig`.

    Raises:
        MooncakeUnavailable: mooncake cannot be imported.
        TransferError: ``initialize`` failed (op ``initialize``).
    """

    def __init__(self, config: EngineConfig | None = None) -> None:
        self.config = config or EngineConfig()
        self._mc = import_mooncake()
        self._te = self._mc.TransferEngine()
        c = self.config
        before = listening_sockets()
        rc, printed = capture_stderr(
            lambda: self._te.initialize(c.hostname, c.metadata_server, c.protocol, c.device_name))
        for line in printed:
            mc_log.log(logging.DEBUG if rc == 0 else logging.WARNING, "%s", line)
        if rc != 0:
            raise TransferError(
                "initialize",
                rc,
                detail=f"hostname={c.hostname} metadata={c.metadata_server} "
                f"protocol={c.protocol} device={c.device_name!r}",
            )
        #: the interface the engine's ports accept connections from (None: every interface)
        self.listen_interface, self.open_ports = None, []
        if c.restrict_listen:
            # P2P: peers dial the hostname; with a metadata service, the address Mooncake
            # advertises (MC_TCP_BIND_ADDRESS, else its first non-loopback interface)
            where = (c.hostname if c.metadata_server == P2PHANDSHAKE
                     else os.environ.get("MC_TCP_BIND_ADDRESS", "0.0.0.0"))
            self.listen_interface, self.open_ports = restrict_listeners(before, where)
            if self.open_ports:
                log.warning(
                    "Mooncake transfer engine ports %s listen on every interface (hostname %s: "
                    "%s): any host that reaches them can read and write this worker's cache "
                    "memory; isolate the network (README 'Deployment security')",
                    ", ".join(map(str, self.open_ports)), c.hostname,
                    "no interface of this machine" if self.listen_interface is None
                    else f"SO_BINDTODEVICE {self.listen_interface} refused")
        self.rpc_port = int(self._te.get_rpc_port())
        self.session_id = (
            f"{c.hostname}:{self.rpc_port}" if c.metadata_server == P2PHANDSHAKE else c.hostname
        )
        self._lock = threading.RLock()
        #: the transfer thread advancing this engine's senders (:mod:`kvstore.pump`)
        self.pump = TransferPump()
        #: host staging of device pools (:mod:`kvstore.staging`), set by :meth:`register_pools`
        self.staging: Any = None
        self._registered: dict[int, int] = {}
        self._queued: dict[str, deque[_Chunk]] = {}
        self._inflight: dict[str, list[_Chunk]] = {}
        self._inflight_bytes: dict[str, int] = {}
        # A small registered buffer: the 8-byte write that carries a notification lands here.
        self._scratch = ctypes.create_string_buffer(_SCRATCH_BYTES)
        self.scratch_addr = ctypes.addressof(self._scratch)
        self.register(self.scratch_addr, _SCRATCH_BYTES)

    # ------------------------------------------------------------------ memory
    def register(self, addr: int, length: int) -> None:
        """Register ``[addr, addr + length)`` (bytes) so peers may write into it / we may
        write from it.

        Raises:
            TransferError: op ``register`` (e.g. zero length, overlap, NIC limit).
        """
        rc = self._te.register_memory(int(addr), int(length))
        if rc != 0:
            raise TransferError("register", rc, detail=f"addr=0x{addr:x} length={length}")
        with self._lock:
            self._registered[int(addr)] = int(length)

    def unregister(self, addr: int) -> None:
        """Unregister a region registered at ``addr``.

        Raises:
            TransferError: op ``unregister`` (not registered).
        """
        rc = self._te.unregister_memory(int(addr))
        if rc != 0:
            raise TransferError("unregister", rc, detail=f"addr=0x{addr:x}")
        with self._lock:
            self._registered.pop(int(addr), None)

    def register_layout(self, layout: PoolLayout) -> None:
        """Register every region's extent (see :attr:`RegionLayout.extent`)."""
        for r in layout.regions:
            self.register(*r.extent)

    def unregister_layout(self, layout: PoolLayout) -> None:
        for r in layout.regions:
            self.unregister(r.base)

    def register_pools(
        self, pools: Any, *, extra: dict[str, Any] | None = None, staging: str = "auto"
    ) -> PoolLayout:
        """Register a worker's transfer pools and return the layout to advertise.

        Args:
            pools: a ``k3serve.cache.pools.KVPools`` (duck-typed, see
                :meth:`PoolLayout.from_kvpools`).
            extra: fingerprint extras (default ``pools.cfg.fingerprint_fields()``).
            staging: ``K3SERVE_KV_STAGING``: ``auto`` (CUDA pools go through a pinned host
                mirror, CPU pools are registered as they are), ``host`` or ``direct``
                (:mod:`kvstore.staging`). With staging, :attr:`staging` holds the mirror and
                the returned layout is the mirror's (host addresses, the same fingerprint).

        Raises:
            ValueError: an unknown ``staging`` mode; the pools do not describe a layout.
            TransferError: op ``register``.
        """
        from kvstore.staging import make_staging  # torch: imported only by workers

        layout = PoolLayout.from_kvpools(pools, extra=extra)
        self.staging = make_staging(staging, pools, layout)
        adv = self.staging.layout if self.staging is not None else layout
        self.register_layout(adv)
        return adv

    # ------------------------------------------------------------------ writes
    def write(self, peer: str, runs: Iterable[Run] | Iterable[tuple[int, int, int]]) -> int:
        """Write runs synchronously (``batch_transfer_sync_write``, sub-batches of at most
        ``max_inflight_bytes``); returns the bytes written.

        Args:
            peer: destination session id.
            runs: ``(src, dst, length)`` triples or :class:`Run` (addresses and lengths in bytes).

        Raises:
            TransferError: op ``write`` with the engine's code and the failing sub-batch.
        """
        batch: list[tuple[int, int, int]] = []
        nbytes = total = 0
        for r in runs:
            src, dst, n = int(r[0]), int(r[1]), int(r[2])
            if batch and nbytes + n > self.config.max_inflight_bytes:
                self._write_batch(peer, batch)
                batch, nbytes = [], 0
            batch.append((src, dst, n))
            nbytes += n
            total += n
        if batch:
            self._write_batch(peer, batch)
        return total

    def _write_batch(self, peer: str, batch: list[tuple[int, int, int]]) -> None:
        srcs, dsts, lens = (list(x) for x in zip(*batch))
        rc = self._te.batch_transfer_sync_write(peer, srcs, dsts, lens)
        if rc != 0:
            raise TransferError(
                "write", rc, peer, f"{len(batch)} runs, {sum(lens)} bytes, first dst 0x{dsts[0]:x}"
            )

    def submit(
        self, peer: str, runs: Iterable[Run] | Iterable[tuple[int, int, int]]
    ) -> TransferHandle:
        """Queue runs for an asynchronous write; returns at once. Progress happens in
        :meth:`progress` (called by :meth:`TransferHandle.poll`).

        Args:
            peer: destination session id.
            runs: ``(src, dst, length)`` triples or :class:`Run` (bytes).
        """
        step = self.config.max_request_bytes
        chunks: list[tuple[int, int, int]] = []
        for r in runs:
            src, dst, n = int(r[0]), int(r[1]), int(r[2])
            for off in range(0, n, step):
                chunks.append((src + off, dst + off, min(step, n - off)))
        h = TransferHandle(self, peer, sum(c[2] for c in chunks), len(chunks))
        with self._lock:
            q = self._queued.setdefault(peer, deque())
            q.extend(_Chunk(h, *c) for c in chunks)
        self.progress()
        return h

    def progress(self) -> None:
        """Check in-flight chunks (non-blocking) and submit queued ones within the per-peer
        budget. Cheap when idle; safe from several threads."""
        now = time.monotonic()
        with self._lock:
            for peer, flying in self._inflight.items():
                keep: list[_Chunk] = []
                for c in flying:
                    st = self._te.transfer_check_status(c.batch_id)
                    if st == 0 and now < c.deadline:
                        keep.append(c)
                        continue
                    if st == 1:
                        if c.handle.error is None:
                            c.handle.done_bytes += c.length
                    elif st == 0 and now < c.abandon_at:
                        # Ours timed out; TE still owns the slice: keep it counted until TE
                        # gives up too (or abandon it after another transfer_timeout_s).
                        self._fail(
                            c.handle, -2, f"not completed within {self.config.transfer_timeout_s} s"
                        )
                        keep.append(c)
                        continue
                    else:
                        self._fail(c.handle, st, f"chunk dst 0x{c.dst:x} length {c.length}")
                    c.handle.chunk_settled()
                    self._inflight_bytes[peer] -= c.length
                flying[:] = keep
            for peer, q in self._queued.items():
                budget = self.config.max_inflight_bytes - self._inflight_bytes.get(peer, 0)
                while q and (q[0].length <= budget or not self._inflight.get(peer)):
                    c = q.popleft()
                    if c.handle.error is not None:  # its handle already failed: drop
                        c.handle.chunk_settled()
                        continue
                    bid = self._te.transfer_submit_write(peer, c.src, c.dst, c.length)
                    if bid in _BAD_BATCH_IDS or bid < 0:
                        self._fail(c.handle, -1, "submit refused (peer unreachable?)")
                        c.handle.chunk_settled()
                        continue
                    c.batch_id = bid
                    c.deadline = now + self.config.transfer_timeout_s
                    c.abandon_at = c.deadline + self.config.transfer_timeout_s
                    self._inflight.setdefault(peer, []).append(c)
                    self._inflight_bytes[peer] = self._inflight_bytes.get(peer, 0) + c.length
                    budget -= c.length

    def _fail(self, h: TransferHandle, code: int, detail: str) -> None:
        if h.error is None:
            h.error = TransferError("write", code, h.peer, detail)

    def inflight_bytes(self, peer: str | None = None) -> int:
        """Bytes submitted to TE and not yet completed (one peer or all)."""
        with self._lock:
            if peer is not None:
                return self._inflight_bytes.get(peer, 0)
            return sum(self._inflight_bytes.values())

    # ------------------------------------------------------------------ notifications
    def notify(self, peer: str, peer_scratch_addr: int, msg: str, name: str = "k3kv") -> None:
        """Send ``(name, msg)`` to ``peer``'s :meth:`notifications` (blocking, ~1 ms on
        loopback). The carrier is an 8-byte write from our scratch buffer to
        ``peer_scratch_addr`` (the peer's :attr:`scratch_addr`).

        Raises:
            ValueError: ``msg`` longer than :data:`MAX_NOTIFY_BYTES` (UTF-8 bytes).
            TransferError: op ``notify``. A return of success means *sent*; TE does not
                confirm delivery.
        """
        if len(msg.encode()) > MAX_NOTIFY_BYTES:
            raise ValueError(f"notify message of {len(msg.encode())} bytes > {MAX_NOTIFY_BYTES}")
        note = self._mc.TransferNotify(name, msg)
        rc = self._te.batch_transfer_sync(
            peer,
            [self.scratch_addr],
            [int(peer_scratch_addr)],
            [8],
            self._mc.TransferOpcode.Write,
            note,
        )
        if rc != 0:
            raise TransferError("notify", rc, peer, f"name={name} {len(msg)} chars")

    def notifications(self) -> list[tuple[str, str]]:
        """Drain received notifications: ``[(name, msg), ...]`` in arrival order."""
        return [(n.name, n.msg) for n in self._te.get_notifies()]

    # ------------------------------------------------------------------ misc
    @property
    def raw(self) -> Any:
        """The underlying ``mooncake.engine.TransferEngine`` (benchmarks' raw baseline)."""
        return self._te

    def close(self) -> None:
        """Unregister everything and drop the engine (in-flight writes are abandoned)."""
        self.pump.stop()
        with self._lock:
            regs = list(self._registered)
        for addr in regs:
            try:
                self.unregister(addr)
            except TransferError:
                pass
        self._te = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def capture_stderr(fn: Any) -> tuple[Any, list[str]]:
    """``(fn(), lines written to file descriptor 2 meanwhile)``: Mooncake's start-up log goes
    to the caller, not to the terminal (the engine's ``initialize``, the store client's
    ``setup``)."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            out = fn()
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
        tmp.seek(0)
        lines = tmp.read().decode(errors="replace").splitlines()
    return out, [l for l in lines if l.strip()]


__all__ = [
    "MAX_NOTIFY_BYTES",
    "P2PHANDSHAKE",
    "EngineConfig",
    "KVEngine",
    "TransferHandle",
    "capture_stderr",
    "import_mooncake",
    "set_log_level",
]
