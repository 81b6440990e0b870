"""Speculative decoding: proposers (n-gram prompt lookup, a draft model), the acceptance rule,
the policy and counters. The verify step is ``EngineCore``'s; the KDA state replay is
:mod:`k3serve.model.capture`.
"""

from k3serve.engine.spec.config import SpecConfig
from k3serve.engine.spec.proposer import NgramProposer, Proposal, Proposer
from k3serve.engine.spec.speculator import Draft, SpecStats, Speculator

__all__ = ["Draft", "NgramProposer", "Proposal", "Proposer", "SpecConfig", "SpecStats",
           "Speculator"]
