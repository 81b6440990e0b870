"""Prometheus file-based service discovery: the launcher writes what it started.

Both launcher backends (local processes, Ray actors) keep one :class:`TargetWriter` and call
``set`` when a router or worker is listening (again after a restart, on fresh ports: the
entry of that name is replaced) and ``remove`` when it stops. The writer rewrites
``router.json`` and ``workers.json`` in Prometheus' ``file_sd_configs`` format atomically
(temporary file + rename, so Prometheus never reads half a file)::

    [{"targets": ["127.0.0.1:41233"],
      "labels": {"component": "worker", "k3serve_name": "decode-0", "k3serve_pool": "decode",
                 "k3serve_deployment": "local-cpu"}}]

``deploy/prometheus/prometheus.yml`` reads ``targets/router*.json`` and
``targets/workers*.json`` beside it. Target labels avoid ``worker`` and ``role``: the
exposition of every k3serve process already carries those.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

COMPONENTS = ("router", "worker")
FILES = {"router": "router.json", "worker": "workers.json"}


@dataclass(frozen=True)
class ScrapeTarget:
    """One process Prometheus should scrape.

    Attributes:
        name: stable name across restarts (``"router"``, ``"prefill-0"``, ``"decode-0"``).
        url: its base URL (``http://host:port``); ``/metrics`` is scraped.
        component: ``"router"`` or ``"worker"``.
        pool: ``"prefill"`` / ``"decode"`` for workers, ``""`` for the router.
    """

    name: str
    url: str
    component: str
    pool: str = ""

    def __post_init__(self) -> None:
        if self.component not in COMPONENTS:
            raise ValueError(f"component: must be one of {COMPONENTS}, got {self.component!r}")
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.hostname or not parts.port:
            raise ValueError(f"url: must be http(s)://host:port, got {self.url!r}")

    @property
    def address(self) -> str:
        """``host:port`` as Prometheus wants it."""
        parts = urlsplit(self.url)
        return f"{parts.hostname}:{parts.port}"


def render_file_sd(targets: list[ScrapeTarget], deployment: str) -> list[dict]:
    """The ``file_sd_configs`` document of ``targets`` (one group per target, sorted by name)."""
    return [
        {"targets": [t.address],
         "labels": {"component": t.component, "k3serve_name": t.name,
                    **({"k3serve_pool": t.pool} if t.pool else {}),
                    "k3serve_deployment": deployment}}
        for t in sorted(targets, key=lambda t: t.name)
    ]


def write_json_atomic(path: Path, doc: object) -> None:
    """Write ``doc`` as JSON to ``path`` through a temporary file in the same folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f, indent=1)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


class TargetWriter:
    """Keeps the scrape targets of one deployment and rewrites the SD files on each change.

    Args:
        sd_dir: folder of ``router.json`` / ``workers.json`` (created).
        deployment: value of the ``k3serve_deployment`` label.

    Thread-safe: a backend may call it from supervisor threads.
    """

    def __init__(self, sd_dir: str | Path, deployment: str = "k3serve") -> None:
        self.sd_dir = Path(sd_dir)
        self.deployment = deployment
        self._targets: dict[str, ScrapeTarget] = {}
        self._lock = threading.Lock()
        self._flush()

    def set(self, target: ScrapeTarget) -> None:
        """Add ``target`` or replace the one of the same name (a restart on fresh ports)."""
        with self._lock:
            self._targets[target.name] = target
            self._flush()

    def remove(self, name: str) -> None:
        """Forget the target ``name`` (no error when unknown)."""
        with self._lock:
            if self._targets.pop(name, None) is not None:
                self._flush()

    def replace_all(self, targets: list[ScrapeTarget]) -> None:
        """Make ``targets`` the whole set (one rewrite)."""
        with self._lock:
            self._targets = {t.name: t for t in targets}
            self._flush()

    def clear(self) -> None:
        """Forget every target (the stack stopped): both files become empty lists."""
        with self._lock:
            self._targets.clear()
            self._flush()

    def targets(self) -> list[ScrapeTarget]:
        with self._lock:
            return sorted(self._targets.values(), key=lambda t: t.name)

    def _flush(self) -> None:
        for comp, fname in FILES.items():
            group = [t for t in self._targets.values() if t.component == comp]
            write_json_atomic(self.sd_dir / fname, render_file_sd(group, self.deployment))


__all__ = ["ScrapeTarget", "TargetWriter", "render_file_sd", "write_json_atomic"]
