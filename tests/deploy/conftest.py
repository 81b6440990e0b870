"""The Ray cluster the multi-rank Ray files share: 3 nodes × 2 logical GPUs with the dashboard
(Ray's state API), started once by the first test that asks for ``ray_cluster`` and shut down
after the last test in a row that uses it, so a test that starts a Ray of its own never runs
beside it (two clusters at once overwrite each other's files in Ray's global temp dir)."""

from __future__ import annotations

import pytest

RAY_CLUSTER_SHAPE = {"nodes": 3, "gpus_per_node": 2, "dashboard": True}


@pytest.fixture
def ray_cluster():
    """The shared ``ray.cluster_utils.Cluster`` (:data:`RAY_CLUSTER_SHAPE`), this process
    connected (``tests/parallel/ray_cluster.py``: ``SHARED``)."""
    from tests.parallel.ray_cluster import SHARED

    return SHARED.get(**RAY_CLUSTER_SHAPE)


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    """Shut the shared cluster down after a test that used it when the next test does not."""
    if "ray_cluster" in item.fixturenames and (
            nextitem is None or "ray_cluster" not in nextitem.fixturenames):
        from tests.parallel.ray_cluster import SHARED

        SHARED.close()
