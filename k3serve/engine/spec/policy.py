"""How many tokens to propose for a sequence in a step: off when the batch is large or the
sequence's proposals are seldom accepted.

With acceptance rate ``α`` (each proposal accepted independently, Leviathan et al. 2023 §3.1)
a step that proposes ``m`` tokens emits ``E(m) = (1 − α^{m+1}) / (1 − α)`` tokens on average
(``m + 1`` at ``α = 1``). Its cost against a plain decode step is modelled as
``1 + c · m · b`` with ``b`` the decode batch and ``c = cost_per_token``: a verify forward is
nearly free while the step is bound by launches and latency (small ``b``), and costs its full
token count once it is bound by compute (large ``b``). The policy picks the ``m ∈ [0, k]``
that maximises ``E(m) / cost(m)`` — 0 when no ``m`` beats a plain step — and never speculates
above ``max_batch_size`` sequences.

``α`` is tracked per sequence as an exponential moving average of its accepted / proposed
tokens (prior 0.5); a sequence whose ``α`` chose 0 still proposes one token every
``probe_interval`` steps so that its estimate can recover.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

PRIOR = 0.5
EMA = 0.3  # weight of the newest step


def expected_tokens(alpha: float, m: int) -> float:
    """``E(m)``: mean tokens a step emits with ``m`` proposals at acceptance ``alpha``."""
    if alpha >= 1.0:
        return float(m + 1)
    return (1.0 - alpha ** (m + 1)) / (1.0 - alpha)


def best_num_tokens(alpha: float, k: int, batch_size: int, cost_per_token: float) -> int:
    """The ``m ∈ [0, k]`` maximising ``E(m) / (1 + cost_per_token · m · batch_size)``."""
    best, best_rate = 0, 1.0
    for m in range(1, k + 1):
        rate = expected_tokens(alpha, m) / (1.0 + cost_per_token * m * batch_size)
        if rate > best_rate * (1 + 1e-9):
            best, best_rate = m, rate
    return best


@dataclass
class SpecPolicy:
    """Per-sequence proposal counts (module docstring).

    Args:
        k: most proposals per sequence. max_batch_size: none above this many sequences.
        cost_per_token: ``c``. probe_interval: steps between one-token probes.
    """

    k: int
    max_batch_size: int
    cost_per_token: float
    probe_interval: int
    alpha: dict[Hashable, float] = field(default_factory=dict)
    idle: dict[Hashable, int] = field(default_factory=dict)

    def num_tokens(self, seq_id: Hashable, batch_size: int) -> int:
        """Proposals for ``seq_id`` in a step of ``batch_size`` decoding sequences."""
        if batch_size > self.max_batch_size:
            return 0
        m = best_num_tokens(self.alpha.get(seq_id, PRIOR), self.k, batch_size,
                            self.cost_per_token)
        if m == 0:
            n = self.idle[seq_id] = self.idle.get(seq_id, 0) + 1
            if n >= self.probe_interval:
                self.idle[seq_id] = 0
                return 1
        return m

    def observe(self, seq_id: Hashable, proposed: int, accepted: int) -> None:
        """Fold one verified step of ``seq_id`` into its acceptance estimate."""
        if proposed <= 0:
            return
        a = self.alpha.get(seq_id, PRIOR)
        self.alpha[seq_id] = (1 - EMA) * a + EMA * (accepted / proposed)

    def forget(self, seq_id: Hashable) -> None:
        """Drop a finished sequence's estimate."""
        self.alpha.pop(seq_id, None)
        self.idle.pop(seq_id, None)


__all__ = ["SpecPolicy", "best_num_tokens", "expected_tokens"]
