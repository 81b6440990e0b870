"""k3serve: disaggregated prefill/decode serving for Kimi K3-architecture models.

``import k3serve`` stays light (no torch): the offline API (``LLM``, ``SamplingParams``) loads
lazily on first attribute access, so the router can import ``k3serve.cache.hashing``,
``k3serve.tokenizer`` and ``k3serve.protocol`` without torch.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "LLM": ("k3serve.engine.llm", "LLM"),
    "SamplingParams": ("k3serve.sampling", "SamplingParams"),
    "ModelConfig": ("k3serve.config", "ModelConfig"),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        mod, attr = _LAZY[name]
        return getattr(importlib.import_module(mod), attr)
    raise AttributeError(f"module 'k3serve' has no attribute {name!r}")


__all__ = ["LLM", "ModelConfig", "SamplingParams", "__version__"]
