"""Expert placement planner: E experts plus R redundant replicas on N ranks, equal slots per rank.

Pure Python + numpy (no torch): ``k3serve experts plan`` and the benchmark run without the model.
The plan's types (:class:`~k3serve.parallel.expert_plan.LayerPlan`, ``Plan``) are in the core.

Problem (MoonEP's redundant experts, Kimi K3 report). Given per-expert token counts
``c [E]`` of one MoE layer, place ``E + R`` expert copies on ``N`` ranks so that

* every rank holds exactly ``S = (E + R) / N`` copies (static shapes on every rank),
* every expert has ≥ 1 copy, and the copies of one expert sit on distinct ranks,
* a replicated expert's tokens are split across its copies by per-copy fractions
  ``f [N, S]`` (Σ over an expert's copies = 1),

minimising the busiest rank's load ``max_r L_r`` with ``L_r = Σ_{slots s of r} f_rs · c_{e(r,s)}``.
The figure reported is ``max / mean`` with ``mean = Σ c / N`` (1.0 = perfect balance).

Algorithm (all greedy, deterministic)::

    1. replica counts  r_e: start at 1, give each of the R extra copies to argmax c_e / r_e
    2. placement       pieces c_e / r_e sorted descending, longest-processing-time onto the
                       least-loaded rank that has a free slot and no copy of e yet
    3. swap search     swap two single-copy experts between the busiest rank and another one
                       while that lowers the pair's max (so the result is never worse than LPT)
    4. split           the fractions minimise Σ_r L_r² (block coordinate descent: water-fill
                       one replicated expert's tokens over its ranks at a time); for a fixed
                       placement the least-squares load vector is also the min-max one

Re-planning from a previous placement (``replan``) keeps the slots and spends at most
``max_moves`` copy moves (a move = one (rank, expert) copy that the old placement did not have:
one expert's weights transferred to one rank): each step either turns a redundant copy of a
cold expert into a new copy of the expert that loads the busiest rank most (1 move), or swaps
two single-copy experts between the busiest rank and a light one (2 moves), whichever lowers
the busiest rank more; the fractions are re-split after every step.
"""

from __future__ import annotations

import heapq
import json
from collections.abc import Sequence

import numpy as np

from k3serve.parallel.expert_plan import (
    LayerPlan,
    Plan,
    check_counts,
    contiguous_plan,
    slots_per_rank,
)

_EPS = 1e-12
GOOD_ENOUGH = 1e-3  # re-planning stops at max/mean ≤ 1.001: a move costs a weight transfer


def _waterfill(base: np.ndarray, total: float) -> np.ndarray:
    """Amounts ``a ≥ 0`` with ``Σ a = total`` minimising ``Σ (base + a)²`` (level filling)."""
    if total <= 0:
        return np.zeros_like(base)
    order = np.sort(base)
    csum = np.cumsum(order)
    k = len(order)
    level = (total + csum[-1]) / k
    for i in range(1, k + 1):  # smallest i whose level lies below the next base
        lv = (total + csum[i - 1]) / i
        if i == k or lv <= order[i]:
            level = lv
            break
    return np.maximum(level - base, 0.0)


