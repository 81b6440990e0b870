"""The prefill side's control channel to a decode bootstrap server (:mod:`kvstore.bootstrap`).

Requests and replies are :mod:`k3serve.messages` models both ways: :meth:`BootstrapClient.pair`
sends a ``PairRequest`` and parses the ``PairResponse`` / ``PairError``;
:meth:`BootstrapClient.post_status` sends a ``StatusMessage`` and parses the ``StatusAck``.
Retrying is the caller's choice (:mod:`kvstore.retry`): these calls make one attempt and say
with :attr:`BootstrapError.retryable` whether another can help.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

import httpx
import pydantic

from k3serve.messages import Message, PairError, PairRequest, PairResponse, StatusAck, StatusMessage
from k3serve.protocol import CLUSTER_TOKEN_HEADER
from kvstore.descriptors import fingerprint_diff
from kvstore.errors import BootstrapError, FingerprintMismatch

M = TypeVar("M", bound=Message)


class BootstrapClient:
    """Pairing and status messages over HTTP, plus a small thread pool for background jobs
    (HTTP posts, TE notifications). One per prefill process, shared by its senders.

    Args:
        http_timeout_s: per HTTP request (seconds).
        workers: background threads.
        cluster_token: sent on every call (the decode side's server requires it).
    """

    def __init__(self, http_timeout_s: float = 2.0, workers: int = 2,
                 cluster_token: str | None = None) -> None:
        headers = {CLUSTER_TOKEN_HEADER: cluster_token} if cluster_token else {}
        self._http = httpx.Client(timeout=http_timeout_s, trust_env=False, headers=headers)
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kv-ctl")

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

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        """Run ``fn(*args)`` on the background pool."""
        return self._pool.submit(fn, *args)

    def close(self) -> None:
        """Wait for queued jobs, then close the HTTP client."""
        self._pool.shutdown(wait=True)
        self._http.close()


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


__all__ = ["BootstrapClient"]
