"""What a request brings, checked and turned into sequences (no tensors, no cache).

:class:`InputProcessor` validates prompts and sampling parameters (a ``ValueError`` naming the
field), numbers sequences, builds each sequence's incremental detokenizer, and records output
tokens sampled elsewhere. :func:`request_output` turns a request into the
:class:`~k3serve.protocol.RequestOutput` the engine returns.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from k3serve.config import ModelConfig
from k3serve.engine.grammar import GrammarMasks
from k3serve.engine.sequence import Request, SeqStatus, as_token_ids
from k3serve.engine.sequence import Sequence as Seq
from k3serve.protocol import CompletionOutput, RequestOutput
from k3serve.sampling import SamplingParams, draw_seed
from k3serve.tokenizer.detok import IncrementalDetokenizer


class RenderAll:
    """``decode`` that renders special ids too (the detokenizer skips them itself)."""

    def __init__(self, tok: Any):
        self.tok = tok

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=False)


class NoText:
    """``decode`` of an engine without a tokenizer: no text."""

    def decode(self, ids: Sequence[int]) -> str:
        return ""


class InputProcessor:
    """Validation and sequence construction for one engine.

    Args:
        model_config: the model's config (vocabulary, EOS id).
        tokenizer: ``k3serve.tokenizer.Tokenizer`` or ``None`` (no text, no grammars).
        max_model_len: cap on prompt + output tokens.

    Attributes:
        grammar: the engine's :class:`~k3serve.engine.grammar.GrammarMasks`.
    """

    def __init__(self, model_config: ModelConfig, tokenizer: Any, max_model_len: int):
        self.vocab_size = model_config.vocab_size
        self.max_model_len = max_model_len
        self.grammar = GrammarMasks(tokenizer, model_config.vocab_size)
        self._seq_ids = itertools.count()
        eos = getattr(tokenizer, "eos_token_id", None)
        self._eos = model_config.eos_token_id if eos is None else eos
        specials = getattr(tokenizer, "special_tokens", None) if tokenizer is not None else None
        self._special_ids = (
            frozenset(specials.values()) if isinstance(specials, dict) else frozenset()
        )
        self._decoder = RenderAll(tokenizer) if tokenizer is not None else NoText()

    def check_prompt(self, prompt_token_ids: Sequence[int]) -> list[int]:
        """The prompt as plain ints.

        Raises:
            ValueError: an empty, out-of-vocabulary or too long prompt (``prompt_token_ids``).
        """
        ids = as_token_ids(prompt_token_ids, self.vocab_size, "prompt_token_ids")
        if not ids:
            raise ValueError("prompt_token_ids: empty prompt")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt_token_ids: {len(ids)} tokens leave no room to generate within the model "
                f"length {self.max_model_len}"
            )
        return ids

    def check_params(self, params: SamplingParams | None) -> SamplingParams:
        """``params`` (default ``SamplingParams()``) with a seed drawn when unset.

        Raises:
            ValueError: not ``SamplingParams``; stop ids outside the vocabulary; a grammar
                the vocabulary cannot serve.
        """
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params: must be SamplingParams, got {type(params).__name__}")
        v = self.vocab_size
        if any(t >= v for t in params.stop_token_ids):
            raise ValueError(f"SamplingParams.stop_token_ids: ids must be < vocab_size {v}")
        if params.grammar is not None:
            self.grammar.validate(params.grammar)  # GrammarError(ValueError)
        if params.seed is None:
            params = params.with_seed(draw_seed())
        return params

    def next_seq_id(self) -> int:
        """A fresh engine-unique sequence id (the cache manager's key)."""
        return next(self._seq_ids)

    def new_seq(
        self, req: Request, choice: int, tokens: list[int], seq_id: int | None = None
    ) -> Seq:
        """A sequence of ``req`` (appended to ``req.seqs``) with its own detokenizer.

        Args:
            req: the owning request. choice: index in ``[0, n)``.
            tokens: prompt (+ outputs) it starts with.
            seq_id: an id taken earlier with :meth:`next_seq_id` (default: a fresh one).
        """
        left = self.max_model_len - len(req.prompt_token_ids)
        detok = IncrementalDetokenizer(
            self._decoder,
            req.params,
            eos_token_id=self._eos,
            special_token_ids=self._special_ids,
            max_tokens=left,
        )
        sid = self.next_seq_id() if seq_id is None else seq_id
        seq = Seq(sid, req, choice, tokens, len(req.prompt_token_ids), detok)
        req.seqs.append(seq)
        return seq

    @staticmethod
    def feed_outputs(seq: Seq, outs: Sequence[int], logprobs: Sequence[float] | None) -> int:
        """Record output tokens sampled elsewhere (their logprobs, detokenization, stop checks).

        Returns:
            How many were consumed: all, or up to and including the one that finishes.
        """
        lps = list(logprobs) if logprobs is not None else []
        lps += [float("nan")] * (len(outs) - len(lps))
        for k, (t, lp) in enumerate(zip(outs, lps)):
            seq.logprobs.append(lp)
            if seq.request.params.logprobs is not None:
                seq.top_logprobs.append(())
            if seq.detok.step(t).finished:
                return k + 1
        return len(outs)


def request_output(req: Request, record_logits: bool) -> RequestOutput:
    """The :class:`RequestOutput` of ``req`` now (every choice; ``finished`` also when held).

    Args:
        req: the request. record_logits: include each choice's recorded logits.
    """
    outs = []
    for s in req.seqs:
        reason = s.detok.finish_reason
        if reason is None and s.status is SeqStatus.FINISHED:
            reason = "abort"
        outs.append(
            CompletionOutput(
                s.choice,
                s.detok.text,
                s.output_token_ids,
                list(s.logprobs),
                [list(x) for x in s.top_logprobs] if req.params.logprobs is not None else None,
                reason,
                s.detok.stop_reason,
                list(s.detok.text_ends) if req.params.logprobs is not None else None,
            )
        )
    held = req.seqs[0].status is SeqStatus.HELD
    return RequestOutput(
        req.request_id,
        list(req.prompt_token_ids),
        outs,
        req.num_cached_tokens or 0,
        finished=req.finished or held,
        handle=req.handle,
        logits=[list(s.logits) for s in req.seqs] if record_logits else None,
    )


__all__ = ["InputProcessor", "NoText", "RenderAll", "request_output"]
