"""Poll states, the transfer result, and the status messages sender → receiver (pure)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

#: Name of every TE notification kvstore sends; the ticket is inside the JSON message.
NOTIFY_NAME = "k3kv"


class KVPoll(IntEnum):
    """State of a :class:`~kvstore.sender.KVSender` / :class:`~kvstore.receiver.KVReceiver`
    (SGLang's disaggregation contract; values as SGLang's ``KVPoll``).

    Sender: BOOTSTRAPPING (asking the decode side for the destination) → WAITING_FOR_INPUT
    (paired; no layer ready yet) → TRANSFERRING (writes in flight / completion being sent) →
    SUCCESS | FAILED.  Receiver: BOOTSTRAPPING (ticket registered, no sender yet) →
    WAITING_FOR_INPUT (a sender paired) → TRANSFERRING (first layer reported landed) →
    SUCCESS (every layer's bytes confirmed + metadata) | FAILED.
    """

    FAILED = 0
    BOOTSTRAPPING = 1
    WAITING_FOR_INPUT = 2
    TRANSFERRING = 3
    SUCCESS = 4

    @property
    def terminal(self) -> bool:
        return self in (KVPoll.SUCCESS, KVPoll.FAILED)


@dataclass(frozen=True)
class TransferResult:
    """What a successful receive delivers to the decode worker.

    Attributes:
        ticket: the transfer ticket.
        metadata: the sender's JSON metadata (prompt token ids, token #1 + logprobs, sampling
            parameters, position to continue from — whatever the prefill worker passed).
        layer_bytes: bytes that landed per global layer (equal to the expected bytes).
        total_bytes: sum of ``layer_bytes``.
        num_runs: descriptor runs the sender wrote.
        attempts: write attempts the sender needed (1 = no retry).
        sender_seconds: sender's time from construction to its completion message (s).
        seconds: receiver's time from ticket registration to success (s).
    """

    ticket: str
    metadata: dict[str, Any]
    layer_bytes: dict[int, int]
    total_bytes: int
    num_runs: int
    attempts: int
    sender_seconds: float
    seconds: float


@dataclass
class StatusMessage:
    """A status message from a sender about one ticket (TE notification or HTTP body).

    ``kind``: ``layer`` (progress: ``layers`` = {layer: bytes} of layers whose writes all
    completed since the previous message), ``done`` (everything landed: ``layers`` = the full
    manifest, ``runs``, ``attempts``, ``metadata``), ``failed`` / ``aborted`` (``error``;
    ``layers`` = what did land; ``quiesced`` = the sender will write nothing more).
    """

    ticket: str
    sender: str
    kind: str
    layers: dict[int, int] = field(default_factory=dict)
    runs: int = 0
    attempts: int = 0
    elapsed_s: float = 0.0
    error: str = ""
    quiesced: bool = True
    metadata: dict[str, Any] = field(default_factory=dict)

    KINDS = ("layer", "done", "failed", "aborted")

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "ticket": self.ticket,
            "sender": self.sender,
            "kind": self.kind,
            "layers": {str(k): v for k, v in self.layers.items()},
        }
        if self.kind != "layer":
            d.update(runs=self.runs, attempts=self.attempts, elapsed_s=self.elapsed_s)
        if self.kind == "done":
            d["metadata"] = self.metadata
        if self.kind in ("failed", "aborted"):
            d.update(error=self.error, quiesced=self.quiesced)
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StatusMessage:
        """Raises ValueError on a malformed message."""
        try:
            kind = str(d["kind"])
            if kind not in cls.KINDS:
                raise ValueError(f"unknown kind {kind!r}")
            return cls(
                ticket=str(d["ticket"]),
                sender=str(d["sender"]),
                kind=kind,
                layers={int(k): int(v) for k, v in (d.get("layers") or {}).items()},
                runs=int(d.get("runs", 0)),
                attempts=int(d.get("attempts", 0)),
                elapsed_s=float(d.get("elapsed_s", 0.0)),
                error=str(d.get("error", "")),
                quiesced=bool(d.get("quiesced", True)),
                metadata=dict(d.get("metadata") or {}),
            )
        except (KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"malformed status message: {e!r}") from e


__all__ = ["NOTIFY_NAME", "KVPoll", "StatusMessage", "TransferResult"]
