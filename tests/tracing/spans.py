"""Reading the receiver's spans file (one JSON object per line, otlp_receiver.py)."""

from __future__ import annotations

import json
import time
from pathlib import Path


def read_spans(path: Path, n: int, timeout: float = 20.0) -> list[dict]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        spans = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
        if len(spans) >= n:
            return spans
        time.sleep(0.05)
    raise AssertionError(f"{len(spans)} spans received, expected {n}")
