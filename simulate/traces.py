"""Request traces of the Mooncake kind: loading, the block-id → tokens mapping, ceilings, generators.

A trace is JSONL, one request per line (Mooncake's published format)::

    {"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, 48]}

``timestamp`` is the arrival in milliseconds; ``hash_ids[i]`` names the content of trace block
``i`` (``TRACE_BLOCK`` = 512 tokens; the last block may be partial): equal ids mean equal
content *and* equal prefix, since Mooncake hashes blocks chained.

Scaling: one trace block becomes one cache block of ``block_size`` tokens (default
64, so tokens ÷ 8). :func:`block_tokens` is THE mapping from a trace id to that block's token
ids — the simulator, the tests and any live replay use it and nothing else::

    trace ids   [ 46          | 47          | 48 (partial: 137 of 512) ]
    tokens      [ 64·46 … +63 | 64·47 … +63 | 64·48 … +17 ]   (⌈137 / 8⌉ = 18 tokens)

Ceilings over a list of :class:`TraceRequest` (all at block granularity, one prompt token
always computed, DESIGN.md §3):

* :func:`token_oracle` — an infinite exact-prefix cache of every block seen before;
* :func:`snapshot_rule_ceiling` — one infinite pool that keeps KDA snapshots only at prompt
  ends ``⌊(L−1)/B⌋·B`` and at router-marked branch points (where a prompt diverged from
  earlier ones: the next one to diverge there hits), optionally every ``interval`` blocks.

Generators of the same JSONL kind: :mod:`simulate.tracegen`. Pure Python (no torch).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from k3serve.cache.hashing import block_hashes, make_salt

TRACE_BLOCK = 512
"""Tokens per trace block (Mooncake's ``hash_ids`` granularity)."""

DEFAULT_BLOCK = 64
"""Tokens per simulated cache block: one trace block → one 64-token block (tokens ÷ 8)."""

DEFAULT_FINGERPRINT = "replay-k3"
"""Layout fingerprint (hash salt) the simulator's workers use."""

_REQUIRED = ("timestamp", "input_length", "hash_ids")


@dataclass(frozen=True)
class TraceRow:
    """One raw trace line.

    Attributes:
        timestamp_ms: arrival in milliseconds (non-decreasing over a trace).
        input_length: prompt length in trace tokens (≥ 1).
        output_length: answer length in trace tokens (≥ 0).
        hash_ids: ids of the prompt's 512-token trace blocks, ``⌈input_length / 512⌉`` of them.
    """

    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


@dataclass(frozen=True)
class TraceRequest:
    """One trace row scaled to the simulator's block size.

    Attributes:
        arrival: seconds since the first row (before any load scaling).
        ids: the row's trace block ids.
        num_tokens: prompt length in scaled tokens.
        output_tokens: answer length in scaled tokens (⌈output_length / scale⌉).
        hashes: chained block hashes of the full scaled blocks (``block_hashes`` of
            :meth:`tokens`), what the router and the workers compute.
        block_size: tokens per scaled block.
    """

    arrival: float
    ids: tuple[int, ...]
    num_tokens: int
    output_tokens: int
    hashes: tuple[str, ...]
    block_size: int

    def tokens(self, vocab_size: int | None = None) -> list[int]:
        """The prompt's token ids ``[num_tokens]`` (:func:`prompt_tokens` of ``ids``)."""
        return prompt_tokens(self.ids, self.num_tokens, self.block_size, vocab_size)

    @property
    def max_cached_blocks(self) -> int:
        """``⌊(L−1)/B⌋``: the deepest reusable boundary in blocks."""
        return (self.num_tokens - 1) // self.block_size


def block_tokens(block_id: int, block_size: int = DEFAULT_BLOCK,
                 vocab_size: int | None = None) -> list[int]:
    """Token ids of the scaled block standing for trace block ``block_id``.

    Deterministic in every process: the same id always gives the same tokens, different ids
    give different blocks.

    * ``vocab_size=None``: tokens ``block_size·id … block_size·id + block_size − 1``
      (distinct ids → disjoint token sets; ids up to ``(2**31 − 1) // block_size``).
    * ``vocab_size=V``: pseudo-random ids in ``[0, V)`` from BLAKE2b of ``(id, position)``,
      for a live model whose vocabulary is small (two ids collide with probability
      ``V**−block_size``).

    Raises:
        ValueError: a negative or non-int ``block_id`` (``"block_id"``), ``block_size`` < 1,
            ``vocab_size`` < 2, or an id whose tokens would pass ``2**31 − 1``.
    """
    if not isinstance(block_id, int) or isinstance(block_id, bool) or block_id < 0:
        raise ValueError(f"block_id: must be an int ≥ 0, got {block_id!r}")
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size: must be an int ≥ 1, got {block_size!r}")
    if vocab_size is None:
        start = block_size * block_id
        if start + block_size - 1 > 2**31 - 1:
            raise ValueError(f"block_id: {block_id} too large for block_size {block_size}")
        return list(range(start, start + block_size))
    if not isinstance(vocab_size, int) or vocab_size < 2:
        raise ValueError(f"vocab_size: must be an int ≥ 2, got {vocab_size!r}")
    out: list[int] = []
    counter = 0
    while len(out) < block_size:
        d = hashlib.blake2b(f"{block_id}:{counter}".encode(), digest_size=64).digest()
        out.extend(int.from_bytes(d[i:i + 4], "little") % vocab_size
                   for i in range(0, 64, 4))
        counter += 1
    return out[:block_size]


def scaled_length(input_length: int, num_ids: int, block_size: int = DEFAULT_BLOCK,
                  trace_block: int = TRACE_BLOCK) -> int:
    """Prompt length in scaled tokens: full trace blocks → ``block_size`` each, the last,
    partial trace block keeps its share rounded up (``⌈last · block_size / trace_block⌉``).

    Raises:
        ValueError: ``input_length`` outside ``((num_ids − 1)·trace_block, num_ids·trace_block]``.
    """
    last = input_length - (num_ids - 1) * trace_block
    if num_ids < 1 or not 1 <= last <= trace_block:
        raise ValueError(f"input_length: {input_length} does not fit {num_ids} hash_ids of "
                         f"{trace_block} tokens")
    return (num_ids - 1) * block_size + math.ceil(last * block_size / trace_block)


def prompt_tokens(ids: Sequence[int], num_tokens: int, block_size: int = DEFAULT_BLOCK,
                  vocab_size: int | None = None) -> list[int]:
    """The first ``num_tokens`` tokens of the blocks ``block_tokens(ids[0]) ‖ block_tokens(ids[1]) ‖ …``.

    Raises:
        ValueError: ``num_tokens`` outside ``[1, len(ids)·block_size]``; see :func:`block_tokens`.
    """
    if not 1 <= num_tokens <= len(ids) * block_size:
        raise ValueError(f"num_tokens: {num_tokens} outside [1, {len(ids) * block_size}]")
    out: list[int] = []
    for x in ids[: -(-num_tokens // block_size)]:
        out.extend(block_tokens(x, block_size, vocab_size))
    del out[num_tokens:]
    return out


def parse_row(obj: object, where: str = "row") -> TraceRow:
    """Validate one decoded JSON object.

    Raises:
        ValueError: a missing or malformed field, named with ``where``.
    """
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: not a JSON object")
    for f in _REQUIRED:
        if f not in obj:
            raise ValueError(f"{where}.{f}: missing")
    ts, n_in, ids = obj["timestamp"], obj["input_length"], obj["hash_ids"]
    n_out = obj.get("output_length", 0)
    if not isinstance(ts, (int, float)) or isinstance(ts, bool) or ts < 0:
        raise ValueError(f"{where}.timestamp: must be a number ≥ 0, got {ts!r}")
    if not isinstance(n_in, int) or n_in < 1:
        raise ValueError(f"{where}.input_length: must be an int ≥ 1, got {n_in!r}")
    if not isinstance(n_out, int) or n_out < 0:
        raise ValueError(f"{where}.output_length: must be an int ≥ 0, got {n_out!r}")
    if (not isinstance(ids, list) or not ids
            or any(not isinstance(x, int) or isinstance(x, bool) or x < 0 for x in ids)):
        raise ValueError(f"{where}.hash_ids: must be a non-empty list of ints ≥ 0")
    if len(ids) != -(-n_in // TRACE_BLOCK):
        raise ValueError(f"{where}.hash_ids: {len(ids)} ids for input_length {n_in} "
                         f"(expected {-(-n_in // TRACE_BLOCK)})")
    return TraceRow(float(ts), n_in, n_out, tuple(ids))


def read_rows(path: str | Path) -> list[TraceRow]:
    """Read a JSONL trace.

    Raises:
        ValueError: a file that cannot be read (``trace: cannot read PATH (reason)``), an
            empty trace, bad JSON, or a bad row (``"<path>:<line>.<field>"``), timestamps
            going backwards.
    """
    p = Path(path)
    rows: list[TraceRow] = []
    try:
        f = p.open()
    except OSError as e:
        raise ValueError(f"trace: cannot read {p} ({e.strerror or e})") from None
    with f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{p}:{i}: bad JSON: {e.msg}") from None
            row = parse_row(obj, f"{p}:{i}")
            if rows and row.timestamp_ms < rows[-1].timestamp_ms:
                raise ValueError(f"{p}:{i}.timestamp: goes backwards")
            rows.append(row)
    if not rows:
        raise ValueError(f"trace: {p} has no rows")
    return rows


def scale_rows(rows: Sequence[TraceRow], block_size: int = DEFAULT_BLOCK,
               fingerprint: str = DEFAULT_FINGERPRINT) -> list[TraceRequest]:
    """Scale raw rows to ``block_size`` tokens per trace block and hash their blocks.

    Hashes come from ``block_hashes(prompt_tokens(...), block_size, make_salt(fingerprint))``,
    computed block by block along a trie of ids so a shared prefix is hashed once.
    """
    if not rows:
        raise ValueError("rows: empty")
    salt = make_salt(fingerprint)
    scale = TRACE_BLOCK / block_size
    t0 = rows[0].timestamp_ms
    memo: dict[tuple[str | None, int], str] = {}
    out = []
    for r in rows:
        n = scaled_length(r.input_length, len(r.hash_ids), block_size)
        full = n // block_size
        hashes: list[str] = []
        parent: str | None = None
        for x in r.hash_ids[:full]:
            h = memo.get((parent, x))
            if h is None:
                h = block_hashes(block_tokens(x, block_size), block_size, salt, parent=parent)[0]
                memo[(parent, x)] = h
            hashes.append(h)
            parent = h
        out.append(TraceRequest((r.timestamp_ms - t0) / 1000.0, r.hash_ids, n,
                                math.ceil(r.output_length / scale), tuple(hashes), block_size))
    return out


def load_trace(path: str | Path, block_size: int = DEFAULT_BLOCK,
               fingerprint: str = DEFAULT_FINGERPRINT) -> list[TraceRequest]:
    """``scale_rows(read_rows(path))``: a JSONL trace as scaled, hashed requests."""
    return scale_rows(read_rows(path), block_size, fingerprint)


def block_size_of(length_scale: float) -> int:
    """Tokens per block when a live replay scales trace tokens by ``length_scale``:
    ``512 · length_scale`` (one trace block → one cache block; the server's ``--block-size``).

    Raises:
        ValueError: ``512 · length_scale`` is not an integer ≥ 1 (``"length_scale"``).
    """
    bt = TRACE_BLOCK * length_scale
    if not bt >= 1 or abs(bt - round(bt)) > 1e-9:
        raise ValueError(f"length_scale: 512 × {length_scale} = {bt} tokens per trace block "
                         "must be an integer >= 1")
    return round(bt)


def fits(r: TraceRequest, max_model_len: int) -> bool:
    """Whether ``r``'s prompt plus its answer (at least one token) fit ``max_model_len``."""
    return r.num_tokens + max(1, r.output_tokens) <= max_model_len


def replay_slice(path: str | Path, *, limit: int | None = None, length_scale: float = 0.125,
                 max_model_len: int | None = None, output_scale: float | None = None,
                 fingerprint: str = DEFAULT_FINGERPRINT) -> tuple[list[TraceRequest], int]:
    """What a live replay of ``path`` sends, the same for ``k3serve bench``, ``k3serve
    simulate --length-scale`` and the tests: the first ``limit`` rows scaled to
    :func:`block_size_of` ``(length_scale)`` tokens per block, minus the rows that do not
    fit ``max_model_len`` (``None``: keep all). Answer lengths scale like prompts
    (``⌈output_length · length_scale⌉``) unless ``output_scale`` is given
    (``⌈output_length · output_scale⌉``, for answers long enough to time tokens).

    Returns:
        ``(kept requests in arrival order, number of rows skipped)``.

    Raises:
        ValueError: ``limit`` < 1, a bad ``length_scale`` or ``output_scale``, or a bad
            trace (``read_rows``).
    """
    if limit is not None and limit < 1:
        raise ValueError(f"limit: must be >= 1, got {limit}")
    if output_scale is not None and not output_scale > 0:
        raise ValueError(f"output_scale: must be > 0, got {output_scale}")
    bs = block_size_of(length_scale)
    rows = read_rows(path)[:limit]
    reqs = scale_rows(rows, bs, fingerprint)
    if output_scale is not None:
        reqs = [replace(r, output_tokens=math.ceil(row.output_length * output_scale - 1e-9))
                for r, row in zip(reqs, rows, strict=True)]
    kept = [r for r in reqs if max_model_len is None or fits(r, max_model_len)]
    return kept, len(reqs) - len(kept)


# ----------------------------------------------------------------------------- ceilings
def token_oracle(reqs: Sequence[TraceRequest]) -> float:
    """Hit rate of an infinite exact-prefix cache over one pool (tokens reused / prompt tokens).

    A request reuses its longest prefix of blocks seen in any earlier request, capped at
    ``⌊(L−1)/B⌋`` blocks (one token always computed).
    """
    seen: set[str] = set()
    hit = total = 0
    for r in reqs:
        m = 0
        for h in r.hashes:
            if h not in seen:
                break
            m += 1
        hit += min(m, r.max_cached_blocks) * r.block_size
        total += r.num_tokens
        seen.update(r.hashes)
    return hit / total if total else 0.0


def oracle_hits(reqs: Sequence[TraceRequest]) -> list[int]:
    """Per-request reused tokens under :func:`token_oracle` (for hit-rate-over-time plots)."""
    seen: set[str] = set()
    out = []
    for r in reqs:
        m = 0
        for h in r.hashes:
            if h not in seen:
                break
            m += 1
        out.append(min(m, r.max_cached_blocks) * r.block_size)
        seen.update(r.hashes)
    return out


def snapshot_rule_ceiling(reqs: Sequence[TraceRequest], interval: int = 0) -> float:
    """Hit rate of one infinite pool under the snapshot rule (DESIGN.md §3).

    Snapshots exist at every earlier prompt's end boundary ``⌊(L−1)/B⌋`` (blocks), at every
    branch point (the depth a prompt shared with earlier ones when that depth was not already
    usable: the router's ``snapshot_at``), and, with ``interval`` > 0, at every multiple of
    ``interval`` blocks an earlier prompt computed. A request reuses the deepest snapshot
    boundary inside its exact-prefix match.
    """
    if interval < 0:
        raise ValueError(f"interval: must be ≥ 0, got {interval}")
    seen: set[str] = set()
    snaps: set[str] = set()
    hit = total = 0
    for r in reqs:
        cap = r.max_cached_blocks
        m = usable = 0
        for i, h in enumerate(r.hashes):
            if h not in seen:
                break
            m = i + 1
            if m <= cap and h in snaps:
                usable = m
        hit += usable * r.block_size
        total += r.num_tokens
        b = min(m, cap)
        if b > usable:  # branch point: the worker that computes this prompt snapshots there
            snaps.add(r.hashes[b - 1])
        if cap > 0:
            snaps.add(r.hashes[cap - 1])
        if interval:
            snaps.update(r.hashes[k - 1] for k in range(interval, cap + 1, interval))
        seen.update(r.hashes)
    return hit / total if total else 0.0


def working_set(reqs: Iterable[TraceRequest]) -> tuple[int, int]:
    """``(distinct full blocks, distinct prompt-end snapshot boundaries)`` of a trace."""
    blocks: set[str] = set()
    ends: set[str] = set()
    for r in reqs:
        blocks.update(r.hashes)
        if r.max_cached_blocks > 0:
            ends.add(r.hashes[r.max_cached_blocks - 1])
    return len(blocks), len(ends)


__all__ = [
    "DEFAULT_BLOCK",
    "DEFAULT_FINGERPRINT",
    "TRACE_BLOCK",
    "TraceRequest",
    "TraceRow",
    "block_size_of",
    "block_tokens",
    "fits",
    "load_trace",
    "oracle_hits",
    "parse_row",
    "prompt_tokens",
    "read_rows",
    "replay_slice",
    "scale_rows",
    "scaled_length",
    "snapshot_rule_ceiling",
    "token_oracle",
    "working_set",
]
