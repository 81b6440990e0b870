"""Suite-wide settings.

CI runs on 2 cores; tests that start worker processes share them with the test process. One
intra-op thread per process keeps small-tensor work fast and the machine responsive. Without a
CUDA device, Triton kernels run under its interpreter (``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

try:
    import torch
except ImportError:  # the torch-free parts of the suite still run
    torch = None

if torch is not None:
    torch.set_num_threads(1)
    if not torch.cuda.is_available():
        # Triton kernels run under the interpreter on CPU. The variable must be set before any
        # @triton.jit definition is imported, whichever test file is collected first (the
        # kernel test files set it too, but a directory or file run alone may import the
        # kernels through k3serve.model before them).
        os.environ.setdefault("TRITON_INTERPRET", "1")


#: Files whose tests bound how long something takes under faults, drains or load (a worker
#: leaving placement, a reservation's release, a drain, a latency ratio, a restart), or start Ray
#: clusters or stacks whose timing they depend on. ``make test`` runs them in one process after
#: the rest (``-m serial``), so their processes have the machine's cores to themselves;
#: everything else — live stacks whose tests only check outputs included — runs on two
#: pytest-xdist workers first (``-m "not serial"``).
SERIAL = (
    "tests/bench/test_served_vs_offline.py",
    "tests/deploy/",
    "tests/parallel/test_parallel_failure.py",
    "tests/worker/",
    "tests/kvstore/test_control_isolation.py",
    "tests/kvstore/test_kvstore.py",
    "tests/router/test_channels.py",
    "tests/router/test_index_kick.py",
    "tests/router/test_isolation.py",
    "tests/router/test_placement_live.py",
    "tests/router/test_prefill_retry.py",
    "tests/router/test_regressions_router.py",
    "tests/router/test_reliability.py",
    "tests/router/test_reliability_admission.py",
    "tests/router/test_replicas.py",
    "tests/router/test_router_memory.py",
    "tests/router/test_store_health.py",
    "tests/tracing/test_stack_tracing.py",
)


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects by marker
def pytest_collection_modifyitems(config, items):
    """Mark the tests of :data:`SERIAL`'s files ``serial``."""
    root = config.rootpath
    for item in items:
        rel = item.path.relative_to(root).as_posix()
        if rel.startswith(SERIAL):
            item.add_marker(pytest.mark.serial)
