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

if os.environ.get("K3SERVE_TEST_SCHED_IDLE") == "1":
    # the in-process phase of ``make test`` (tests/run_suite.py): this pytest process, and the
    # processes its tests start, run on idle CPU time only (else at nice 19; where neither is
    # allowed, at the priority they have)
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        try:
            os.nice(19)
        except OSError:
            pass

if torch is not None:
    torch.set_num_threads(1)
    if not torch.cuda.is_available():
        # Triton kernels run under the interpreter on CPU. The variable must be set before any
        # @triton.jit definition is imported, whichever test file is collected first (the
        # kernel test files set it too, but a directory or file run alone may import the
        # kernels through k3serve.model before them).
        os.environ.setdefault("TRITON_INTERPRET", "1")


#: Files whose tests bound a latency or a fault's handling time tightly against the stack's
#: own speed (a probe's latency within 2 s of the fault-free one, one key's p50 under another's
#: flood, a stopped worker out of placement within seconds, admission under a 10× overload, a
#: hung worker's waiting requests ended at the router's deadline). ``make test`` runs them
#: first, two files at a time (``-m serial``: mostly waiting, they leave most of the CPU
#: idle), with no other phase's normal-priority process beside them: only the in-process
#: tests, at the lowest priority (``tests/run_suite.py``).
SERIAL = (
    "tests/router/test_isolation.py",
    "tests/router/test_reliability.py",
    "tests/router/test_reliability_admission.py",
    "tests/worker/test_migration.py",
)

#: Files that start worker, router or CLI processes, fake stacks (``deploy.fake_stack``), live
#: stacks, Ray clusters or process groups and check what they serve, restart or clean up, with
#: bounds far above their timing on a loaded machine. A test whose servers and clients talk
#: under timeouts belongs here, not in the in-process phase, which runs at the lowest priority
#: beside the other two and may wait a long time for a core. Their time is
#: mostly waiting (process start-ups, restarts, drains), so ``make test`` runs them on two
#: pytest-xdist workers after :data:`SERIAL`, beside the in-process tests at the lowest
#: priority (``tests/run_suite.py``), one file per worker at a time (``-m stacks --dist
#: loadfile``: a module's shared stack starts once), the files of :data:`RAY` as one
#: (:func:`pytest_xdist_make_scheduler`).
STACKS = (
    "tests/bench/test_bench.py",
    "tests/bench/test_bench_block_size.py",
    "tests/bench/test_ignore_eos.py",
    "tests/bench/test_router_relay.py",
    "tests/bench/test_served_vs_offline.py",
    "tests/deploy/",
    "tests/parallel/test_parallel_disagg.py",
    "tests/parallel/test_parallel_failure.py",
    "tests/spec/test_served.py",
    "tests/test_cli.py",
    "tests/worker/",
    "tests/kvstore/test_control_isolation.py",
    "tests/kvstore/test_kvstore.py",
    "tests/kvstore/test_staging.py",
    "tests/kvstore/test_store.py",
    "tests/router/test_admission_tokens.py",
    "tests/router/test_channels.py",
    "tests/router/test_fuzz_api.py",
    "tests/router/test_index_kick.py",
    "tests/router/test_openapi_router.py",
    "tests/router/test_placement_live.py",
    "tests/router/test_prefill_retry.py",
    "tests/router/test_regressions_router.py",
    "tests/router/test_relay.py",
    "tests/router/test_replicas.py",
    "tests/router/test_router_app.py",
    "tests/router/test_router_memory.py",
    "tests/router/test_store_health.py",
    "tests/router/test_tools_e2e.py",
    "tests/tracing/test_stack_tracing.py",
)

#: The :data:`STACKS` files that start Ray clusters: scheduled as one file, so one cluster at a
#: time (``ray.init`` and Ray's state API find a cluster through files in Ray's global temp
#: dir, which two clusters started at once overwrite).
RAY = "tests/deploy/test_ray"


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects by marker
def pytest_collection_modifyitems(config, items):
    """Mark the tests of :data:`SERIAL`'s files ``serial`` and the other tests of
    :data:`STACKS`' files ``stacks``."""
    root = config.rootpath
    for item in items:
        rel = item.path.relative_to(root).as_posix()
        if rel.startswith(SERIAL):
            item.add_marker(pytest.mark.serial)
        elif rel.startswith(STACKS):
            item.add_marker(pytest.mark.stacks)


#: ``-m`` expressions of ``make test``'s phases → (the files whose tests it runs, whether those
#: are the files of the lists or all files but them). A test is ``serial`` or ``stacks`` only
#: by its file (:func:`pytest_collection_modifyitems`), so the phase's other files need not be
#: imported: :func:`pytest_ignore_collect` skips them (each import costs the collection time).
PHASES = {"serial": (SERIAL, True), "stacks": (STACKS, True),
          "not serial and not stacks": (SERIAL + STACKS, False)}


def pytest_ignore_collect(collection_path, config):
    """Under one of :data:`PHASES`' ``-m`` expressions, skip the test files (and directories)
    whose tests the expression deselects anyway; ``None`` (pytest decides) otherwise."""
    phase = PHASES.get(" ".join((config.option.markexpr or "").split()))
    if phase is None:
        return None
    paths, inside = phase
    try:
        rel = collection_path.relative_to(config.rootpath).as_posix()
    except ValueError:
        return None
    if collection_path.is_dir():
        if not inside:
            return True if rel + "/" in paths else None
        return None if any(p.startswith(rel + "/") or rel.startswith(p.rstrip("/"))
                           for p in paths) else True
    if not collection_path.name.startswith("test_"):
        return None
    return None if rel.startswith(paths) == inside else True


def pytest_xdist_make_scheduler(config, log):
    """``--dist loadfile`` with every file of :data:`RAY` in one scope (pytest-xdist's
    ``loadgroup`` marks do not reach its scheduler under pytest 9: it rewrites a node id
    attribute that pytest no longer reads), handed out first: it is the longest by far (about
    a third of the phase), and started last it would leave the other worker idle at the end."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class StacksScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return RAY if nodeid.startswith(RAY) else super()._split_scope(nodeid)

        def _assign_work_unit(self, node) -> None:
            if RAY in self.workqueue:
                self.workqueue.move_to_end(RAY, last=False)
            super()._assign_work_unit(node)

    return StacksScheduling(config, log)
