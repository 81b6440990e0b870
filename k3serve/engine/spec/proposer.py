"""The proposer interface and the n-gram (prompt lookup) proposer.

A proposer guesses the next tokens of running sequences; the target model verifies them
(:mod:`k3serve.engine.spec.accept`). It sees sequences as metadata only (tokens, params).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Protocol

import numpy as np
import torch

from k3serve.engine.sequence import Sequence as Seq


class Proposal(NamedTuple):
    """One sequence's proposed tokens.

    Attributes:
        tokens: the proposed next tokens ``d_1 … d_m`` (m ≤ the number asked; may be empty).
        probs: ``[m, V]`` float32, the distribution each ``d_j`` was drawn from (a draft
            model's, for sampled requests), or ``None``: each ``d_j`` is a deterministic
            function of the tokens before it (its distribution is one-hot).
    """

    tokens: list[int]
    probs: torch.Tensor | None = None


class Proposer(Protocol):
    """What the engine calls once per speculative step."""

    def propose(self, seqs: Sequence[Seq], num_tokens: Sequence[int]) -> list[Proposal]:
        """Propose up to ``num_tokens[i]`` tokens after ``seqs[i].token_ids`` (0: none).

        Mutates only the proposer's own state (a draft model's cache). Sequences that are
        no longer running may be forgotten here.
        """
        ...


def ngram_lookup(tokens: np.ndarray, n_min: int, n_max: int, k: int) -> list[int]:
    """Prompt lookup: the ``k`` tokens that followed the latest earlier occurrence of the
    sequence's last ``n`` tokens, for the longest ``n`` in ``[n_min, n_max]`` that occurs.

    Args:
        tokens: ``[L]`` int64, prompt + output so far.
        n_min, n_max: n-gram lengths tried, longest first. k: most tokens returned.

    Returns:
        Up to ``k`` tokens (empty when no n-gram recurs). A continuation that runs into the
        sequence's end goes on with the proposals themselves (a repeating span is proposed
        for as many periods as ``k`` allows).
    """
    length = tokens.shape[0]
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        suffix = tokens[length - n :]
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: length - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n  # the latest match's continuation
            out = tokens[start : start + k].tolist()
            while len(out) < k:  # position p ≥ length holds proposal p − length
                out.append(out[start + len(out) - length])
            return out
    return []


class NgramProposer:
    """Prompt-lookup proposals over each sequence's own prompt and output (no model).

    Args:
        n_min, n_max: n-gram lengths tried, longest first (tokens).
    """

    def __init__(self, n_min: int = 1, n_max: int = 4):
        self.n_min, self.n_max = n_min, n_max

    def propose(self, seqs: Sequence[Seq], num_tokens: Sequence[int]) -> list[Proposal]:
        out = []
        for seq, k in zip(seqs, num_tokens):
            if k <= 0:
                out.append(Proposal([]))
                continue
            arr = np.asarray(seq.token_ids, dtype=np.int64)
            out.append(Proposal(ngram_lookup(arr, self.n_min, self.n_max, k)))
        return out


__all__ = ["NgramProposer", "Proposal", "Proposer", "ngram_lookup"]
