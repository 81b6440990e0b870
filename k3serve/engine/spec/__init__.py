"""Speculative decoding: proposers (n-gram prompt lookup, a draft model), the acceptance rule,
the policy and counters. The verify step is ``EngineCore``'s; the KDA state replay is
:mod:`k3serve.model.capture`.

:class:`SpecConfig` imports without torch (worker flags are checked with it); the rest loads
on first use.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

from k3serve.engine.spec.config import SpecConfig

_LAZY = {
    "NgramProposer": "k3serve.engine.spec.proposer",
    "Proposal": "k3serve.engine.spec.proposer",
    "Proposer": "k3serve.engine.spec.proposer",
    "Draft": "k3serve.engine.spec.speculator",
    "SpecStats": "k3serve.engine.spec.speculator",
    "Speculator": "k3serve.engine.spec.speculator",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["Draft", "NgramProposer", "Proposal", "Proposer", "SpecConfig", "SpecStats",
           "Speculator"]