def balance_fractions(plan: LayerPlan, counts: np.ndarray, sweeps: int = 60) -> LayerPlan:
    """Re-split the tokens of every replicated expert over its copies (placement unchanged).

    Block coordinate descent on ``Σ_r L_r²``: one expert at a time, its tokens water-filled
    over its ranks given everything else; stops when a sweep lowers the max by < 1e-9.

    Args:
        plan: placement; its ``fractions`` are the starting point.
        counts: ``[E]`` tokens per expert.
        sweeps: upper bound on passes over the replicated experts.

    Returns:
        A new LayerPlan with the same slots and balanced fractions.
    """
    c = np.asarray(counts, dtype=np.float64)
    slots, fr = plan.slots, plan.fractions.copy()
    reps = [(e, rs) for e, rs in plan.copies().items() if len(rs) > 1]
    for e, rs in reps:  # cold experts with zero tokens: split evenly (any split is optimal)
        if c[e] <= 0:
            for r, s in rs:
                fr[r, s] = 1.0 / len(rs)
    loads = (fr * c[slots]).sum(1)
    reps = [(e, np.array([r for r, _ in rs]), np.array([s for _, s in rs])) for e, rs in reps]
    reps = [x for x in reps if c[x[0]] > 0]
    prev = np.inf
    for _ in range(sweeps):
        for e, rr, ss in reps:
            cur = fr[rr, ss] * c[e]
            base = loads[rr] - cur
            new = _waterfill(base, c[e])
            loads[rr] = base + new
            fr[rr, ss] = new / c[e]
        m = loads.max()
        if prev - m < 1e-9 * max(m, 1.0):
            break
        prev = m
    return LayerPlan(slots.copy(), fr)


# ---------------------------------------------------------------------------- fresh plans
def replica_counts(counts: np.ndarray, redundant: int, num_ranks: int) -> np.ndarray:
    """``[E]`` copies per expert: R extra copies, each to the expert with the largest
    tokens-per-copy, at most ``num_ranks`` copies per expert (copies sit on distinct ranks)."""
    c = check_counts(counts)
    reps = np.ones(len(c), dtype=np.int64)
    heap = [(-c[e], e) for e in range(len(c))]
    heapq.heapify(heap)
    given = 0
    while given < redundant:
        if not heap:
            raise ValueError(f"redundant: {redundant} copies exceed {num_ranks} per expert")
        _, e = heapq.heappop(heap)
        if reps[e] >= num_ranks:
            continue
        reps[e] += 1
        given += 1
        heapq.heappush(heap, (-c[e] / reps[e], e))
    return reps


def lpt_plan(counts: Sequence[float] | np.ndarray, num_ranks: int) -> LayerPlan:
    """Baseline: greedy longest-processing-time under equal slots, no replicas (R = 0).

    Experts in descending count order go to the least-loaded rank that still has a free slot.

    Raises:
        ValueError: as ``slots_per_rank``.
    """
    return _lpt(check_counts(counts), np.ones(len(counts), dtype=np.int64), num_ranks)


def _lpt(c: np.ndarray, reps: np.ndarray, n: int) -> LayerPlan:
    s = slots_per_rank(len(c), n, int(reps.sum()) - len(c))
    pieces = sorted(
        ((c[e] / reps[e], e) for e in range(len(c)) for _ in range(int(reps[e]))),
        key=lambda x: (-x[0], x[1]),
    )
    slots = np.full((n, s), -1, dtype=np.int64)
    fill = np.zeros(n, dtype=np.int64)
    loads = np.zeros(n)
    held: list[set[int]] = [set() for _ in range(n)]
    heap = [(0.0, r) for r in range(n)]
    for load_piece, e in pieces:
        skipped = []
        while True:  # least-loaded rank with a free slot and no copy of e
            load, r = heapq.heappop(heap)
            if e not in held[r]:
                break
            skipped.append((load, r))
        slots[r, fill[r]] = e
        fill[r] += 1
        held[r].add(e)
        loads[r] += load_piece
        if fill[r] < s:
            heapq.heappush(heap, (loads[r], r))
        for x in skipped:
            heapq.heappush(heap, x)
    fr = 1.0 / reps[slots]
    return LayerPlan(slots, fr.astype(np.float64))


