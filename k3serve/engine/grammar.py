"""Structured outputs at the sampler: the allowed-token mask of each constrained row.

The grammar vocabulary is built on first use (it needs the tokenizer). Each live request keeps
one matcher per choice; a matcher that has not consumed exactly the choice's outputs (admission
after token #1 elsewhere, the decode side's fallback, a fork) is rebuilt from the grammar and
those outputs.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch

from k3serve.engine.sampler import SamplingRow
from k3serve.engine.sequence import Request


class GrammarMasks:
    """Grammar vocabulary and matchers of one engine.

    Args:
        tokenizer: the engine's tokenizer (``None``: grammars are refused).
        vocab_size: the model's vocabulary ``V`` (mask width).
    """

    def __init__(self, tokenizer: Any, vocab_size: int):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._vocab: Any = None
        self._matchers: weakref.WeakKeyDictionary[Request, dict[int, Any]] = (
            weakref.WeakKeyDictionary())

    def vocab(self) -> Any:
        """The :class:`~k3serve.structured.GrammarVocab` (built on first call).

        Raises:
            ValueError: the engine has no tokenizer.
        """
        if self._vocab is None:
            if self.tokenizer is None:
                raise ValueError("SamplingParams.grammar: the engine has no tokenizer")
            from k3serve.structured import GrammarVocab

            self._vocab = GrammarVocab(self.tokenizer, self.vocab_size)
        return self._vocab

    def validate(self, grammar: Any) -> None:
        """Raises ``GrammarError`` (a ``ValueError``) for a grammar the vocabulary cannot serve."""
        self.vocab().validate(grammar)

    def masks(self, keys: Sequence[tuple[Request, int]],
              rows: Sequence[SamplingRow]) -> tuple[torch.Tensor | None, list[Any]]:
        """Bool ``[N, V]`` allowed-token mask of the rows (``None``: no row has a grammar) and
        each row's matcher (``None`` for unconstrained rows).

        Args:
            keys: ``(request, choice)`` of each row.
            rows: the sampling rows (their params and the choice's outputs so far).
        """
        if not any(r.params.grammar for r in rows):
            return None, [None] * len(rows)
        from k3serve.structured.mask import grammar_mask

        vocab = self.vocab()
        matchers: list[Any] = []
        for (req, c), r in zip(keys, rows):
            if not r.params.grammar:
                matchers.append(None)
                continue
            by_choice = self._matchers.setdefault(req, {})
            m = by_choice.get(c)
            if m is None or m.num_consumed != len(r.output_token_ids):
                m = by_choice[c] = vocab.matcher(r.params.grammar, r.output_token_ids)
            matchers.append(m)
        width = self.vocab_size
        allowed = torch.ones(len(rows), width, dtype=torch.bool)
        idx = [i for i, m in enumerate(matchers) if m is not None]
        allowed[idx] = grammar_mask([matchers[i] for i in idx], width)
        return allowed, matchers


__all__ = ["GrammarMasks"]
