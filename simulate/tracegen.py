"""Trace generators: conversation and agent workloads in the Mooncake JSONL kind.

Rows are dicts ``{"timestamp", "input_length", "output_length", "hash_ids"}`` (the format of
:mod:`simulate.traces`); block ids are fresh integers, so equal ids mean equal content and
prefix. Both generators are deterministic in ``seed``. Pure Python (no torch).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable
from pathlib import Path

from simulate.traces import TRACE_BLOCK, parse_row


def _row(ts_ms: float, ids: list[int], last_tokens: int, out_len: int) -> dict:
    return {"timestamp": int(ts_ms), "input_length": (len(ids) - 1) * TRACE_BLOCK + last_tokens,
            "output_length": out_len, "hash_ids": list(ids)}


def _followup(events: list, rng: random.Random, fresh, t: float, ids: list[int], last: int,
              prob: float) -> None:
    """With probability ``prob``, add the same prompt extended by 1–16 trace tokens, sent
    0.05–0.5 s after it (a client that amends a prompt right after it was computed: the
    extension reuses the whole prompt only where the first one was placed). ``rng`` is the
    follow-ups' own stream, so ``prob`` = 0 leaves the rest of a trace unchanged."""
    if prob <= 0 or rng.random() >= prob:
        return
    ext = rng.randint(1, 16)
    ids2, last2 = (list(ids), last + ext) if last + ext <= TRACE_BLOCK else \
        (ids + fresh(1), last + ext - TRACE_BLOCK)
    events.append((t + rng.uniform(0.05, 0.5), len(events), ids2, last2, rng.randint(10, 200)))


def conversation_trace(num_requests: int = 4000, seed: int = 0, *, num_orgs: int = 8,
                       apps_per_org: int = 16, rate_per_s: float = 4.0,
                       followup_prob: float = 0.0) -> list[dict]:
    """A conversation-shaped trace: multi-turn chats over a hierarchy of shared system prompts.

    ``num_orgs`` organisation preambles (4–16 blocks) each carry ``apps_per_org`` app prompts
    (1–8 more blocks); both levels are Zipf-popular, so prompts diverge at two depths. A
    conversation starts from an app prompt plus a first user message (1–6 blocks); each later
    turn is the previous prompt (its partial last block completed, hence a new id) + the
    answer (1–3 blocks) + a new message (1–4 blocks). One turn in ten is a regeneration: the
    user edits the last message, so the prompt forks right after the previous answer (where no
    prompt-end snapshot exists). Conversations arrive Poisson (``rate_per_s`` turns/s overall),
    think time 5–60 s, 1–12 turns each. With ``followup_prob`` > 0, that share of turns is
    followed 0.05–0.5 s later by the same prompt extended by a few tokens (:func:`_followup`).

    Returns:
        Rows (dicts of the trace's JSONL kind), timestamps non-decreasing.
    """
    rng = random.Random(seed)
    frng = random.Random(seed * 7_919 + 1)
    next_id = 0

    def fresh(k: int) -> list[int]:
        nonlocal next_id
        ids = list(range(next_id, next_id + k))
        next_id += k
        return ids

    orgs = [fresh(rng.randint(4, 16)) for _ in range(num_orgs)]
    apps = [[o + fresh(rng.randint(1, 8)) for _ in range(apps_per_org)] for o in orgs]
    w_org = [1.0 / (i + 1) for i in range(num_orgs)]
    w_app = [1.0 / (i + 1) ** 0.7 for i in range(apps_per_org)]
    events: list[tuple[float, int, list[int], int, int]] = []  # (t, tie, ids, last, out)
    t = 0.0
    while len(events) < num_requests:
        t += rng.expovariate(rate_per_s / 5.0)
        app = rng.choices(apps[rng.choices(range(num_orgs), w_org)[0]], w_app)[0]
        base = list(app)  # the conversation so far, up to the last answer
        msg = fresh(rng.randint(1, 6))
        tt = t
        for _turn in range(rng.randint(1, 12)):
            ids = base + msg
            last = rng.randint(1, TRACE_BLOCK)
            events.append((tt, len(events), ids, last, rng.randint(20, 1200)))
            _followup(events, frng, fresh, tt, ids, last, followup_prob)
            tt += rng.uniform(5.0, 60.0)
            if rng.random() < 0.1:  # regenerate: same history, edited message
                msg = fresh(rng.randint(1, 4))
                continue
            base = ids[:-1] + fresh(1) + fresh(rng.randint(1, 3))  # completed block + answer
            msg = fresh(rng.randint(1, 4))
            if len(base) > 240:
                break
    events.sort()
    return [_row(e[0] * 1000.0, e[2], e[3], e[4]) for e in events[:num_requests]]