def _swap_search(plan: LayerPlan, c: np.ndarray, max_rounds: int = 2000) -> LayerPlan:
    """Swap single-copy experts between the busiest rank and another while the max drops."""
    slots, fr = plan.slots.copy(), plan.fractions
    ncopies = np.bincount(slots.reshape(-1), minlength=len(c))
    w = fr * c[slots]  # per-slot load (fractions stay as given)
    loads = w.sum(1)
    for _ in range(max_rounds):
        a = int(np.argmax(loads))
        best = None  # (new pair max, b, sa, sb)
        single_a = [s for s in range(slots.shape[1]) if ncopies[slots[a, s]] == 1]
        if not single_a:
            break
        wa = w[a, single_a]
        for b in np.argsort(loads)[: max(8, len(loads) // 4)]:
            b = int(b)
            if b == a:
                continue
            sb_ok = [s for s in range(slots.shape[1]) if ncopies[slots[b, s]] == 1]
            if not sb_ok:
                continue
            wb = w[b, sb_ok]
            d = wa[:, None] - wb[None, :]  # load moved from a to b
            pair = np.maximum(loads[a] - d, loads[b] + d)
            i, j = np.unravel_index(np.argmin(pair), pair.shape)
            if pair[i, j] < loads[a] - 1e-9 * max(loads[a], 1.0) and (
                best is None or pair[i, j] < best[0]
            ):
                best = (pair[i, j], b, single_a[i], sb_ok[j])
        if best is None:
            break
        _, b, sa, sb = best
        ea, eb = slots[a, sa], slots[b, sb]
        if ea in slots[b] or eb in slots[a]:
            break
        slots[a, sa], slots[b, sb] = eb, ea
        w[a, sa], w[b, sb] = w[b, sb], w[a, sa]
        loads[a], loads[b] = w[a].sum(), w[b].sum()
    return LayerPlan(slots, fr.copy())  # only single copies (fraction 1) moved


def plan_layer(counts: Sequence[float] | np.ndarray, num_ranks: int, redundant: int) -> LayerPlan:
    """Fresh placement of one layer (module docstring, steps 1–4).

    Args:
        counts: ``[E]`` tokens routed to each expert (any non-negative unit).
        num_ranks: N.
        redundant: R extra copies; ``E + R`` must be a multiple of N.

    Returns:
        LayerPlan with ``[N, (E+R)/N]`` slots.

    Raises:
        ValueError: bad ``counts`` / ``ranks`` / ``redundant`` (the message names the field).
    """
    c = check_counts(counts)
    slots_per_rank(len(c), num_ranks, redundant)
    plan = _lpt(c, replica_counts(c, redundant, num_ranks), num_ranks)
    plan = _swap_search(plan, c)
    plan = balance_fractions(plan, c)
    plan.validate(len(c))
    return plan


# ---------------------------------------------------------------------------- re-planning
def replan_layer(
    counts: Sequence[float] | np.ndarray, previous: LayerPlan, max_moves: int
) -> tuple[LayerPlan, int]:
    """Re-plan one layer from ``previous`` moving at most ``max_moves`` expert copies.

    Args:
        counts: ``[E]`` the new per-expert loads.
        previous: the placement in service (same E, N, S are kept).
        max_moves: budget of (rank, expert) copies the new plan may add (weight transfers).

    Returns:
        ``(plan, moves_used)``.

    Raises:
        ValueError: bad ``counts``, ``max_moves`` < 0, or ``previous`` not covering ``counts``.
    """
    c = check_counts(counts)
    if max_moves < 0:
        raise ValueError(f"max_moves: must be ≥ 0, got {max_moves}")
    previous.validate(len(c))
    n = previous.num_ranks
    plan = balance_fractions(previous, c)
    old_pairs = {(r, int(e)) for r in range(n) for e in previous.slots[r]}

    def moves_of(p: LayerPlan) -> int:
        return sum((r, int(e)) not in old_pairs for r in range(n) for e in p.slots[r])

    used = 0
    mean = c.sum() / n
    while used < max_moves and plan.loads(c).max() > mean * (1 + GOOD_ENOUGH):
        step = _best_step(plan, c, max_moves - used)
        if step is None:
            break
        plan = balance_fractions(step, c, sweeps=4)
        used = moves_of(plan)
    plan = balance_fractions(plan, c)
    plan.validate(len(c))
    return plan, moves_of(plan)


def _best_step(plan: LayerPlan, c: np.ndarray, budget: int) -> LayerPlan | None:
    """One re-planning step aimed at the busiest rank ``a``, scored locally (no re-balance).

    Candidates: (1) a redundant copy (expert f, rank b ≠ a, b without e) becomes a copy of one of
    a's three heaviest experts e — f's share on b moves to f's other copies, e's tokens are
    water-filled over its copies plus b (1 move); (2) two single-copy experts swap between a and
    another rank (2 moves). The step with the lowest resulting max over the ranks it touches wins,
    if that is below ``L_a``.
    """
    slots, fr = plan.slots, plan.fractions
    n, s = slots.shape
    ncopies = np.bincount(slots.reshape(-1), minlength=len(c))
    w = fr * c[slots]
    loads = w.sum(1)
    a = int(np.argmax(loads))
    la = loads[a]
    tol = 1e-9 * max(la, 1.0)
    best: tuple[float, float, tuple] | None = None  # (touched max, Σ L² change, action)
    held = [set(row.tolist()) for row in slots]
    # per rank: its cheapest redundant copy (the donor slot), lightest ranks first
    donors: list[tuple[int, int]] = []
    for rb in np.argsort(loads):
        rb = int(rb)
        red = [j for j in range(s) if ncopies[slots[rb, j]] > 1]
        if rb != a and red:
            donors.append((rb, min(red, key=lambda j: w[rb, j])))
    for sa in np.argsort(-w[a])[:3]:
        e = int(slots[a, sa])
        if w[a, sa] <= 0:
            break
        e_ranks = np.flatnonzero((slots == e).any(1))
        e_base = loads[e_ranks] - (w[e_ranks] * (slots[e_ranks] == e)).sum(1)
        tried = 0
        for rb, jb in donors:
            if e in held[rb]:
                continue
            tried += 1
            if tried > 8:
                break
            f = int(slots[rb, jb])
            wf = w[rb, jb]
            base = np.append(e_base, loads[rb] - wf)
            new = base + _waterfill(base, c[e])
            # f's share on b moves to its other copies (estimate: all onto the lightest)
            f_ranks = [r for r in range(n) if r != rb and f in held[r]]
            touched = max(new.max(), min(loads[r] for r in f_ranks) + wf)
            if touched >= la - tol:
                continue
            d2 = float((new**2).sum() - (loads[e_ranks] ** 2).sum() - loads[rb] ** 2)
            key = (touched, d2, ("copy", e, rb, jb))
            if best is None or key[:2] < best[:2]:
                best = key
    if budget >= 2:
        single_a = [j for j in range(s) if ncopies[slots[a, j]] == 1]
        for b in np.argsort(loads)[: n // 2]:
            b = int(b)
            single_b = [j for j in range(s) if ncopies[slots[b, j]] == 1]
            if b == a or not single_a or not single_b:
                continue
            wa, wb = w[a, single_a], w[b, single_b]
            dd = wa[:, None] - wb[None, :]
            pair = np.maximum(la - dd, loads[b] + dd)
            i, jj = np.unravel_index(np.argmin(pair), pair.shape)
            sa, sb = single_a[i], single_b[jj]
            if pair[i, jj] >= la - tol or slots[a, sa] in slots[b] or slots[b, sb] in slots[a]:
                continue
            d2 = float((la - dd[i, jj]) ** 2 + (loads[b] + dd[i, jj]) ** 2 - la**2 - loads[b] ** 2)
            # a swap costs two moves: count it as half the gain per move
            key = (la - 0.5 * (la - float(pair[i, jj])), d2, ("swap", a, sa, b, sb))
            if best is None or key[:2] < best[:2]:
                best = key
    if best is None:
        return None
    act = best[2]
    ns, nf = slots.copy(), fr.copy()
    if act[0] == "copy":
        _, e, rb, jb = act
        f = int(ns[rb, jb])
        ns[rb, jb] = e
        nf[rb, jb] = 0.0
        _renorm(ns, nf, f)
        _renorm(ns, nf, e)
    else:
        _, a, sa, b, sb = act
        ns[a, sa], ns[b, sb] = ns[b, sb], ns[a, sa]
    return LayerPlan(ns, nf)


def _renorm(slots: np.ndarray, fr: np.ndarray, e: int) -> None:
    """Make expert e's remaining copies sum to 1 again (in place)."""
    m = slots == e
    tot = fr[m].sum()
    fr[m] = fr[m] / tot if tot > 0 else 1.0 / m.sum()


# ---------------------------------------------------------------------------- many layers
def load_counts(path: str) -> list[np.ndarray]:
    """Read a counts file: JSON list of per-expert counts, or a list of such lists (per layer).

    Raises:
        ValueError: a file that cannot be read (``counts: cannot read PATH (reason)``), not
            JSON, or not a (list of) list(s) of non-negative numbers of one length.
    """
    try:
        with open(path) as f:
            data = json.load(f)
    except OSError as e:
        raise ValueError(f"counts: cannot read {path} ({e.strerror or e})") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"counts: {path} is not JSON ({e})") from None
    if isinstance(data, dict) and "counts" in data:
        data = data["counts"]
    if not isinstance(data, list) or not data:
        raise ValueError("counts: expected a list of counts or a list of per-layer lists")
    layers = data if isinstance(data[0], list) else [data]
    out = [check_counts(x) for x in layers]
    if len({len(x) for x in out}) != 1:
        raise ValueError("counts: every layer must list the same number of experts")
    return out


def plan(
    counts: Sequence[Sequence[float]] | Sequence[np.ndarray],
    num_ranks: int,
    redundant: int,
    previous: Plan | None = None,
    max_moves: int | None = None,
) -> Plan:
    """Plan (or re-plan) every layer.

    Args:
        counts: per layer, ``[E]`` tokens per expert.
        num_ranks: N.
        redundant: R (with ``previous``: must equal its R, whose slot layout is kept).
        previous: placement in service; with it each layer moves ≤ ``max_moves`` copies.
        max_moves: per layer budget (required with ``previous``).

    Returns:
        Plan with per-layer placements, before / after max-over-mean and moves used. "Before" is
        the contiguous placement without replicas (fresh) or ``previous`` under the new counts.

    Raises:
        ValueError: as the per-layer functions, or ``previous`` with a different layer count /
            rank count / R, or ``max_moves`` missing with ``previous``.
    """
    cs = [check_counts(x) for x in counts]
    if previous is None:
        layers = [plan_layer(x, num_ranks, redundant) for x in cs]
        e = len(cs[0])
        if e % num_ranks == 0:
            before = [contiguous_plan(e, num_ranks).max_over_mean(x) for x in cs]
        else:
            before = [lpt_plan(x, num_ranks).max_over_mean(x) for x in cs]
        return Plan(layers, before, [lp.max_over_mean(x) for lp, x in zip(layers, cs)],
                    [0] * len(cs))
    if max_moves is None:
        raise ValueError("max_moves: required when re-planning from a previous plan")
    if len(previous.layers) != len(cs):
        raise ValueError(
            f"previous: {len(previous.layers)} layers, counts have {len(cs)}"
        )
    if previous.layers[0].num_ranks != num_ranks:
        raise ValueError(f"ranks: {num_ranks} != previous plan's {previous.layers[0].num_ranks}")
    prev_r = previous.layers[0].slots.size - len(cs[0])
    if prev_r != redundant:
        raise ValueError(
            f"redundant: {redundant} != the previous plan's {prev_r} (its slots are kept)"
        )
    before = [p.max_over_mean(x) for p, x in zip(previous.layers, cs)]
    res = [replan_layer(x, p, max_moves) for x, p in zip(cs, previous.layers)]
    return Plan([p for p, _ in res], before, [p.max_over_mean(x) for (p, _), x in zip(res, cs)],
                [m for _, m in res])


__all__ = [
    "balance_fractions",
    "load_counts",
    "lpt_plan",
    "plan",
    "plan_layer",
    "replan_layer",
    "replica_counts",
]
