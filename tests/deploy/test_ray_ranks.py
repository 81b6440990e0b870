"""Multi-rank instances as Ray actors (deploy/ray_backend.py + k3serve/parallel/ranks.py) on the
shared ``ray.cluster_utils.Cluster`` of 3 nodes × 2 logical GPUs (tests/deploy/conftest.py:
loopback, its own temp dir and ports), the tiny model on the CPU (gloo):

* one prefill and one decode instance of 2 ranks each — tp 2 (``tp: 2, ep: 2``), then ep 2
  (``tp: 1, ep: 2``) — each instance's two ranks on two different nodes (Ray's state API):
  the openai client's greedy chat completion equals the single-process offline engine's, every
  KV transfer went over Mooncake (0 fallbacks), and both ranks of each instance joined (rank
  1's process runs ``k3serve.parallel.ranks``; ``/internal/info`` says tp / ep);
* a config the engine cannot run (``ep`` not a multiple of ``tp``, ``ep`` not dividing the
  experts, ``tp`` not dividing the heads) is refused before any actor starts, naming the field;
  ``supernode-64.yaml`` (tp 8 × dp 2 attention groups, ep 16) passes the engine's shape rules.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections import defaultdict
from pathlib import Path

import pytest

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # Ray on loopback (before import)
ray = pytest.importorskip("ray", reason="Ray is an extra: pip install -e '.[ray]'")

from deploy.config import load_deploy_config
from deploy.ray_actors import argv_port
from deploy.ray_backend import check_runnable, deploy
from k3serve.protocol import CLUSTER_TOKEN_HEADER
from tests.parallel.ray_cluster import alive, free_port

MAX_TOKENS = 6
MESSAGES = [{"role": "user", "content": "The capital of France is"}]


def ranks_config(tmp: Path, tp: int, ep: int, decode: int = 1, prefill_ep: int | None = None,
                 nodes: int = 4, gpus_per_node: int = 1, max_restarts: int = 2,
                 worker_args: tuple[str, ...] = ()) -> Path:
    """The tiny model over logical nodes of ``gpus_per_node`` GPUs (one: an instance's 2 ranks
    span 2 nodes); the prefill pool has ``prefill_ep`` (default ``ep``) and tp = ``tp`` when
    its ep > 1; ``worker_args``: the config's extra worker flags."""
    p_ep = ep if prefill_ep is None else prefill_ep
    p_tp = tp if p_ep > 1 else 1
    text = f"""
model: k3-tiny
dtype: float32
device: cpu
block_size: 16
max_restarts: {max_restarts}
worker_args: {list(worker_args)!r}
cluster:
  nodes: {nodes}
  accelerators_per_node: {gpus_per_node}
  accelerator_memory_gb: 0.2
  memory_utilization: 0.5
  resource: GPU
  cpus_per_rank: 0
router:
  host: 127.0.0.1
  port: {free_port()}
  policy: prefix_home
pools:
  prefill:
    instances: 1
    tp: {p_tp}
    ep: {p_ep}
    num_slots: 8
    num_snapshots: 8
    min_tokens: 2048
  decode:
    instances: {decode}
    tp: {tp}
    ep: {ep}
    placement: spread
    num_slots: 16
    num_snapshots: 8
    min_tokens: 2048
"""
    path = tmp / f"ranks-tp{tp}-ep{ep}.yaml"
    path.write_text(text)
    return path


@functools.cache
def oracle_text() -> tuple[str, int]:
    """The single-process offline engine's greedy answer to ``MESSAGES`` (text, tokens),
    computed once for the parametrized tests."""
    import torch

    from k3serve import LLM, SamplingParams

    torch.set_num_threads(1)
    llm = LLM("k3-tiny", block_size=16, num_pages=64)
    ids = list(llm.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True,
                                                 tokenize=True))
    out = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))[0]
    return llm.tokenizer.decode(out.token_ids), len(out.token_ids)


def metric(url: str, name: str) -> float:
    import httpx

    text = httpx.get(url + "/metrics", timeout=10, trust_env=False).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith((name + "{", name + " ")))