def agent_trace(num_requests: int = 4000, seed: int = 0, *, num_tools: int = 8,
                rate_per_s: float = 6.0, followup_prob: float = 0.0) -> list[dict]:
    """A tool-and-agent trace: long shared tool preambles, agent loops that grow fast.

    ``num_tools`` tool/agent preambles (16–48 blocks, Zipf-popular) are shared by many tasks,
    each task adding its own instructions (1–4 blocks); a task runs 2–20 steps 0.5–8 s apart,
    each step's prompt = the previous one (last block completed: new id) + a tool result
    (1–10 blocks) + the model's call (1 block). One step in twelve retries from an earlier
    step (the agent backtracks: the prompt forks mid-context), and 5 % of steps fork a
    parallel branch. Tasks arrive Poisson (``rate_per_s`` steps/s overall). With
    ``followup_prob`` > 0, that share of steps is followed 0.05–0.5 s later by the same prompt
    extended by a few tokens (:func:`_followup`).

    Returns:
        Rows (dicts of the trace's JSONL kind), timestamps non-decreasing.
    """
    rng = random.Random(seed + 7919)
    frng = random.Random(seed * 7_919 + 2)
    next_id = 0

    def fresh(k: int) -> list[int]:
        nonlocal next_id
        ids = list(range(next_id, next_id + k))
        next_id += k
        return ids

    tools = [fresh(rng.randint(16, 48)) for _ in range(num_tools)]
    weights = [1.0 / (i + 1) ** 0.8 for i in range(num_tools)]
    events: list[tuple[float, int, list[int], int, int]] = []
    t = 0.0
    while len(events) < num_requests:
        t += rng.expovariate(rate_per_s / 8.0)
        start = tools[rng.choices(range(num_tools), weights)[0]] + fresh(rng.randint(1, 4))
        branches = [(t, start, [len(start)])]  # (time, ids, earlier step lengths)
        for _ in range(rng.randint(2, 20)):
            nxt = []
            for tt, ids, marks in branches:
                last = rng.randint(1, TRACE_BLOCK)
                events.append((tt, len(events), list(ids), last, rng.randint(10, 200)))
                _followup(events, frng, fresh, tt, ids, last, followup_prob)
                if rng.random() < 1 / 12 and len(marks) > 1:  # backtrack to an earlier step
                    cut = rng.choice(marks[:-1])
                    grown = ids[:cut] + fresh(rng.randint(1, 10)) + fresh(1)
                else:
                    grown = ids[:-1] + fresh(1) + fresh(rng.randint(1, 10)) + fresh(1)
                if len(grown) <= 260:
                    nxt.append((tt + rng.uniform(0.5, 8.0), grown, marks + [len(grown)]))
                if rng.random() < 0.05 and len(branches) < 3:
                    nxt.append((tt + rng.uniform(0.5, 8.0), ids[:-1] + fresh(rng.randint(1, 6)),
                                marks + [len(ids)]))
            branches = nxt
            if not branches:
                break
    events.sort()
    return [_row(e[0] * 1000.0, e[2], e[3], e[4]) for e in events[:num_requests]]


def write_trace(rows: Iterable[dict], path: str | Path) -> Path:
    """Write rows as JSONL (validated with :func:`parse_row`). Returns the path."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    with p.open("w") as f:
        for i, r in enumerate(rows):
            parse_row(r, f"rows[{i}]")
            f.write(json.dumps(r) + "\n")
    return p


__all__ = ["agent_trace", "conversation_trace", "write_trace"]
