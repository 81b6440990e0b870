"""The prefill side's control channel to a decode bootstrap server (:mod:`kvstore.bootstrap`).

Requests and replies are :mod:`k3serve.messages` models both ways: :meth:`BootstrapClient.pair`
sends a ``PairRequest`` and parses the ``PairResponse`` / ``PairError``;
:meth:`BootstrapClient.post_status` sends a ``StatusMessage`` and parses the ``StatusAck``.
Retrying is the caller's choice (:mod:`kvstore.retry`): these calls make one attempt and say
with :attr:`BootstrapError.retryable` whether another can help.

Background jobs run per peer (:meth:`BootstrapClient.submit` with the peer's address): each
decode peer has its own small executor, so a peer that stops answering holds only its own
threads; pairing and completion messages to every other peer go on. Best-effort jobs (failure
reports) are dropped when the peer does not answer: it already has
:attr:`BootstrapClient.max_backlog` jobs queued or running *and* none of its jobs got an answer
(a job that returned, or an HTTP reply of any status) within the last ``answer_window_s``. A
peer that answers slowly under load keeps a long queue; its reports are queued, never dropped
(a dropped report leaves the decode side holding the reservation until the sender's announced
quiesce time).
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

import httpx
import pydantic

from k3serve.messages import Message, PairError, PairRequest, PairResponse, StatusAck, StatusMessage
from k3serve.protocol import CLUSTER_TOKEN_HEADER
from kvstore.descriptors import fingerprint_diff
from kvstore.errors import BootstrapError, FingerprintMismatch

M = TypeVar("M", bound=Message)
log = logging.getLogger(__name__)


class BootstrapClient:
    """Pairing and status messages over HTTP, plus per-peer executors for background jobs
    (HTTP posts, TE notifications). One per prefill process, shared by its senders.

    Args:
        http_timeout_s: per HTTP request (seconds).
        workers: background threads per peer.
        cluster_token: sent on every call (the decode side's server requires it).
        max_backlog: best-effort jobs for a peer are dropped while it has this many jobs
            queued or running and did not answer within ``answer_window_s``.
        answer_window_s: a peer counts as answering while one of its jobs got an answer
            within this many seconds (default: twice ``http_timeout_s``).
    """

    def __init__(self, http_timeout_s: float = 2.0, workers: int = 2,
                 cluster_token: str | None = None, max_backlog: int = 8,
                 answer_window_s: float | None = None) -> None:
        headers = {CLUSTER_TOKEN_HEADER: cluster_token} if cluster_token else {}
        self._http = httpx.Client(timeout=http_timeout_s, trust_env=False, headers=headers)
        self.workers, self.max_backlog = workers, max_backlog
        self._join_s = http_timeout_s + 1.0
        self._peers: dict[str, PeerExecutor] = {}
        self._backlog: dict[str, int] = {}
        self.answer_window_s = 2 * http_timeout_s if answer_window_s is None else answer_window_s
        self._answered_at: dict[str, float] = {}  # peer -> latest answer (monotonic s)
        self._lock = threading.Lock()
        self._closed = False
        self._sessions: set[str] = set()

    def pair(self, addr: str, req: PairRequest, local_fingerprint: dict[str, Any]) -> PairResponse:
        """Ask ``addr``'s bootstrap server for the destination of ``req.ticket``.

        Raises:
            FingerprintMismatch: the layouts differ (lines name each field, local = ours).
            BootstrapError: unreachable or 5xx (retryable); unknown / closed / taken ticket, a
                malformed reply (not).
        """
        r = self._request(addr, "/kv/pair", req)
        if r.status_code == 200:
            return _parse(PairResponse, r, addr)
        err = _parse(PairError, r, addr, fallback=lambda text: PairError(error="http", detail=text))
        if r.status_code == 409 and err.error == "fingerprint_mismatch":
            raise FingerprintMismatch(
                fingerprint_diff(local_fingerprint, err.fingerprint or {}) or list(err.diffs or []),
                f"prefill vs decode {addr}",
            )
        raise BootstrapError(
            f"pair with {addr} refused ({r.status_code}): {err.error}: {err.detail}",
            r.status_code,
            retryable=r.status_code >= 500,
        )

    def post_status(self, addr: str, msg: StatusMessage) -> StatusAck:
        """Deliver a status message over HTTP.

        Raises:
            BootstrapError: unreachable or 5xx (retryable); refused (not retryable: e.g. the
                ticket was aborted or the manifest did not match).
        """
        r = self._request(addr, "/kv/status", msg)
        ack = _parse(
            StatusAck, r, addr, fallback=lambda text: StatusAck(accepted=False, error=text)
        )
        if r.status_code != 200 or not ack.accepted:
            raise BootstrapError(
                f"status {msg.kind} for {msg.ticket} refused by {addr} ({r.status_code}): "
                f"{ack.state or ack.error}",
                r.status_code,
                retryable=r.status_code >= 500,
            )
        return ack

    def _request(self, addr: str, path: str, body: Message) -> httpx.Response:
        try:
            return self._http.post(
                f"http://{addr}{path}",
                content=body.model_dump_json(),
                headers={"content-type": "application/json"},
            )
        except httpx.HTTPError as e:
            raise BootstrapError(
                f"bootstrap server {addr} unreachable: {e!r}", 0, retryable=True
            ) from e

    def submit(self, fn: Callable[..., Any], *args: Any, peer: str = "") -> Future:
        """Run ``fn(*args)`` on ``peer``'s executor (``""``: one shared by peerless jobs).

        Raises:
            RuntimeError: the client is closed.
        """
        with self._lock:
            if self._closed:
                raise RuntimeError("BootstrapClient is closed")
            pool = self._peers.get(peer)
            if pool is None:
                pool = self._peers[peer] = PeerExecutor(f"kv-ctl-{peer or 'any'}", self.workers)
            self._backlog[peer] = self._backlog.get(peer, 0) + 1
        fut = pool.submit(fn, *args)
        fut.add_done_callback(lambda f: self._job_done(peer, f))
        return fut

    def submit_best_effort(self, fn: Callable[..., Any], *args: Any, peer: str) -> Future | None:
        """:meth:`submit`, unless the client is closed or ``peer`` does not answer: it already
        has :attr:`max_backlog` jobs queued or running and none of its jobs got an answer in
        the last :attr:`answer_window_s` seconds. Then nothing runs and the result is
        ``None``."""
        now = time.monotonic()
        with self._lock:
            silent = now - self._answered_at.get(peer, -math.inf) > self.answer_window_s
            busy = self._closed or (silent and self._backlog.get(peer, 0) >= self.max_backlog)
        if busy:
            log.warning("kv control: dropping a best-effort message to %s (%s)", peer,
                        "client closed" if self._closed else
                        f"{self.max_backlog} jobs already pending and no answer in "
                        f"{self.answer_window_s:g} s: the peer does not answer")
            return None
        return self.submit(fn, *args, peer=peer)

    def first_contact(self, session: str) -> bool:
        """True the first time ``session`` (a peer's TE session) is named here, else False."""
        with self._lock:
            new = session not in self._sessions
            self._sessions.add(session)
            return new

    def backlog(self, peer: str) -> int:
        """Jobs queued or running for ``peer``."""
        with self._lock:
            return self._backlog.get(peer, 0)

    def _job_done(self, peer: str, fut: Future) -> None:
        answered = False
        if not fut.cancelled():
            err = fut.exception()
            # a BootstrapError with a status is the peer's HTTP reply (a refusal, a 5xx)
            answered = err is None or (isinstance(err, BootstrapError) and err.status > 0)
        with self._lock:
            self._backlog[peer] -= 1
            if answered:
                self._answered_at[peer] = time.monotonic()

    def close(self, wait: bool = True) -> None:
        """Stop taking jobs, let queued ones run and close the HTTP client. With ``wait``,
        wait for them, at most ``http_timeout_s + 1`` seconds in all: a job stuck on a peer
        that does not answer is left to its daemon thread."""
        with self._lock:
            self._closed = True
            pools = list(self._peers.values())
        t_end = time.monotonic() + self._join_s
        for pool in pools:
            pool.shutdown()
        if wait:
            for pool in pools:
                pool.join(max(0.0, t_end - time.monotonic()))
        self._http.close()


class PeerExecutor:
    """``workers`` daemon threads running one peer's jobs in submission order (a stuck job
    never blocks the interpreter's exit, unlike ``ThreadPoolExecutor``'s threads).

    Args:
        name: thread name prefix.
        workers: threads.
    """

    def __init__(self, name: str, workers: int) -> None:
        self._q: queue.SimpleQueue[tuple[Future, Callable[..., Any], tuple] | None] = (
            queue.SimpleQueue())
        self._threads = [threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True)
                         for i in range(max(1, workers))]
        for t in self._threads:
            t.start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        fut: Future = Future()
        self._q.put((fut, fn, args))
        return fut

    def _run(self) -> None:
        while (item := self._q.get()) is not None:
            fut, fn, args = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 - delivered through the future
                fut.set_exception(e)

    def shutdown(self) -> None:
        """Threads end once the jobs queued before this call ran."""
        for _ in self._threads:
            self._q.put(None)

    def join(self, timeout_s: float) -> None:
        t_end = time.monotonic() + timeout_s
        for t in self._threads:
            t.join(max(0.0, t_end - time.monotonic()))


def _parse(
    model: type[M],
    r: httpx.Response,
    addr: str,
    fallback: Callable[[str], M] | None = None,
) -> M:
    """``r``'s body as ``model``; a body that is not one becomes ``fallback(text)`` (error
    answers of something else than our server, e.g. a proxy) or, without a fallback, a
    non-retryable BootstrapError naming the field."""
    try:
        return model.model_validate_json(r.content)
    except pydantic.ValidationError as e:
        if fallback is not None:
            return fallback(r.text[:200])
        raise BootstrapError(
            f"malformed {model.__name__} from {addr}: {e.errors()[0].get('loc')}: "
            f"{e.errors()[0].get('msg')}",
            r.status_code,
            retryable=False,
        ) from e


__all__ = ["BootstrapClient", "PeerExecutor"]
