"""``k3serve simulate``: replay a trace through the router's real placement at cluster scale.

The replay harness of tests/test_placement.py, moved into the product (issue 12) and grown a
store tier, a cost model (:mod:`k3serve.simulate.calibration`) and reports:

* :mod:`k3serve.simulate.engine` — the discrete-event replay (:func:`replay`), one policy at
  a time, with the real ``GlobalIndex``, ``place`` and one ``CacheManager`` per worker;
* :mod:`k3serve.simulate.store` — the shared store (LRU over blocks and snapshots);
* :mod:`k3serve.simulate.report` — the table, the JSON document and the hit-rate plot;
* :func:`run` — every requested policy over one trace (in parallel processes), with a
  progress bar.
"""

from __future__ import annotations

from k3serve.simulate.calibration import Calibration, load_calibration
from k3serve.simulate.engine import (
    PolicyResult,
    SimConfig,
    TraceFacts,
    auto_store_interval,
    replay,
    snapshot_blocks,
    trace_facts,
)
from k3serve.simulate.runner import run

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
