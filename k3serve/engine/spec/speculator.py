"""The engine's speculative-decoding part: proposals with the policy applied, grammar masks
along the proposals, acceptance of a verify forward's logits, and the counters.

The step itself (pages, the verify forward, the replay of accepted tokens, emitting) is
``EngineCore``'s (:mod:`k3serve.engine.core`); this class holds what it needs besides.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from k3serve.engine.grammar import GrammarMasks
from k3serve.engine.sampler import SampleResult, SamplingRow
from k3serve.engine.sequence import Sequence as Seq
from k3serve.engine.spec.accept import accept_greedy, accept_sampled
from k3serve.engine.spec.config import SpecConfig
from k3serve.engine.spec.policy import SpecPolicy
from k3serve.engine.spec.proposer import Proposer


@dataclass
class SpecStats:
    """Counters since start.

    Attributes:
        steps: verify forwards. rows: sequence-steps verified (one per row of each).
        proposed: tokens proposed and verified. accepted: proposals accepted.
        emitted: tokens the verified rows appended (accepted + the next one, minus what a
            stop cut off).
        accepted_per_position: ``[j]``: rows whose proposal at position ``j`` (0-based) was
            accepted (a row accepting ``a`` proposals counts at positions ``0 … a−1``); as
            long as the longest proposal so far.
    """

    steps: int = 0
    rows: int = 0
    proposed: int = 0
    accepted: int = 0
    emitted: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        """``accepted / proposed`` (0 before any proposal)."""
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per sequence-step: ``emitted / rows`` (1 = no gain)."""
        return self.emitted / self.rows if self.rows else 0.0


class Draft(NamedTuple):
    """One sequence's verified-to-be proposals.

    Attributes:
        tokens: ``k`` proposed tokens. probs: ``[k, V]`` their distributions or ``None``.
        allowed: ``[k + 1, V]`` grammar masks along the proposals, or ``None``.
    """

    tokens: list[int]
    probs: torch.Tensor | None
    allowed: torch.Tensor | None


class Speculator:
    """Proposals, policy, acceptance and counters of one engine.

    Args:
        config: the :class:`SpecConfig`. proposer: the proposer it names.
        grammar: the engine's grammar masks. max_model_len: the engine's length cap.
    """

    def __init__(self, config: SpecConfig, proposer: Proposer, grammar: GrammarMasks,
                 max_model_len: int):
        self.config = config
        self.proposer = proposer
        self.grammar = grammar
        self.max_model_len = max_model_len
        self.policy = SpecPolicy(config.num_speculative_tokens, config.max_batch_size,
                                 config.cost_per_token, config.probe_interval)
        self.stats = SpecStats()

    def _limit(self, seq: Seq) -> int:
        """Proposals that still fit before ``max_tokens`` / the model length (the last
        emitted token needs no proposal)."""
        p = seq.request.params
        cap = self.max_model_len - seq.num_prompt_tokens
        if p.max_tokens is not None:
            cap = min(cap, p.max_tokens)
        return cap - len(seq.output_token_ids) - 1

    def propose(self, seqs: Sequence[Seq], budget: int) -> list[Draft]:
        """Proposals for the decoding ``seqs`` of a step (empty where the policy says none),
        at most ``budget`` tokens in all, cut at the first token a grammar forbids; a row with a
        grammar carries its masks (``allowed``) with or without proposals."""
        ks = []
        for seq in seqs:
            m = min(self.policy.num_tokens(seq.seq_id, len(seqs)), self._limit(seq), budget)
            ks.append(max(m, 0))
            budget -= ks[-1]
        props = self.proposer.propose(seqs, ks) if any(ks) else []
        out = []
        for i, seq in enumerate(seqs):
            toks, probs = (props[i].tokens[: ks[i]], props[i].probs) if ks[i] else ([], None)
            allowed = None
            if seq.request.params.grammar:  # a row without proposals still samples masked
                allowed, ok = self._walk(seq, toks)
                toks = toks[:ok]
            out.append(Draft(toks, probs[: len(toks)] if probs is not None else None, allowed))
        return out

    def _walk(self, seq: Seq, toks: list[int]) -> tuple[torch.Tensor, int]:
        """Grammar masks at the positions of ``toks`` and after them; proposals are cut at the
        first one the grammar forbids."""
        from k3serve.structured.mask import grammar_mask

        m = self.grammar.vocab().matcher(seq.request.params.grammar, seq.output_token_ids)
        masks = []
        for j, t in enumerate(toks + [None]):
            masks.append(grammar_mask([m], self.grammar.vocab_size)[0])
            if t is None or not bool(masks[-1][t]) or not m.consume(t):
                return torch.stack(masks), j
        raise AssertionError("unreachable")

    def accept(self, seq: Seq, draft: Draft, logits: torch.Tensor) -> list[SampleResult]:
        """The tokens a verify row emits (``1 ≤ n ≤ k + 1``), counted in :attr:`stats`.

        Args:
            seq: the row's sequence (its tokens end with the fed ``t0``).
            draft: its proposals. logits: ``[k + 1, V]`` the row's logits.
        """
        req, outs = seq.request, seq.output_token_ids
        prompt = req.prompt_token_ids if req.params.repetition_penalty != 1.0 else ()
        n = len(seq.token_ids)
        rows = [SamplingRow(req.params, req.seed, n + j, seq.choice, outs + draft.tokens[:j],
                            prompt) for j in range(len(draft.tokens) + 1)]  # fmt: skip
        if req.params.is_greedy:
            res = accept_greedy(logits, draft.tokens, rows, draft.allowed)
        else:
            res = accept_sampled(logits, draft.tokens, draft.probs, rows, draft.allowed)
        k, a = len(draft.tokens), len(res) - 1
        self.stats.rows += 1
        self.stats.proposed += k
        self.stats.accepted += a
        per_pos = self.stats.accepted_per_position
        per_pos.extend([0] * (k - len(per_pos)))
        for j in range(a):
            per_pos[j] += 1
        self.policy.observe(seq.seq_id, k, a)
        return res

    def forget(self, seq_id: int) -> None:
        """A sequence ended: drop its policy state."""
        self.policy.forget(seq_id)


__all__ = ["Draft", "SpecStats", "Speculator"]
