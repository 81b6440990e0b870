"""Exceptions raised by kvstore (pure: no mooncake, no torch)."""

from __future__ import annotations


class KVStoreError(RuntimeError):
    """Base class of every kvstore error."""


class MooncakeUnavailable(KVStoreError, ImportError):
    """The ``mooncake`` package (Mooncake Transfer Engine wheel) cannot be imported."""


class TransferError(KVStoreError):
    """A Mooncake Transfer Engine call failed.

    Attributes:
        op: the engine operation (``initialize``, ``register``, ``write``, ``notify``, ...).
        peer: the remote session id (``host:rpc_port``) or ``""`` for local operations.
        code: the integer the engine returned (negative), or ``-1`` for our own timeouts.
        detail: a human-readable explanation.
    """

    def __init__(self, op: str, code: int, peer: str = "", detail: str = "") -> None:
        self.op, self.code, self.peer, self.detail = op, int(code), peer, detail
        where = f" peer={peer}" if peer else ""
        msg = f"mooncake {op} failed (code {code}){where}"
        super().__init__(f"{msg}: {detail}" if detail else msg)


class FingerprintMismatch(KVStoreError):
    """Prefill and decode pool layouts differ: pairing them would corrupt the cache silently.

    Attributes:
        diffs: one line per differing field, ``path: local=... remote=...``.
    """

    def __init__(self, diffs: list[str], context: str = "") -> None:
        self.diffs = list(diffs)
        head = "layout fingerprint mismatch" + (f" ({context})" if context else "")
        super().__init__(head + ": " + "; ".join(self.diffs))


class BootstrapError(KVStoreError):
    """The decode side's bootstrap server refused or could not be reached.

    Attributes:
        status: HTTP status code (0 when the server was unreachable).
        retryable: whether asking again can help (unreachable / 5xx) or not (refusals).
    """

    def __init__(self, msg: str, status: int = 0, retryable: bool = True) -> None:
        self.status, self.retryable = status, retryable
        super().__init__(msg)


__all__ = [
    "BootstrapError",
    "FingerprintMismatch",
    "KVStoreError",
    "MooncakeUnavailable",
    "TransferError",
]
