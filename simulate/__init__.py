"""``k3serve simulate``: replay a trace through the router's real placement at cluster scale.

The replay harness of tests/router/test_placement.py in the product, with a store tier, a cost
model (:mod:`simulate.calibration`) and reports:

* :mod:`simulate.engine` — the discrete-event replay (:func:`replay`), one policy at
  a time, with the real ``GlobalIndex``, ``place`` and one ``CacheManager`` per worker;
  its inputs and results in :mod:`simulate.config`;
* :mod:`simulate.traces` — trace loading, the block-id → tokens mapping, the ceilings;
  :mod:`simulate.tracegen` — the conversation and agent generators;
* :mod:`kvstore.store.sim` — the shared store (LRU over blocks and snapshots);
* :mod:`simulate.report` — the table, the JSON document and the hit-rate plot;
* :func:`run` — every requested policy over one trace (in parallel processes), with a
  progress bar.
"""

from __future__ import annotations

from simulate.calibration import Calibration, load_calibration
from simulate.config import (
    PolicyResult,
    SimConfig,
    TraceFacts,
    auto_store_interval,
    snapshot_blocks,
    trace_facts,
)
from simulate.engine import replay
from simulate.runner import run

__all__ = [
    "Calibration",
    "PolicyResult",
    "SimConfig",
    "TraceFacts",
    "auto_store_interval",
    "load_calibration",
    "replay",
    "run",
    "snapshot_blocks",
    "trace_facts",
]
