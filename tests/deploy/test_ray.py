"""deploy/ray_backend.py on this CPU machine, each Ray a cluster of its own (temp dir, free
ports: ``tests/parallel/ray_cluster.py``), so the tests pass beside another Ray.

1. ``ray.cluster_utils.Cluster`` with 8 nodes × 8 logical GPUs: the supernode-64 plan's 64 rank
   actors (zero-CPU placeholders) land where the config says, read back through Ray's state API.
2. The README's ``k3serve serve --ray --config deploy/configs/local-cpu.yaml`` deployment, its
   only change ``router.port`` (a fixed, free port): router + 2 prefill + 1 decode actors serve
   chat completions (openai client); killing the decode actor → Ray restarts it on fresh ports,
   the router registers it again, the next request succeeds; Ray stops and leaves no process.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path

import pytest

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # Ray on loopback (before import)
ray = pytest.importorskip("ray", reason="Ray is an extra: pip install -e '.[ray]'")

from deploy.config import load_deploy_config
from deploy.plan import make_plan
from deploy.ray_backend import check_runnable, deploy, init_local_ray, placement_layout
from tests.parallel.ray_cluster import alive as _alive
from tests.parallel.ray_cluster import free_port, local_cluster
from tests.parallel.ray_cluster import pids_with as _pids_with

CONFIGS = Path(__file__).resolve().parents[2] / "deploy" / "configs"


def test_placement_layout_gives_k3_instances_whole_nodes():
    groups, slots = placement_layout(make_plan(load_deploy_config(CONFIGS / "supernode-64.yaml")))
    assert [(len(b), s) for b, s in groups] == [(2, "STRICT_SPREAD")] * 4
    assert all(b == [{"GPU": 8.0, "CPU": 8.0}] * 2 for b, _ in groups)
    assert len(slots) == 64 and Counter(s.bundle for s in slots) == {0: 32, 1: 32}


def test_supernode_64_actors_land_where_the_config_says():
    from ray.util.state import list_actors, list_placement_groups

    with local_cluster(8, gpus_per_node=8, dashboard=True):  # the state API's server
        dc = load_deploy_config(CONFIGS / "supernode-64.yaml")
        # zero-CPU placeholders: 64 ranks fit this 2-core machine
        dc = dataclasses.replace(dc, cluster=dataclasses.replace(dc.cluster, cpus_per_rank=0))
        check_runnable(dc)  # the engine's shape rules pass (tp 8 × dp 2, ep 16)
        stack = deploy(dc, placeholders=True, ready_timeout=150)
        ids = {h._actor_id.hex(): (name, r) for name, hs in stack.ranks.items()
               for r, h in enumerate(hs)}
        infos = {name: ray.get([h.info.remote() for h in hs], timeout=150)
                 for name, hs in stack.ranks.items()}
        actors = list_actors(filters=[("state", "=", "ALIVE")], limit=1000, detail=True)
        node_of = {ids[a.actor_id]: a.node_id for a in actors if a.actor_id in ids}
        assert len(node_of) == 64
        nodes_by_instance = defaultdict(Counter)
        for (name, _r), node in node_of.items():
            nodes_by_instance[name][node] += 1
        assert sorted(nodes_by_instance) == ["decode-0", "decode-1", "prefill-0", "prefill-1"]
        # each K3 instance: 16 ranks on exactly two whole nodes, 8 per node
        assert all(sorted(c.values()) == [8, 8] for c in nodes_by_instance.values())
        used = [n for c in nodes_by_instance.values() for n in c]
        assert len(used) == len(set(used)) == 8  # no node shared by two instances
        # the actor reports agree with the state API, and each node's 8 GPUs are distinct
        for name, inf in infos.items():
            for r, i in enumerate(inf):
                assert i["node_id"] == node_of[(name, r)]
            per_node = defaultdict(set)
            for i in inf:
                per_node[i["node_id"]].update(i["gpu_ids"])
            assert all(len(g) == 8 for g in per_node.values())
        pgs = [p for p in list_placement_groups(detail=True) if p.name.startswith("k3serve-")]
        assert len(pgs) == 4 and all(p.state == "CREATED" for p in pgs)
        table = ray.util.placement_group_table()
        for p in pgs:
            t = table[p.placement_group_id]
            assert t["strategy"] == "STRICT_SPREAD"
            assert len(set(t["bundles_to_node_id"].values())) == 2  # two whole nodes
        stack.stop()


#: tokens of the stream in flight when the stack stops (longer than 10 s on a CPU)
LONG = 1500


@pytest.mark.slow
def test_local_ray_serves_restarts_and_cleans_up(tmp_path):
    from openai import OpenAI

    temp = tempfile.mkdtemp(prefix="k3ray", dir="/tmp")  # Ray's socket paths must stay short
    sd = tmp_path / "targets"
    children: list[int] = []
    try:
        init_local_ray(num_cpus=2, temp_dir=temp)
        dc = load_deploy_config(CONFIGS / "local-cpu.yaml")
        port = free_port()
        dc = dataclasses.replace(dc, router=dataclasses.replace(dc.router, port=port))
        stack = deploy(dc, sd_dir=sd, api_key="k", ready_timeout=240)
        try:
            children += [ray.get(h.info.remote())["pid"] for h in stack.workers.values()]
            rinfo = ray.get(stack.router.info.remote())
            children.append(rinfo["pid"])
            assert stack.url == rinfo["url"] == f"http://127.0.0.1:{port}"
            client = OpenAI(base_url=f"{stack.url}/v1", api_key="k", timeout=120)
            msg = [{"role": "user", "content": "The capital of France is"}]
            r = client.chat.completions.create(model="k3-tiny", messages=msg, max_tokens=6)
            assert r.choices[0].message.content and r.usage.completion_tokens >= 1
            workers = json.loads((sd / "workers.json").read_text())
            assert sorted(g["labels"]["k3serve_name"] for g in workers) == [
                "decode-0", "prefill-0", "prefill-1"]

            old = stack.urls["decode-0"]
            old_pid = ray.get(stack.workers["decode-0"].info.remote())["pid"]
            ray.kill(stack.workers["decode-0"], no_restart=False)
            deadline = time.monotonic() + 240
            new = old
            while new == old and time.monotonic() < deadline:
                try:
                    new = stack.refresh(timeout=30)["decode-0"]
                except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                    time.sleep(0.5)
            assert new != old, "Ray did not restart the decode actor"
            info = ray.get(stack.workers["decode-0"].info.remote())
            assert info["restarted"] and info["pid"] != old_pid
            children.append(info["pid"])
            # the restarted worker came back on a fresh port and registered itself again
            import httpx
            while time.monotonic() < deadline:
                body = httpx.get(f"{stack.url}/health", params={"detail": 1}, timeout=5,
                                 headers={"Authorization": "Bearer k"}).json()
                state = {w["url"]: w["healthy"] for w in body["workers"]}
                if state.get(new) and not state.get(old):
                    break
                time.sleep(0.5)
            assert state.get(new) and not state.get(old), state
            assert not _alive(old_pid)
            r = client.chat.completions.create(model="k3-tiny", messages=msg, max_tokens=6)
            assert r.choices[0].message.content
            addrs = [t for g in json.loads((sd / "workers.json").read_text())
                     for t in g["targets"]]
            assert new.removeprefix("http://") in addrs and old.removeprefix("http://") not in addrs
            # stopping drains: a stream longer than a worker's SIGKILL grace (10 s) in flight
            # when the stop begins still ends with all its tokens
            got: dict = {}
            started = threading.Event()

            def stream() -> None:
                n, finish = 0, None
                for ch in client.chat.completions.create(
                        model="k3-tiny", messages=msg, max_tokens=LONG, stream=True,
                        extra_body={"ignore_eos": True}):
                    for c in ch.choices:
                        n += 1 if c.delta.content is not None else 0
                        finish = c.finish_reason or finish
                    started.set()
                got.update(chunks=n, finish=finish)

            t = threading.Thread(target=stream, daemon=True)
            t.start()
            assert started.wait(60), "the stream did not start"
            t0 = time.monotonic()
            stack.stop(drain_s=60)
            t.join(10)
            assert got.get("finish") == "length", (got, time.monotonic() - t0)
        finally:
            stack.stop()
        assert json.loads((sd / "workers.json").read_text()) == []
    finally:
        ray.shutdown()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and (
                any(_alive(p) for p in children) or _pids_with(temp)):
            time.sleep(0.5)
        left = [p for p in children if _alive(p)] + _pids_with(temp)
        shutil.rmtree(temp, ignore_errors=True)
    assert not left, f"processes left after Ray stopped: {left}"
