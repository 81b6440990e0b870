"""Expert placement of the MoE layers: which expert copy sits in which slot of which rank.

A :class:`LayerPlan` places ``E + R`` copies of ``E`` experts on ``N`` expert-parallel ranks
with the same number of slots ``S = (E + R) / N`` on every rank (static shapes); a replicated
expert's tokens are split across its copies by per-copy fractions. :class:`Plan` holds one per
MoE layer and reads / writes the plan JSON that ``k3serve experts plan`` writes and a worker's
``--expert-plan`` reads. The planner that computes a balanced plan from token counts is
``deploy/experts.py``; :class:`k3serve.parallel.ep.EPExperts` serves one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class LayerPlan:
    """Placement of one MoE layer.

    Attributes:
        slots: ``[N, S]`` int64 expert id held by slot s of rank r.
        fractions: ``[N, S]`` float64 share of that expert's tokens sent to this copy; the
            copies of one expert sum to 1.
    """

    slots: np.ndarray
    fractions: np.ndarray

    @property
    def num_ranks(self) -> int:
        return int(self.slots.shape[0])

    @property
    def slots_per_rank(self) -> int:
        return int(self.slots.shape[1])

    def loads(self, counts: np.ndarray) -> np.ndarray:
        """``[N]`` tokens per rank for per-expert ``counts [E]``."""
        return (self.fractions * np.asarray(counts, dtype=np.float64)[self.slots]).sum(1)

    def max_over_mean(self, counts: np.ndarray) -> float:
        """Busiest rank's load over the mean rank load (1.0 when ``counts`` is all zero)."""
        loads = self.loads(counts)
        mean = loads.sum() / len(loads)
        return float(loads.max() / mean) if mean > 0 else 1.0

    def copies(self) -> dict[int, list[tuple[int, int]]]:
        """Expert id → its copies as ``(rank, slot)`` pairs, in rank order."""
        out: dict[int, list[tuple[int, int]]] = {}
        for r in range(self.num_ranks):
            for s in range(self.slots_per_rank):
                out.setdefault(int(self.slots[r, s]), []).append((r, s))
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "slots": self.slots.tolist(),
            "fractions": [[round(float(f), 9) for f in row] for row in self.fractions],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any], num_experts: int | None = None) -> LayerPlan:
        """Parse and check one layer of a plan JSON.

        Raises:
            ValueError: ragged or mismatched ``slots`` / ``fractions``, an expert with no copy,
                two copies of one expert on one rank, or fractions not summing to 1.
        """
        slots = np.asarray(d.get("slots"), dtype=np.int64)
        fr = np.asarray(d.get("fractions"), dtype=np.float64)
        if slots.ndim != 2 or slots.size == 0:
            raise ValueError(f"slots: expected a non-empty [ranks][slots] list, got {slots.shape}")
        if fr.shape != slots.shape:
            raise ValueError(f"fractions: shape {fr.shape} != slots shape {slots.shape}")
        plan = cls(slots, fr)
        plan.validate(num_experts)
        return plan

    def validate(self, num_experts: int | None = None) -> None:
        """Check the placement invariants (see the module docstring).

        Raises:
            ValueError: naming the violated field.
        """
        e = int(self.slots.max()) + 1 if num_experts is None else num_experts
        if self.slots.min() < 0 or self.slots.max() >= e:
            raise ValueError(f"slots: expert ids must lie in [0, {e})")
        for r in range(self.num_ranks):
            if len(set(self.slots[r].tolist())) != self.slots_per_rank:
                raise ValueError(f"slots: rank {r} holds two copies of one expert")
        if (self.fractions < -1e-9).any():
            raise ValueError("fractions: negative share")
        tot = np.zeros(e)
        np.add.at(tot, self.slots.reshape(-1), self.fractions.reshape(-1))
        missing = np.flatnonzero(np.bincount(self.slots.reshape(-1), minlength=e) == 0)
        if len(missing):
            raise ValueError(f"slots: expert {int(missing[0])} has no copy")
        bad = np.flatnonzero(np.abs(tot - 1.0) > 1e-6)
        if len(bad):
            raise ValueError(f"fractions: expert {int(bad[0])}'s copies sum to {tot[bad[0]]:.6f}")


@dataclass
class Plan:
    """A placement for every MoE layer plus the figures the CLI reports."""

    layers: list[LayerPlan]
    max_over_mean_before: list[float] = field(default_factory=list)
    max_over_mean_after: list[float] = field(default_factory=list)
    moves: list[int] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        p = self.layers[0]
        return {
            "ranks": p.num_ranks,
            "slots_per_rank": p.slots_per_rank,
            "num_experts": int(max(int(lp.slots.max()) for lp in self.layers) + 1),
            "max_over_mean_before": self.max_over_mean_before,
            "max_over_mean_after": self.max_over_mean_after,
            "moves": self.moves,
            "layers": [lp.to_dict() for lp in self.layers],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Plan:
        """Parse a plan JSON (the ``k3serve experts plan --json`` output).

        Raises:
            ValueError: no ``layers`` list, or a layer fails ``LayerPlan.from_dict``.
        """
        layers = d.get("layers")
        if not isinstance(layers, list) or not layers:
            raise ValueError("layers: a plan needs a non-empty list of layers")
        e = d.get("num_experts")
        return cls([LayerPlan.from_dict(x, e) for x in layers])


def check_counts(counts: Sequence[float] | np.ndarray) -> np.ndarray:
    """``counts`` as a float64 ``[E]`` array.

    Raises:
        ValueError: not one non-empty list, or a count that is negative or not finite.
    """
    c = np.asarray(counts, dtype=np.float64)
    if c.ndim != 1 or c.size == 0:
        raise ValueError(f"counts: expected a non-empty list of per-expert counts, got {c.shape}")
    if not np.isfinite(c).all() or (c < 0).any():
        raise ValueError("counts: every count must be a finite number ≥ 0")
    return c


def slots_per_rank(num_experts: int, num_ranks: int, redundant: int) -> int:
    """``(E + R) / N``.

    Raises:
        ValueError: ``num_ranks`` < 1, ``redundant`` < 0, ``E + R`` not a multiple of
            ``num_ranks``, or more copies of one expert than ranks could ever be needed.
    """
    if num_ranks < 1:
        raise ValueError(f"ranks: must be ≥ 1, got {num_ranks}")
    if redundant < 0:
        raise ValueError(f"redundant: must be ≥ 0, got {redundant}")
    if (num_experts + redundant) % num_ranks:
        raise ValueError(
            f"redundant: experts + redundant = {num_experts + redundant} is not a multiple of "
            f"ranks = {num_ranks} (every rank must hold the same number of expert slots)"
        )
    s = (num_experts + redundant) // num_ranks
    if s < 1:
        raise ValueError(f"ranks: {num_ranks} ranks for {num_experts} experts leaves a rank empty")
    return s


def contiguous_plan(num_experts: int, num_ranks: int) -> LayerPlan:
    """The default placement: expert e on rank ``e // (E / N)``, no replicas.

    Raises:
        ValueError: ``E`` not a multiple of ``num_ranks``.
    """
    s = slots_per_rank(num_experts, num_ranks, 0)
    slots = np.arange(num_experts, dtype=np.int64).reshape(num_ranks, s)
    return LayerPlan(slots, np.ones((num_ranks, s)))


__all__ = ["LayerPlan", "Plan", "check_counts", "contiguous_plan", "slots_per_rank"]
