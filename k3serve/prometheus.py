"""Prometheus exposition shared by the router and the workers (torch-free).

The metric names are DESIGN.md §6's exactly, so the ``*_created`` series that
prometheus-client adds beside every counter and histogram are switched off, process-wide, with
:func:`prometheus_client.disable_created_metrics` when this module is imported.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import disable_created_metrics, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

disable_created_metrics()


def render(registry: Any) -> tuple[bytes, str]:
    """``(body, content type)`` of ``GET /metrics`` for ``registry``, without ``*_created``."""
    return generate_latest(registry), CONTENT_TYPE_LATEST