def rank_nodes(stack) -> dict[str, list[str]]:
    """``{instance: [node id of rank r]}`` read from Ray's state API."""
    from ray.util.state import list_actors

    ids = {h._actor_id.hex(): (name, r) for name, hs in stack.ranks.items()
           for r, h in enumerate(hs)}
    nodes: dict[str, dict[int, str]] = defaultdict(dict)
    for a in list_actors(filters=[("state", "=", "ALIVE")], limit=1000, detail=True):
        if a.actor_id in ids:
            name, r = ids[a.actor_id]
            nodes[name][r] = a.node_id
    return {n: [d[r] for r in sorted(d)] for n, d in nodes.items()}


@pytest.mark.parametrize(("tp", "ep"), [(2, 2), (1, 2)], ids=["tp2", "ep2"])
def test_two_rank_instances_span_nodes_and_match_the_offline_engine(ray_cluster, tmp_path, tp,
                                                                   ep):
    import httpx
    from openai import OpenAI

    want_text, want_n = oracle_text()
    stack = deploy(ranks_config(tmp_path, tp, ep), ready_timeout=240)
    pids: list[int] = []
    try:
        nodes = rank_nodes(stack)
        assert sorted(nodes) == ["decode-0", "prefill-0"]
        for name, ns in nodes.items():
            assert len(ns) == 2 and ns[0] != ns[1], (name, ns)  # two ranks, two nodes
        for name, hs in stack.ranks.items():
            infos = ray.get([h.info.remote() for h in hs], timeout=60)
            pids += [i["pid"] for i in infos]
            assert infos[1]["generation"] == 1 and alive(infos[1]["pid"])
            info = httpx.get(stack.urls[name] + "/internal/info", timeout=10, trust_env=False,
                             headers={CLUSTER_TOKEN_HEADER: stack.cluster_token})
            assert info.status_code == 200, info.text
            assert (info.json()["tp"], info.json()["ep"]) == (tp if name[0] == "d" or ep > 1
                                                             else 1, ep)
        client = OpenAI(base_url=f"{stack.url}/v1", api_key="none", timeout=120)
        r = client.chat.completions.create(model="k3-tiny", messages=MESSAGES,
                                           max_tokens=MAX_TOKENS, temperature=0.0)
        assert r.choices[0].message.content == want_text
        assert r.usage.completion_tokens == want_n
        d, p = stack.urls["decode-0"], stack.urls["prefill-0"]
        assert metric(d, "k3serve:kv_transfer_fallbacks_total") == 0
        assert metric(p, "k3serve:kv_transfers_total") >= 1
    finally:
        stack.stop()
    for pid in pids:
        assert not alive(pid) or _wait_gone(pid), f"rank process {pid} left behind"


def _wait_gone(pid: int, timeout: float = 30.0) -> bool:
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not alive(pid):
            return True
        time.sleep(0.3)
    return False


@pytest.mark.parametrize(("tp", "ep", "match"), [
    (2, 3, r"pools\.decode\.ep: 3 is not a multiple of tp 2"),
    (2, 6, r"pools\.decode\.ep: 6 ranks do not divide the 8 routed experts"),
    (3, 1, r"pools\.decode\.tp: 3 does not divide kda_num_heads = 4"),
], ids=["ep-not-multiple-of-tp", "ep-not-dividing-experts", "tp-not-dividing-heads"])
def test_a_config_the_engine_cannot_run_is_refused_before_any_actor(tmp_path, tp, ep, match):
    dc = load_deploy_config(ranks_config(tmp_path, 1, 2))
    pool = dataclasses.replace(dc.pools["decode"], tp=tp, ep=ep)
    dc = dataclasses.replace(dc, pools={**dc.pools, "decode": pool},
                             cluster=dataclasses.replace(dc.cluster, nodes=16))
    with pytest.raises(ValueError, match=match):
        deploy(dc)  # no ray.init here: refused before Ray is touched


def test_supernode_64_plans_and_passes_the_engine_shape_rules():
    from deploy.plan import make_plan

    dc = load_deploy_config(Path(__file__).resolve().parents[2] / "deploy" / "configs"
                            / "supernode-64.yaml")
    insts = make_plan(dc).instances
    assert [(i.ranks, i.tp, i.dp, i.nodes) for i in insts] == [(16, 8, 2, 2)] * 4
    check_runnable(dc)  # tp 8 × dp 2 attention groups, ep 16: runnable


def test_the_router_program_port_is_read_from_its_argv():
    assert argv_port(["-m", "router.app", "--host", "h", "--port", "8123"]) == 8123
    assert argv_port(["-m", "router.app", "--port", "{port}"]) == 0
    assert argv_port(["-m", "x"]) == 0
