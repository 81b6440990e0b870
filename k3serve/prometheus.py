"""Prometheus exposition shared by the router and the workers (torch-free).

The metric names are DESIGN.md §6's exactly, so the ``*_created`` series that
prometheus-client adds beside every counter and histogram are left out.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST


class _WithoutCreated:
    """A registry view that drops the ``*_created`` samples (each collect builds fresh
    families, so the registry itself is untouched)."""

    def __init__(self, registry: Any) -> None:
        self._registry = registry

    def collect(self):
        for fam in self._registry.collect():
            fam.samples = [s for s in fam.samples if not s.name.endswith("_created")]
            yield fam


def render(registry: Any) -> tuple[bytes, str]:
    """``(body, content type)`` of ``GET /metrics`` for ``registry``, without ``*_created``."""
    return generate_latest(_WithoutCreated(registry)), CONTENT_TYPE_LATEST
