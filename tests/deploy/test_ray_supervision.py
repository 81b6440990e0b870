"""The Ray backend's supervision (deploy/ray_backend.py ``ProcessActor``) on a one-node
``ray.cluster_utils.Cluster``, cheaply: the actor runs a toy program (prints ``listening on
URL`` and sleeps) instead of a model worker. ``kill -9`` of its child → the actor starts a new
child itself (twice: ``child_restarts=2``); the third crash in a row exceeds the limit → the
actor exits and Ray restarts the actor (``max_restarts``), which starts a fresh child; no child
is left behind. (The full model stack restarted by Ray: tests/deploy/test_ray.py.)"""

from __future__ import annotations

import os
import signal
import time

import pytest

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # Ray on loopback (before import)
ray = pytest.importorskip("ray", reason="Ray is an extra: pip install -e '.[ray]'")
tenacity = pytest.importorskip("tenacity")

from deploy.ray_backend import ProcessActor

TOY = ("import itertools, time\n"
       "print('listening on http://127.0.0.1:%d' % (10000 + __import__('os').getpid() % 50000),"
       " flush=True)\n"
       "time.sleep(3600)\n")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _info_until(h, pred, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = ray.get(h.info.remote(), timeout=10)
            if pred(last):
                return last
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            pass
        time.sleep(0.2)
    raise AssertionError(f"not within {timeout:.0f} s (last info {last})")


def test_a_killed_child_is_restarted_by_the_actor_then_by_ray():
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "object_store_memory": 80 * 2**20, "node_ip_address": "127.0.0.1",
        "include_dashboard": False})
    pids: list[int] = []
    try:
        ray.init(address=cluster.address, log_to_driver=False)
        Proc = ray.remote(ProcessActor)
        h = Proc.options(max_restarts=1, num_cpus=0).remote(
            "toy", ["-c", TOY], {}, ready_timeout=60, child_restarts=2,
            backoff=tenacity.wait_fixed(0.1))
        info = ray.get(h.info.remote(), timeout=120)
        assert info["child_starts"] == 1 and not info["restarted"] and info["url"]
        for n in (2, 3):  # the actor itself restarts its child, twice
            pids.append(info["pid"])
            os.kill(info["pid"], signal.SIGKILL)
            info = _info_until(h, lambda i, n=n: i["child_starts"] == n)
            assert info["pid"] != pids[-1] and not info["restarted"]
        # the third crash in a row is past the limit: the actor exits, Ray restarts it
        pids.append(info["pid"])
        os.kill(info["pid"], signal.SIGKILL)
        info = _info_until(h, lambda i: i["restarted"], timeout=90)
        assert info["child_starts"] == 1 and info["pid"] not in pids and _alive(info["pid"])
        pids.append(info["pid"])
        assert ray.get(h.stop.remote(), timeout=30) is not None
        ray.kill(h, no_restart=True)
    finally:
        ray.shutdown()
        cluster.shutdown()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.2)
    assert not [p for p in pids if _alive(p)]
