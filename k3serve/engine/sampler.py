"""Batched token sampling with per-row parameters and position-keyed randomness.

One call picks one token for each of N rows of logits ``[N, V]``. Each row carries its own
:class:`~k3serve.sampling.SamplingParams`, its resolved seed, its choice index (``n`` > 1)
and the position of the token being sampled. Pipeline per row (vLLM v1 order)::

    raw logits ──┬─────────────────────────────────────────────▶ log_softmax ─▶ logprobs
                 └▶ penalties (repetition, frequency, presence)
                      ├─ greedy row ─▶ argmax ───────────────────────────────▶ token
                      └─ random row ─▶ / temperature ─▶ min-p ─▶ top-k ─▶ top-p
                                        ─▶ + Gumbel(seed, choice, position) ─▶ argmax ─▶ token

**Logprobs** follow vLLM's default ``logprobs_mode="raw_logprobs"``: they are the log-softmax
of the model's raw logits, before penalties, temperature and top-k/top-p/min-p filtering, so
they describe the model, not the sampler.

**Randomness** (DESIGN.md §1): Gumbel-max sampling, ``argmax(x + G)`` with
``G_v = -log(-log(U_v))``, is an exact draw from ``softmax(x)``. ``U_v`` is a counter-based hash
of ``(key, v)`` where ``key = BLAKE2b(seed, choice, position)``: no generator state, nothing
shared between rows. A row's token therefore depends only on its own logits and key — not on
batch order, batch size, the other rows, the process, or earlier calls — and a request
continues identically on another worker. The hash uses only int64 operations whose results
stay below 2**63, so it is bit-identical on CPU and CUDA (the float ``log`` after it may differ
by an ulp between devices).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import NamedTuple

import torch

from k3serve.sampling import SamplingParams

_M32 = 0xFFFFFFFF
_M64 = 0xFFFFFFFFFFFFFFFF


class SamplingRow(NamedTuple):
    """What the sampler needs to know about one row of the batch.

    Attributes:
        params: The request's sampling parameters.
        seed: The resolved seed (``params.seed``, or the one the engine drew at admission);
            any int, reduced modulo 2**64.
        position: Index the sampled token will take in the sequence: ``len(prompt) +
            len(output so far)`` (token #1 of an L-token prompt is sampled at position L).
        choice: Choice index in ``[0, params.n)``; choices of one request differ only here.
        output_token_ids: Tokens generated so far by this choice (frequency/presence and
            repetition penalties).
        prompt_token_ids: Prompt tokens (repetition penalty only; may be left empty when
            ``params.repetition_penalty == 1``).
    """

    params: SamplingParams
    seed: int
    position: int
    choice: int = 0
    output_token_ids: Sequence[int] = ()
    prompt_token_ids: Sequence[int] = ()


class SampleResult(NamedTuple):
    """The sampler's answer for one row.

    Attributes:
        token_id: The chosen token.
        logprob: Its raw log-probability (see module docstring).
        top_logprobs: ``params.logprobs`` pairs ``(token_id, logprob)``, most likely first, or
            ``None`` when the request did not ask for logprobs.
    """

    token_id: int
    logprob: float
    top_logprobs: tuple[tuple[int, float], ...] | None


# ---------------------------------------------------------------------- randomness
def row_key(seed: int, choice: int, position: int) -> int:
    """Hashes a row's ``(seed, choice, position)`` into the 64-bit key of its noise.

    Args:
        seed: Any int (reduced modulo 2**64).
        choice: Choice index, ``0 <= choice < 2**64``.
        position: Token position, ``0 <= position < 2**64``.

    Returns:
        An int in ``[0, 2**64)``: the first 8 bytes of a personalised BLAKE2b digest.

    Raises:
        ValueError: If ``choice`` or ``position`` is negative or too large.
    """
    for name, v in (("choice", choice), ("position", position)):
        if not 0 <= v <= _M64:
            raise ValueError(f"row_key: {name} must lie in [0, 2**64), got {v}")
    data = b"".join(int(v).to_bytes(8, "little") for v in (seed & _M64, choice, position))
    digest = hashlib.blake2b(data, digest_size=8, person=b"k3serve-sample").digest()
    return int.from_bytes(digest, "little")


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """``lowbias32`` integer finaliser (C. Wellons, "Hash Prospector"); a bijection on 32 bits.

    ``x`` is int64 holding values in ``[0, 2**32)``; modified in place and returned. Each
    multiplier ``c`` is applied as ``c - 2**32`` when ``c >= 2**31``: the same product modulo
    2**32, and ``|x * c| < 2**63``, so no int64 overflow occurs on any device.
    """
    x ^= x >> 16
    x.mul_(0x7FEB352D).bitwise_and_(_M32)
    x ^= x >> 15
    x.mul_(0x846CA68B - (1 << 32)).bitwise_and_(_M32)
    x ^= x >> 16
    return x


def uniform_noise(keys: Sequence[int], token_ids: torch.Tensor) -> torch.Tensor:
    """Deterministic uniform noise ``U[r, j] = (m + 0.5) / 2**23``, m = hash(keys[r], id).

    The hash is two keyed ``lowbias32`` rounds, ``m = mix(mix(id ^ k0) ^ k1) >> 9`` with
    ``(k0, k1)`` the low and high 32 bits of the key. Because the noise of a token depends only
    on (key, token id), it can be evaluated for a subset of candidate tokens.

    Args:
        keys: R row keys in ``[0, 2**64)`` (from :func:`row_key`).
        token_ids: Int64 token ids ``[R, W]``, or ``[W]`` shared by every row (e.g.
            ``torch.arange(V)``), each in ``[0, 2**32)``; its device is used.

    Returns:
        Float32 ``[R, W]`` in the open interval (0, 1) (a 23-bit m plus one half is exact in
        float32). Row r depends only on ``keys[r]`` and ``token_ids[r]``.
    """
    dev = token_ids.device
    k = torch.tensor(
        [[key & _M32, (key >> 32) & _M32] for key in keys], dtype=torch.int64, device=dev
    ).reshape(-1, 2)
    ids = token_ids.to(torch.int64)
    h = _mix32(torch.bitwise_xor(ids if ids.dim() == 2 else ids[None, :], k[:, :1]))
    h = _mix32(h.bitwise_xor_(k[:, 1:]))
    return (h >> 9).to(torch.float32).add_(0.5).mul_(1.0 / (1 << 23))


def gumbel_noise(keys: Sequence[int], token_ids: torch.Tensor) -> torch.Tensor:
    """Standard Gumbel noise ``-log(-log(U))`` over :func:`uniform_noise`; float32 ``[R, W]``."""
    return uniform_noise(keys, token_ids).log_().neg_().log_().neg_()


# ---------------------------------------------------------------------- penalties
def apply_penalties(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Applies repetition, frequency and presence penalties (vLLM order and semantics).

    With ``c[v]`` the number of times token v occurs in the row's output and ``seen[v]`` true
    when v occurs in the prompt or the output::

        x[v] = x[v] / rep   if seen[v] and x[v] > 0
        x[v] = x[v] * rep   if seen[v] and x[v] <= 0
        x[v] = x[v] - frequency_penalty * c[v] - presence_penalty * (c[v] > 0)

    (OpenAI API reference, "Parameter details"; repetition penalty: Keskar et al. 2019, CTRL.)

    Args:
        logits: Float32 ``[N, V]``; not modified.
        rows: N rows; only ``params`` penalties, ``output_token_ids`` and ``prompt_token_ids``
            are read.

    Returns:
        Float32 ``[N, V]``: ``logits`` itself when no row has a penalty, else a new tensor.

    Raises:
        ValueError: If a token id lies outside ``[0, V)``.
    """
    rep = [r.params.repetition_penalty for r in rows]
    freq = [r.params.frequency_penalty for r in rows]
    pres = [r.params.presence_penalty for r in rows]
    need_rep = any(p != 1.0 for p in rep)
    if not need_rep and not any(freq) and not any(pres):
        return logits
    n, vocab = logits.shape
    dev = logits.device

    def occurrences(ids_per_row: list[Sequence[int]], what: str) -> torch.Tensor:
        counts = torch.zeros(n, vocab, dtype=torch.float32, device=dev)
        flat = [t for ids in ids_per_row for t in ids]
        if not flat:
            return counts
        ids = torch.tensor(flat, dtype=torch.int64, device=dev)
        if int(ids.min()) < 0 or int(ids.max()) >= vocab:
            raise ValueError(f"apply_penalties: {what} token id outside [0, {vocab})")
        row = torch.repeat_interleave(
            torch.arange(n, device=dev),
            torch.tensor([len(x) for x in ids_per_row], dtype=torch.int64, device=dev),
        )
        return counts.index_put_(
            (row, ids), torch.ones_like(ids, dtype=torch.float32), accumulate=True
        )

    counts = occurrences([r.output_token_ids for r in rows], "output")
    x = logits.clone()
    if need_rep:
        seen = (counts > 0) | (
            occurrences(
                [r.prompt_token_ids if p != 1.0 else () for r, p in zip(rows, rep)], "prompt"
            )
            > 0
        )
        pen = torch.where(seen, torch.tensor(rep, device=dev)[:, None], 1.0)
        x = torch.where(x > 0, x / pen, x * pen)
    f = torch.tensor(freq, dtype=torch.float32, device=dev)[:, None]
    p = torch.tensor(pres, dtype=torch.float32, device=dev)[:, None]
    return x - f * counts - p * (counts > 0).to(torch.float32)


# ---------------------------------------------------------------------- random rows
def _sample_random(x: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Temperature, min-p, top-k, top-p, then Gumbel-max over what survives.

    Args:
        x: Penalised logits of the non-greedy rows, float32 ``[R, V]``.
        rows: The R rows.

    Returns:
        Int64 ``[R]`` token ids.

    Filtering follows vLLM: min-p on ``softmax(x / T)``; top-k keeps every token whose value
    ties with the k-th largest; top-p keeps a token when the probability mass of the tokens
    ranked strictly before it (after top-k, renormalised) is below ``top_p`` — so the top token
    always survives. With top-k or top-p the noise is evaluated only over the surviving prefix
    of the sorted row (the same values as over the full row: noise is a function of the token
    id), which makes small nuclei cheap. Which path a row takes depends on the other rows, but
    both pick the same token (they could differ only on an exact float tie of logit + noise).
    """
    keys = [row_key(row.seed, row.choice, row.position) for row in rows]
    x, top_k, top_p = _scaled(x, rows)
    if top_k is None:
        noise = gumbel_noise(keys, torch.arange(x.shape[1], device=x.device))
        return (x + noise).argmax(dim=-1)
    sx, order = _sorted_top_k_top_p(x, top_k, top_p)
    width = max(1, int((sx > float("-inf")).sum(dim=-1).max()))
    cand, cand_ids = sx[:, :width], order[:, :width]
    j = (cand + gumbel_noise(keys, cand_ids)).argmax(dim=-1, keepdim=True)
    return cand_ids.gather(1, j)[:, 0]


def filtered_logits(x: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """The random rows' sampling distribution as logits: ``softmax`` of the result is exactly
    the distribution :func:`sample` draws a non-greedy row from (``x / T``, then min-p, top-k
    with ties, top-p as in :func:`_sample_random`), filtered tokens at ``-inf``.

    Args:
        x: Penalised (and grammar-masked) logits, float32 ``[R, V]``; not modified.
        rows: The R rows (non-greedy params).

    Returns:
        Float32 ``[R, V]``.
    """
    x, top_k, top_p = _scaled(x, rows)
    if top_k is None:
        return x
    sx, order = _sorted_top_k_top_p(x, top_k, top_p)
    return torch.full_like(x, float("-inf")).scatter_(1, order, sx)


def _scaled(x: torch.Tensor, rows: Sequence[SamplingRow],
            ) -> tuple[torch.Tensor, list[int] | None, torch.Tensor]:
    """``x / T`` with min-p applied, the rows' top-k (``None`` when neither top-k nor top-p
    filters any row) and top-p ``[R, 1]``."""
    vocab, dev = x.shape[1], x.device
    params = [row.params for row in rows]
    x = x / torch.tensor([p.temperature for p in params], device=dev)[:, None]
    min_p = torch.tensor([p.min_p for p in params], device=dev)[:, None]
    if bool((min_p > 0).any()):
        probs = torch.softmax(x, dim=-1)
        x = x.masked_fill(probs < probs.amax(dim=-1, keepdim=True) * min_p, float("-inf"))
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    top_p = torch.tensor([p.top_p for p in params], device=dev)[:, None]
    if all(k == vocab for k in top_k) and not bool((top_p < 1).any()):
        return x, None, top_p
    return x, top_k, top_p


def _sorted_top_k_top_p(x: torch.Tensor, top_k: list[int], top_p: torch.Tensor,
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` sorted descending (stable) with the tokens past top-k (ties kept) and past
    top-p at ``-inf``, and the sort order."""
    sx, order = x.sort(dim=-1, descending=True, stable=True)
    kth = sx.gather(1, torch.tensor(top_k, device=x.device)[:, None] - 1)
    sx = sx.masked_fill(sx < kth, float("-inf"))
    probs = torch.softmax(sx, dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    return sx.masked_fill((mass_before >= top_p) & (top_p < 1), float("-inf")), order


def raw_logprobs(raw: torch.Tensor, tokens: Sequence[int],
                 rows: Sequence[SamplingRow]) -> list[SampleResult]:
    """:class:`SampleResult` of given tokens: each one's raw logprob and the row's top
    ``params.logprobs`` alternatives (as :func:`sample` reports them).

    Args:
        raw: Float32 ``[N, V]`` raw logits. tokens: N chosen ids. rows: the N rows.
    """
    logprobs = torch.log_softmax(raw.float(), dim=-1)
    idx = torch.tensor(list(tokens), dtype=torch.int64, device=raw.device)
    chosen = logprobs.gather(1, idx[:, None])[:, 0].tolist()
    max_n = max((r.params.logprobs or 0) for r in rows) if rows else 0
    top_ids: list[list[int]] = [[] for _ in rows]
    top_lp: list[list[float]] = [[] for _ in rows]
    if max_n > 0:
        vals, ids = logprobs.topk(min(max_n, raw.shape[1]), dim=-1)
        top_ids, top_lp = ids.tolist(), vals.tolist()
    out = []
    for i, (r, tok) in enumerate(zip(rows, tokens)):
        k = r.params.logprobs
        top = None if k is None else tuple(zip(top_ids[i][:k], top_lp[i][:k]))
        out.append(SampleResult(int(tok), chosen[i], top))
    return out


# ---------------------------------------------------------------------- entry point
def sample(logits: torch.Tensor, rows: Sequence[SamplingRow],
           allowed: torch.Tensor | None = None) -> list[SampleResult]:
    """Samples one token per row.

    Args:
        logits: ``[N, V]`` model logits for the next token of each row; float32 (other float
            dtypes are upcast), any device. Not modified.
        rows: N :class:`SamplingRow`, row i describing ``logits[i]``.
        allowed: optional bool ``[N, V]`` grammar mask (structured outputs,
            :mod:`k3serve.structured.mask`): disallowed tokens get ``-inf`` after the penalties
            and before greedy / temperature / filtering, so they are never picked. Logprobs stay
            raw (the model's distribution, as vLLM's ``raw_logprobs``).

    Returns:
        N :class:`SampleResult`, in row order. Row i's result depends only on ``logits[i]`` and
        ``rows[i]``.

    Raises:
        ValueError: If ``logits`` is not 2-D with N rows, a row's choice/position is out of
            range, or a penalty token id lies outside ``[0, V)``.
    """
    if logits.dim() != 2 or logits.shape[0] != len(rows):
        raise ValueError(
            f"sample: logits must be [N, V] with N = len(rows) = {len(rows)}, "
            f"got {tuple(logits.shape)}"
        )
    raw = logits.float()
    n, vocab = raw.shape
    dev = raw.device
    if n == 0:
        return []

    x = apply_penalties(raw, rows)
    if allowed is not None:
        from k3serve.structured.mask import apply_mask

        x = apply_mask(x, allowed)
    tokens = torch.empty(n, dtype=torch.int64, device=dev)
    greedy = [i for i, r in enumerate(rows) if r.params.is_greedy]
    rand = [i for i, r in enumerate(rows) if not r.params.is_greedy]
    if greedy:
        gi = torch.tensor(greedy, device=dev)
        tokens[gi] = x[gi].argmax(dim=-1)
    if rand:
        ri = torch.tensor(rand, device=dev)
        tokens[ri] = _sample_random(x[ri], [rows[i] for i in rand])

    logprobs = torch.log_softmax(raw, dim=-1)
    chosen = logprobs.gather(1, tokens[:, None])[:, 0].tolist()
    max_n = max((r.params.logprobs or 0) for r in rows)
    top_ids: list[list[int]] = [[] for _ in rows]
    top_lp: list[list[float]] = [[] for _ in rows]
    if max_n > 0:
        vals, ids = logprobs.topk(min(max_n, vocab), dim=-1)
        top_ids, top_lp = ids.tolist(), vals.tolist()

    out = []
    for i, (r, tok) in enumerate(zip(rows, tokens.tolist())):
        k = r.params.logprobs
        top = None if k is None else tuple(zip(top_ids[i][:k], top_lp[i][:k]))
        out.append(SampleResult(tok, chosen[i], top))
    return out
