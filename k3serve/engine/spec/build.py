"""Builds an engine's :class:`~k3serve.engine.spec.speculator.Speculator` from its config."""

from __future__ import annotations

from typing import Any

import torch

from k3serve.config import ModelConfig
from k3serve.engine.config import EngineConfig
from k3serve.engine.grammar import GrammarMasks
from k3serve.engine.spec.proposer import NgramProposer, Proposer
from k3serve.engine.spec.speculator import Speculator


def build_speculator(config: EngineConfig, model_config: ModelConfig, grammar: GrammarMasks,
                     max_model_len: int, device: torch.device, dtype: torch.dtype,
                     proposer: Proposer | None = None) -> Speculator:
    """The speculator ``config.speculative`` describes (``proposer`` replaces its proposer).

    A draft model is loaded with :func:`k3serve.model.checkpoint.load_model` and gets a cache
    of ``max_num_seqs`` (or ``num_slots``) slots and ``num_pages`` pages.

    Raises:
        ValueError: a draft model whose vocabulary differs from the target's; as
            ``load_model`` for a bad draft source.
    """
    sc = config.speculative
    assert sc is not None
    if proposer is None:
        if sc.method == "ngram":
            proposer = NgramProposer(sc.ngram_min, sc.ngram_max)
        else:
            from k3serve.engine.spec.draft import DraftProposer
            from k3serve.model.checkpoint import load_model

            net: Any
            net, cfg, _ = load_model(sc.draft_model, device, dtype)
            slots = min(config.max_num_seqs or config.num_slots, config.num_slots)
            proposer = DraftProposer(net, cfg, model_config.vocab_size, slots, config.num_pages,
                                     config.block_size, dtype, device)  # fmt: skip
    return Speculator(sc, proposer, grammar, max_model_len)


__all__ = ["build_speculator"]
