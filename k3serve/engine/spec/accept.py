"""Which proposed tokens a verify forward accepts, and the token that follows them.

Row layout of one sequence in a verify forward (``L`` known tokens, ``k`` proposed)::

    fed tokens       t0 = token_ids[L-1] | d_1 | … | d_k
    logits row j     predicts position L + j            (j = 0 … k)
    emitted          d_1 … d_a, then e_{a+1} from row a  (a accepted, 0 ≤ a ≤ k)

* Greedy rows: ``e`` is the target's own greedy token at each row (penalties and grammar masks
  applied as :func:`~k3serve.engine.sampler.sample` does); the longest prefix of proposals
  equal to it is accepted — the output is the non-speculative output, token for token.
* Sampled rows: speculative rejection sampling (Leviathan et al. 2023, "Fast Inference from
  Transformers via Speculative Decoding", Alg. 1; Chen et al. 2023): with ``p_j`` the target's
  sampling distribution at row j (penalties, grammar mask, temperature, min-p, top-k, top-p:
  :func:`~k3serve.engine.sampler.filtered_logits`) and ``q_j`` the proposal's (one-hot for a
  deterministic proposer), accept ``d_j`` when ``u_j < p_j(d_j) / q_j(d_j)``; at the first
  rejection draw ``e_j`` from ``norm(max(0, p_j − q_j))`` and stop; when all are accepted draw
  the bonus token from ``p_k`` with the plain sampler. Each emitted token is then distributed
  exactly as the non-speculative sampler's. Randomness is keyed on ``(seed, choice,
  position)`` like the sampler's: ``u_j`` and the residual's Gumbel noise come from the same
  counter-based hash, so a request's continuation depends only on its tokens and seed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from k3serve.engine.sampler import (
    SampleResult,
    SamplingRow,
    apply_penalties,
    filtered_logits,
    gumbel_noise,
    raw_logprobs,
    row_key,
    sample,
    uniform_noise,
)

# choice-index tags that keep the acceptance coins and a draft model's draws apart from the
# sampler's own noise at the same (seed, choice, position)
COIN_TAG = 1 << 41
DRAFT_TAG = 1 << 40


def coin(row: SamplingRow) -> float:
    """The acceptance uniform ``u ∈ (0, 1)`` of ``row`` (its seed, choice and position)."""
    key = row_key(row.seed, row.choice | COIN_TAG, row.position)
    return float(uniform_noise([key], torch.zeros(1, dtype=torch.int64))[0, 0])


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Leviathan et al.'s residual ``max(0, p − q)`` (unnormalised; ``[V]``)."""
    return (p - q).clamp_min(0)


def target_probs(raw: torch.Tensor, rows: Sequence[SamplingRow],
                 allowed: torch.Tensor | None) -> torch.Tensor:
    """``[R, V]`` float32: the distribution :func:`sample` draws each (non-greedy) row from."""
    x = apply_penalties(raw.float(), rows)
    if allowed is not None:
        from k3serve.structured.mask import apply_mask

        x = apply_mask(x, allowed)
    return torch.softmax(filtered_logits(x, rows), dim=-1)


def accept_greedy(logits: torch.Tensor, drafts: Sequence[int], rows: Sequence[SamplingRow],
                  allowed: torch.Tensor | None) -> list[SampleResult]:
    """Emitted tokens of a greedy row: the accepted prefix of ``drafts`` and the next token.

    Args:
        logits: ``[k+1, V]`` raw logits of the row's fed tokens. drafts: ``k`` proposals.
        rows: ``k+1`` sampling rows (row j at position ``L + j``, outputs through ``d_j``).
        allowed: ``[k+1, V]`` grammar masks or ``None``.

    Returns:
        ``a + 1`` results (``1 ≤ a + 1 ≤ k + 1``).
    """
    res = sample(logits, rows, allowed)
    a = 0
    while a < len(drafts) and res[a].token_id == drafts[a]:
        a += 1
    return res[: a + 1]


def accept_sampled(
    logits: torch.Tensor,
    drafts: Sequence[int],
    probs: torch.Tensor | None,
    rows: Sequence[SamplingRow],
    allowed: torch.Tensor | None,
    residual_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = residual,
) -> list[SampleResult]:
    """Emitted tokens of a sampled row by speculative rejection sampling (module docstring).

    Args:
        logits, drafts, rows, allowed: as :func:`accept_greedy`.
        probs: ``[k, V]`` the proposal distributions ``q_j`` (``None``: one-hot at ``d_j``).
        residual_fn: the rejection distribution (unnormalised) from ``(p_j, q_j)``; the
            default is the exact one (tests swap in wrong ones).

    Returns:
        ``a + 1`` results.
    """
    k = len(drafts)
    out: list[SampleResult] = []
    if k:
        p = target_probs(logits[:k], rows[:k], allowed[:k] if allowed is not None else None)
        for j, d in enumerate(drafts):
            if probs is None:
                q = torch.zeros_like(p[j])
                q[d] = 1.0
            else:
                q = probs[j].to(p.dtype)
            pd, qd = float(p[j, d]), float(q[d])
            if qd > 0 and coin(rows[j]) * qd < pd:
                out += raw_logprobs(logits[j : j + 1], [d], rows[j : j + 1])
                continue
            r = residual_fn(p[j], q)
            if float(r.sum()) <= 0:  # p == q: a rejection has probability 0; keep p
                r = p[j]
            key = row_key(rows[j].seed, rows[j].choice, rows[j].position)
            noise = gumbel_noise([key], torch.arange(r.shape[0], device=r.device))[0]
            tok = int((r.log() + noise).argmax())
            return out + raw_logprobs(logits[j : j + 1], [tok], rows[j : j + 1])
    bonus = sample(logits[k : k + 1], rows[k : k + 1],
                   allowed[k : k + 1] if allowed is not None else None)
    return out + bonus


def draft_sample(draft_logits: torch.Tensor, rows: Sequence[SamplingRow]) -> tuple[
        list[int], torch.Tensor]:
    """A draft model's proposals for sampled rows: ``d ~ q = softmax(filtered_logits(x))``
    (temperature and filters of each row; no penalties), with noise keyed apart from the
    target's.

    Returns:
        ``(tokens [R], q [R, V] float32)``.
    """
    q = torch.softmax(filtered_logits(draft_logits.float(), rows), dim=-1)
    keys = [row_key(r.seed, r.choice | DRAFT_TAG, r.position) for r in rows]
    noise = gumbel_noise(keys, torch.arange(q.shape[1], device=q.device))
    return (q.log() + noise).argmax(dim=-1).tolist(), q


__all__ = [
    "accept_greedy", "accept_sampled", "coin", "draft_sample", "residual", "target_probs",
]
