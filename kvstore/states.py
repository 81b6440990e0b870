"""Poll states and the transfer result (pure). The messages themselves are
:class:`k3serve.messages.StatusMessage` (sender → receiver) and friends."""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

from k3serve.messages import TransferMetadata

#: Name of every TE notification kvstore sends; the message is a StatusMessage's JSON.
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
        metadata: the sender's :class:`TransferMetadata` (prompt token ids, token #1 +
            logprobs, sampling with the resolved seed, position to continue from).
        layer_bytes: bytes that landed per global layer (equal to the expected bytes).
        total_bytes: sum of ``layer_bytes``.
        num_runs: descriptor runs the sender wrote.
        attempts: write attempts the sender needed (1 = no retry).
        sender_seconds: sender's time from construction to its completion message (s).
        seconds: receiver's time from ticket registration to success (s).
    """

    ticket: str
    metadata: TransferMetadata
    layer_bytes: dict[int, int]
    total_bytes: int
    num_runs: int
    attempts: int
    sender_seconds: float
    seconds: float


__all__ = ["NOTIFY_NAME", "KVPoll", "TransferResult"]
