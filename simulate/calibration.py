"""The simulator's cost model and the calibration file it is read from (docs/calibration.md).

A calibration file is JSON (schema ``k3serve.calibration/1``) describing one model on one
device: how fast a prefill worker computes prompt tokens, how big an MLA block and a KDA
snapshot are, and how fast the shared store moves them. The CPU defaults for k3-tiny ship as
``simulate/calibration_cpu_k3-tiny.json``; ``benchmarks/`` writes GPU ones.

Cost of one prefill (seconds), for a prompt of ``L`` tokens that reuses ``h_local`` tokens
from the worker's own cache and loads ``h_store`` more from the store::

    t = prefill_overhead_s + (L − h_local − h_store) / prefill_tokens_per_s
        + [h_store > 0] · (store_latency_s + store_bytes / (store_gb_per_s · 1e9))
    store_bytes = h_store · mla_bytes_per_token + snapshot_bytes

A local hit costs nothing beyond the pages it pins; a store hit is priced above it (latency +
bytes) and below recomputing (the transfer must beat ``prefill_tokens_per_s``).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

SCHEMA = "k3serve.calibration/1"
DEFAULT_CALIBRATION = Path(__file__).with_name("calibration_cpu_k3-tiny.json")

# Snapshot size in tokens of MLA latents (DESIGN.md §3): kda_state_bytes / mla_bytes_per_token.
SNAPSHOT_EQUIV_TOKENS = {"k3-tiny": 1315, "k3-mini": 2827, "k3": 16000}


@dataclass(frozen=True)
class Calibration:
    """One model on one device (all rates per prefill worker).

    Attributes:
        model: model name (``"k3-tiny"``, ``"k3-mini"``, ``"k3"``).
        device: where it was measured (``"cpu"``, ``"h200"``, …).
        prefill_tokens_per_s: prompt tokens computed per second by one prefill worker (> 0).
        prefill_overhead_s: fixed cost per prefill request, seconds (≥ 0).
        decode_tokens_per_s: tokens per second one decoding sequence advances (> 0).
        mla_bytes_per_token: MLA latents of one token over all MLA layers, bytes (> 0).
        snapshot_bytes: one KDA snapshot (recurrent + conv state of every KDA layer), bytes.
        store_gb_per_s: store → worker bandwidth, 1e9 bytes per second (> 0).
        store_latency_s: fixed cost of one store load, seconds (≥ 0).
        source: free text: how the numbers were obtained.
    """

    model: str = "k3-tiny"
    device: str = "cpu"
    prefill_tokens_per_s: float = 8000.0
    prefill_overhead_s: float = 0.0
    decode_tokens_per_s: float = 50.0
    mla_bytes_per_token: int = 320
    snapshot_bytes: int = 420_864
    store_gb_per_s: float = 1.0
    store_latency_s: float = 0.002
    source: str = ""

    def __post_init__(self) -> None:
        for f in ("prefill_tokens_per_s", "decode_tokens_per_s", "store_gb_per_s"):
            v = getattr(self, f)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0 \
                    or not math.isfinite(v):
                raise ValueError(f"calibration.{f}: must be a finite number > 0, got {v!r}")
        for f in ("prefill_overhead_s", "store_latency_s"):
            v = getattr(self, f)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or v < 0:
                raise ValueError(f"calibration.{f}: must be a number ≥ 0, got {v!r}")
        for f in ("mla_bytes_per_token", "snapshot_bytes"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"calibration.{f}: must be an int ≥ 1, got {v!r}")

    @property
    def snapshot_equiv_tokens(self) -> float:
        """One snapshot in tokens of MLA latents (k3-tiny ≈ 1,315; k3-mini ≈ 2,827; K3 ≈ 16,000)."""
        return self.snapshot_bytes / self.mla_bytes_per_token

    def prefill_seconds(self, compute_tokens: int, store_tokens: int = 0) -> float:
        """Service time of one prefill (formula in the module docstring), seconds."""
        t = self.prefill_overhead_s + compute_tokens / self.prefill_tokens_per_s
        if store_tokens > 0:
            t += self.store_seconds(store_tokens)
        return t

    def store_seconds(self, store_tokens: int) -> float:
        """Time to load ``store_tokens`` of latents and one snapshot from the store, seconds."""
        nbytes = store_tokens * self.mla_bytes_per_token + self.snapshot_bytes
        return self.store_latency_s + nbytes / (self.store_gb_per_s * 1e9)

    @property
    def store_tokens_per_s(self) -> float:
        """Latent tokens per second the store delivers (ignoring latency and the snapshot)."""
        return self.store_gb_per_s * 1e9 / self.mla_bytes_per_token

    def with_rate(self, rate: float | None) -> Calibration:
        """A copy with ``prefill_tokens_per_s = rate`` (``None``: unchanged)."""
        if rate is None:
            return self
        d = asdict(self)
        d["prefill_tokens_per_s"] = float(rate)
        return Calibration(**d)

    def to_json(self) -> dict[str, Any]:
        """The file form: ``{"schema": SCHEMA, ...fields}``."""
        return {"schema": SCHEMA, **asdict(self)}


def load_calibration(path: str | Path | None = None) -> Calibration:
    """Read a calibration file (``None``: the committed CPU default).

    Raises:
        ValueError: a file that cannot be read (``calibration: cannot read PATH (reason)``),
            not JSON, wrong ``schema``, an unknown or bad field (named).
    """
    p = Path(path) if path is not None else DEFAULT_CALIBRATION
    try:
        obj = json.loads(p.read_text())
    except OSError as e:
        raise ValueError(f"calibration: cannot read {p} ({e.strerror or e})") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"calibration: {p} is not JSON: {e.msg}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"calibration: {p} must hold a JSON object")
    if obj.get("schema") != SCHEMA:
        raise ValueError(f"calibration.schema: expected {SCHEMA!r}, got {obj.get('schema')!r}")
    known = {f.name for f in fields(Calibration)}
    extra = sorted(set(obj) - known - {"schema"})
    if extra:
        raise ValueError(f"calibration.{extra[0]}: unknown field")
    kw = {k: v for k, v in obj.items() if k != "schema"}
    for k in ("mla_bytes_per_token", "snapshot_bytes"):
        if isinstance(kw.get(k), float) and kw[k].is_integer():
            kw[k] = int(kw[k])
    return Calibration(**kw)
